"""Test helpers (tests and benchmarks only; the product never imports them): reference loaders, media test files,
streaming reports."""
