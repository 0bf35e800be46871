"""RMS normalisation as the Qwen3 family computes it (statistics in float32, scale in the input dtype).

Inside a ``torch.compile`` graph the norm runs as one opaque op (``omnistage::rms_norm``) with the eager
body: inductor's own reduction sums the squares in another order (measured: outputs off by ~1e-6), which
would make compiled paths differ from the eager path, and so from the reference, in the last bits.
"""

from __future__ import annotations

import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    # Cast back before scaling so low-precision runs round where the reference rounds.
    return weight * xf.to(x.dtype)


@torch.library.custom_op("omnistage::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm(x, weight, eps)


@_rms_norm_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x.new_empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return _rms_norm_op(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)
