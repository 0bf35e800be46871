"""Who owns a step's output tensor once the next step starts.

A graph output or a persistent buffer is overwritten by the next step, so a consumer that reads it later
needs a copy (`snapshot`). A tensor allocated fresh for this step can be handed over as it is; the
producer says so by wrapping it in `OwnedBatchTensor`. The wrapper is a promise by the producer (it is
not checked): nothing else writes this storage after the hand-over.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OwnedBatchTensor:
    """A freshly allocated tensor whose ownership passes to the consumer (no copy needed)."""

    tensor: torch.Tensor

    def __post_init__(self) -> None:
        if not isinstance(self.tensor, torch.Tensor):
            raise TypeError(f"OwnedBatchTensor wraps a tensor, got {type(self.tensor).__name__}")


def snapshot(t: torch.Tensor) -> torch.Tensor:
    """A copy with its own storage: keeps its values when the source buffer is reused."""
    return t.detach().clone()


def take(x: torch.Tensor | OwnedBatchTensor) -> torch.Tensor:
    """An owned tensor either way: marked-owned passes through, anything else is snapshotted."""
    if isinstance(x, OwnedBatchTensor):
        return x.tensor
    if isinstance(x, torch.Tensor):
        return snapshot(x)
    raise TypeError(f"take() expects a tensor or OwnedBatchTensor, got {type(x).__name__}")
