"""Self-attention with per-head q/k RMSNorm and rotary embedding (Qwen3 style).

The module only projects, normalises and rotates; the caller supplies ``attend(q, k, v, scale)`` so the same
weights serve the paged KV cache of the big decoders and the small contiguous cache of the code predictor.
q, k and v come from one GEMM over a stacked weight that loads and saves as the checkpoint's
``q_proj``/``k_proj``/``v_proj`` (see ``fused.py``); stacking leaves each output element's sum unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from omnistage.models.layers.fused import fuse_parts, stacked_rows
from omnistage.models.layers.norm import RMSNorm
from omnistage.models.layers.rotary import apply_rotary

# attend(q [..., heads, dim], k [..., kv_heads, dim], v [..., kv_heads, dim], scale) -> [..., heads, dim]
AttendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


class QKNormAttention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rms_norm_eps: float,
        bias: bool = False,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.split_sizes = (num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim)
        self.qkv_proj = nn.Linear(hidden_size, sum(self.split_sizes), bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)
        self.q_norm = RMSNorm(head_dim, rms_norm_eps)
        self.k_norm = RMSNorm(head_dim, rms_norm_eps)
        for kind in ("weight", "bias") if bias else ("weight",):
            names = tuple(f"{p}_proj.{kind}" for p in "qkv")
            fuse_parts(self, f"qkv_proj.{kind}", stacked_rows(names, self.split_sizes))

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: AttendFn
    ) -> torch.Tensor:
        """x: [..., hidden]; cos/sin: [..., head_dim] -> [..., hidden]."""
        lead = x.shape[:-1]
        q, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        q = self.q_norm(q.reshape(*lead, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(*lead, self.num_kv_heads, self.head_dim))
        v = v.reshape(*lead, self.num_kv_heads, self.head_dim)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        out = attend(q, k, v, self.scale)
        return self.o_proj(out.reshape(*lead, self.num_heads * self.head_dim))
