"""1-D rotary position embedding over flattened token rows.

Qwen3-Omni's MRoPE splits the rotary frequencies between a temporal, a height and a width position id. For
text-only input the three ids are equal, so the interleaving is the identity and plain 1-D RoPE is exact.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


def _getter(cfg: Any) -> Any:
    """A field of a config object or of its config.json section (None where absent)."""
    return cfg.get if isinstance(cfg, Mapping) else lambda name: getattr(cfg, name, None)


def rope_kind(cfg: Any) -> str:
    """A transformers config's rope type (v5 ``rope_parameters`` or the older ``rope_scaling``), from the config
    object or its config.json section."""
    get = _getter(cfg)
    params = get("rope_parameters") or {}
    scaling = get("rope_scaling") or {}
    return params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default"))) or "default"


def rope_theta(cfg: Any, default: float | None = None) -> float:
    """The rotary base of a transformers config or its config.json section (v5 ``rope_parameters`` or the older
    flat field); ``default`` where it has none (None: an error)."""
    get = _getter(cfg)
    theta = (get("rope_parameters") or {}).get("rope_theta", get("rope_theta"))
    if theta is None and default is None:
        raise ValueError("config has no rope_theta")
    return float(default if theta is None else theta)


def rope_frequencies(cfg: Any, head_dim: int) -> tuple[tuple[float, ...] | None, float]:
    """(inverse frequencies, cos/sin scale) of a scaled rope type, as transformers computes them (``linear``,
    ``yarn``, ``llama3``, ...); (None, 1.0) for the default one (``RotaryEmbedding`` computes it from theta).
    Types whose frequencies change with the sequence length (``dynamic``, ``longrope``: transformers recomputes
    them every forward) are refused: cached keys keep the frequencies of the step that wrote them."""
    kind = rope_kind(cfg)
    if kind == "default":
        return None, 1.0
    if "dynamic" in kind or kind == "longrope":
        raise ValueError(f"rope_type {kind!r} changes its frequencies with the sequence length: not supported "
                         "(a cached key keeps the frequencies it was rotated with)")
    if kind not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unknown rope_type {kind!r}; known: {sorted(ROPE_INIT_FUNCTIONS)}")
    inv_freq, scale = ROPE_INIT_FUNCTIONS[kind](cfg)
    if inv_freq.numel() != head_dim // 2:
        raise ValueError(f"rope_type {kind!r} rotates {2 * inv_freq.numel()} of {head_dim} head dims: a partial "
                         "rotary embedding is not supported")
    return tuple(inv_freq.float().tolist()), float(scale)


class RotaryEmbedding(nn.Module):
    """Computes cos/sin tables for a step's positions once; every layer reuses them. ``inv_freq`` / ``scale``: a
    scaled rope type's frequencies and cos/sin factor (``rope_frequencies``); default: theta's."""

    def __init__(self, head_dim: int, theta: float, inv_freq: Sequence[float] | None = None,
                 scale: float = 1.0) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embedding, got {head_dim}")
        if inv_freq is None:
            freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        else:
            freqs = torch.tensor(inv_freq, dtype=torch.float)
            if freqs.numel() != head_dim // 2:
                raise ValueError(f"{freqs.numel()} rotary frequencies for head_dim {head_dim}")
        self.inv_freq = nn.Buffer(freqs, persistent=False)
        self.scale = scale

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [...] integer -> (cos, sin) of shape [..., head_dim] in ``dtype``."""
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)
        return cos_sin(torch.cat((freqs, freqs), dim=-1), self.scale, dtype)


def cos_sin(angles: torch.Tensor, scale: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of float32 ``angles``, times ``scale`` (a scaled rope type's factor, as transformers applies
    it before the cast), in ``dtype``."""
    cos, sin = angles.cos(), angles.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., heads, head_dim]; cos/sin: [..., head_dim] (broadcast over the heads axis)."""
    cos = cos.unsqueeze(-2)
    sin = sin.unsqueeze(-2)
    return x * cos + _rotate_half(x) * sin
