"""omnistage: a streaming multi-stage engine and OpenAI-compatible server for omni-modal models."""

from omnistage.core.sampling_params import SamplingParams

__all__ = ["AsyncOmni", "Omni", "SamplingParams"]


def __getattr__(name: str):
    # The engine APIs import torch models and transformers; load them only when asked for.
    if name in ("Omni", "AsyncOmni"):
        from omnistage.pipeline import omni

        return getattr(omni, name)
    raise AttributeError(name)
