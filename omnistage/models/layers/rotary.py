"""1-D rotary position embedding over flattened token rows.

Qwen3-Omni's MRoPE splits the rotary frequencies between a temporal, a height and a width position id. For
text-only input the three ids are equal, so the interleaving is the identity and plain 1-D RoPE is exact.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
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
    """(inverse frequencies, cos/sin scale) of a scaled rope type, as transformers computes them at load
    (``linear``, ``yarn``, ``llama3``, ...; for ``dynamic`` and ``longrope`` the frequencies of rows at or below
    their original length: ``length_scaling`` gives the others); (None, 1.0) for the default one
    (``RotaryEmbedding`` computes it from theta)."""
    kind = rope_kind(cfg)
    if kind == "default":
        return None, 1.0
    if kind not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unknown rope_type {kind!r}; known: {sorted(ROPE_INIT_FUNCTIONS)}")
    try:
        inv_freq, scale = ROPE_INIT_FUNCTIONS[kind](cfg)
    except (ArithmeticError, KeyError, TypeError, ValueError) as exc:  # (transformers' own load fails alike)
        raise ValueError(f"rope_type {kind!r}: its parameters give no frequencies ({type(exc).__name__}: {exc}); "
                         f"rope_parameters {_getter(cfg)('rope_parameters') or _getter(cfg)('rope_scaling')}") from None
    if inv_freq.numel() != head_dim // 2:
        raise ValueError(f"rope_type {kind!r} rotates {2 * inv_freq.numel()} of {head_dim} head dims: a partial "
                         "rotary embedding is not supported")
    return tuple(inv_freq.float().tolist()), float(scale)


@dataclass(frozen=True)
class LengthScaling:
    """A rope type whose frequencies follow the length of the forward a row is computed in (``dynamic`` NTK,
    ``longrope``): transformers recomputes them each forward from its largest position + 1 (``seq_len``), the
    type's base frequencies at or below ``original``. A row's length is what that forward would have been in
    transformers' generate: its prompt's for prompt rows, its own position + 1 for a decode row. Cached keys
    keep the frequencies they were rotated with, as there. (transformers' module also keeps the frequencies of the
    longest forward it saw until a forward *shorter* than ``original`` resets them, so there a request whose
    prompt is exactly ``original`` long, or a code-predictor frame when ``original`` is 2, takes the previous
    one's; here every forward's are what a freshly loaded model computes.)"""

    kind: str
    original: float
    config: Any = field(compare=False, repr=False)  # what transformers' rope function reads
    _cache: dict[float, torch.Tensor] = field(default_factory=dict, init=False, compare=False, repr=False)

    def frequencies(self, length: float) -> torch.Tensor | None:
        """[head_dim / 2] float32 inverse frequencies of a row whose forward is ``length`` long; None: the
        base ones (``rope_frequencies``)."""
        if length <= self.original:
            return None
        if self.kind == "longrope":
            length = self.original + 1  # (one long set past the original length, as transformers keeps it)
        freqs = self._cache.get(length)
        if freqs is None:
            if len(self._cache) >= _MAX_CACHED_LENGTHS:  # (decode lengths only grow: start over, never unbounded)
                self._cache.clear()
            # seq_len as transformers passes it (a tensor: its arithmetic is float32's, not Python's)
            seq_len = torch.tensor(int(length) if float(length).is_integer() else float(length))
            freqs = ROPE_INIT_FUNCTIONS[self.kind](self.config, None, seq_len=seq_len)[0].float()
            self._cache[length] = freqs
        return freqs


_MAX_CACHED_LENGTHS = 4096


def length_scaling(cfg: Any) -> LengthScaling | None:
    """The config's rope as a ``LengthScaling`` where its frequencies follow the sequence length (transformers'
    ``dynamic_rope_update``: a type containing ``dynamic``, or ``longrope``), else None. ``cfg``: the config
    object transformers' rope functions read."""
    kind = rope_kind(cfg)
    if "dynamic" not in kind and kind != "longrope":
        return None
    if kind not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unknown rope_type {kind!r}; known: {sorted(ROPE_INIT_FUNCTIONS)}")
    if kind == "longrope":
        original = (_getter(cfg)("rope_parameters") or {}).get("original_max_position_embeddings")
    else:
        original = _getter(cfg)("max_position_embeddings")
    if original is None:
        raise ValueError(f"rope_type {kind!r} needs the original length its frequencies scale from "
                         f"({'original_max_position_embeddings' if kind == 'longrope' else 'max_position_embeddings'})")
    return LengthScaling(kind, float(original), cfg)


class RotaryEmbedding(nn.Module):
    """Computes cos/sin tables for a step's positions once; every layer reuses them. ``inv_freq`` / ``scale``: a
    scaled rope type's frequencies and cos/sin factor (``rope_frequencies``); default: theta's. ``length``: the
    rope type's scaling where its frequencies follow the forward's length (callers then give each row's
    frequencies: ``row_frequencies``)."""

    def __init__(self, head_dim: int, theta: float, inv_freq: Sequence[float] | None = None,
                 scale: float = 1.0, length: LengthScaling | None = None) -> None:
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
        self.length = length

    def frequencies_for(self, length: float) -> torch.Tensor:
        """[head_dim / 2] float32 inverse frequencies of a forward ``length`` long (a ``length`` scaling's; the
        base ones where the rope does not follow the length)."""
        scaled = None if self.length is None else self.length.frequencies(length)
        return self.inv_freq.cpu() if scaled is None else scaled

    def row_frequencies(self, lengths: Sequence[float]) -> torch.Tensor:
        """[N, head_dim / 2] float32 inverse frequencies of N rows whose forwards are ``lengths`` long."""
        if not lengths:
            return self.inv_freq.new_empty(0, self.inv_freq.numel(), device="cpu")
        return torch.stack([self.frequencies_for(n) for n in lengths])

    def forward(self, positions: torch.Tensor, dtype: torch.dtype,
                freqs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [N] -> (cos, sin) of shape [N, head_dim] in ``dtype``; ``freqs``: the inverse frequencies, each
        row's [N, head_dim / 2] (``row_frequencies``) or all rows' [head_dim / 2] (``frequencies_for``), default
        the rope's own."""
        inv_freq = self.inv_freq if freqs is None else freqs
        angles = positions[..., None].float() * inv_freq.to(positions.device)
        return cos_sin(torch.cat((angles, angles), dim=-1), self.scale, dtype)


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
