"""Checkpoints omnistage builds itself, offline: the built-in default model and the random-weight checkpoint builder
(the real HF format, every family)."""

from omnistage.checkpoints.default_model import default_model_dir

__all__ = ["build_checkpoint", "default_model_dir"]


def __getattr__(name: str):
    if name == "build_checkpoint":  # pulls in transformers; import lazily
        from omnistage.checkpoints.builder import build_checkpoint

        return build_checkpoint
    raise AttributeError(name)
