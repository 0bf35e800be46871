"""Offline test checkpoints: the built-in default model and the checkpoint builder."""

from omnistage.testing.default_model import default_model_dir

__all__ = ["build_checkpoint", "default_model_dir"]


def __getattr__(name: str):
    if name == "build_checkpoint":  # pulls in transformers; import lazily
        from omnistage.testing.checkpoint import build_checkpoint

        return build_checkpoint
    raise AttributeError(name)
