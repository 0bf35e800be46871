"""RMS normalisation as the Qwen3 family computes it (statistics in float32, scale in the input dtype).

Inside a ``torch.compile`` graph the norm keeps its eager numerics (``compiled.eager_in_graphs``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.models.layers.compiled import eager_in_graphs


@eager_in_graphs("rms_norm")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == weight.dtype == torch.float32:
        # torch's own op computes the same expression in the same order (bitwise equal; tests/models/
        # test_fast_paths.py) in one call instead of six.
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    # Statistics in float32 through the same op (the reference expression's bits), cast back before scaling
    # so low-precision runs round where the reference rounds.
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
