"""1-D rotary position embedding over flattened token rows.

Qwen3-Omni's MRoPE splits the rotary frequencies between a temporal, a height and a width position id. For
text-only input the three ids are equal, so the interleaving is the identity and plain 1-D RoPE is exact.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def rope_theta(cfg: Any) -> float:
    """The rotary base of a transformers text config (v5 ``rope_parameters`` or the older flat fields)."""
    params = getattr(cfg, "rope_parameters", None) or {}
    scaling = getattr(cfg, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type not in ("default", None):
        raise ValueError(f"rope_type {rope_type!r} is not supported (only the default rotary embedding is)")
    theta = params.get("rope_theta", getattr(cfg, "rope_theta", None))
    if theta is None:
        raise ValueError("config has no rope_theta")
    return float(theta)


class RotaryEmbedding(nn.Module):
    """Computes cos/sin tables for a step's positions once; every layer reuses them."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embedding, got {head_dim}")
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [...] integer -> (cos, sin) of shape [..., head_dim] in ``dtype``."""
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., heads, head_dim]; cos/sin: [..., head_dim] (broadcast over the heads axis)."""
    cos = cos.unsqueeze(-2)
    sin = sin.unsqueeze(-2)
    return x * cos + _rotate_half(x) * sin
