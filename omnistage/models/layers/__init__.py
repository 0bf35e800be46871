"""Building blocks shared by the omnistage model implementations."""
