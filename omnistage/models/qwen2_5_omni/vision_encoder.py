"""Qwen2.5-Omni vision encoder (``thinker.visual.*``) over a batch of images and video clips.

Patches (``[patches, C*T*P*P]`` in merge-block order, as the image processor writes them) are embedded by a
3-D convolution whose kernel is the whole patch, then reordered window by window: each frame's 2x2 merge
blocks are grouped into windows of ``window_size / patch / merge`` blocks a side (4 in the released model;
ragged windows at the right and bottom edges). Blocks attend within their window, except the
``fullatt_block_indexes`` blocks, which attend over the whole frame. Rotary positions are 2-D (row, column of
the patch; half the frequencies each, rotated in float32). The merger (RMSNorm, then an MLP over each merge
block's four rows) gives one row per merge block, put back in merge-block order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.models.layers.mlp import activation
from omnistage.models.layers.norm import RMSNorm
from omnistage.models.layers.segment_attention import segment_attention


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"vision hidden_size {dim} must divide by {heads} heads")
        self.heads, self.head_dim = heads, dim // heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: Sequence[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = (p(x).view(n, self.heads, self.head_dim) for p in (self.q, self.k, self.v))
        c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)  # float32, as transformers rotates
        q = (q.float() * c + _rotate_half(q.float()) * s).to(x.dtype)
        k = (k.float() * c + _rotate_half(k.float()) * s).to(x.dtype)
        out = segment_attention(q, k, v, segments, self.head_dim**-0.5)
        return self.proj(out.reshape(n, -1))


class _MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden)
        self.up_proj = nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, act: str) -> None:
        super().__init__()
        self.norm1 = RMSNorm(dim)
        self.norm2 = RMSNorm(dim)
        self.attn = _Attention(dim, heads)
        self.mlp = _MLP(dim, hidden, act)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: Sequence[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class _PatchEmbed(nn.Module):
    def __init__(self, channels: int, temporal: int, patch: int, dim: int) -> None:
        super().__init__()
        self.shape = (channels, temporal, patch, patch)
        self.proj = nn.Conv3d(channels, dim, kernel_size=self.shape[1:], stride=self.shape[1:], bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = pixels.to(self.proj.weight.dtype).view(-1, *self.shape)
        return self.proj(x).view(x.shape[0], -1)


class _Merger(nn.Module):
    def __init__(self, dim: int, context: int, merge: int) -> None:
        super().__init__()
        self.width = context * merge * merge
        self.ln_q = RMSNorm(context)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


def window_order(grid: tuple[int, int, int], merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """(merge-block order of the windows, the windows' sizes in merge blocks) of one image or video."""
    t, h, w = grid[0], grid[1] // merge, grid[2] // merge
    index = torch.arange(t * h * w).view(t, h, w)
    pad_h, pad_w = -h % window, -w % window
    padded = F.pad(index, (0, pad_w, 0, pad_h), value=-1)
    nh, nw = (h + pad_h) // window, (w + pad_w) // window
    padded = padded.view(t, nh, window, nw, window).permute(0, 1, 3, 2, 4).reshape(t, nh * nw, window * window)
    sizes = (padded >= 0).sum(-1).flatten()
    flat = padded.flatten()
    return flat[flat >= 0], [int(s) for s in sizes if s > 0]


class VisionEncoder(nn.Module):
    """Built from ``thinker_config.vision_config``; state-dict names equal the checkpoint's minus
    ``thinker.visual.``. Called as Qwen3-Omni's tower: ``(pixels, grids) -> (tokens, None)`` (no deepstack)."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        rope = getattr(cfg, "rope_parameters", None) or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"vision rope_type {rope.get('rope_type')!r} is not supported (only axial)")
        dim, heads = int(cfg.hidden_size), int(cfg.num_heads)
        self.merge, self.patch = int(cfg.spatial_merge_size), int(cfg.patch_size)
        self.window = int(cfg.window_size) // self.merge // self.patch
        if self.window < 1:
            raise ValueError(f"window_size {cfg.window_size} is smaller than one merge block")
        self.full_attention = frozenset(int(i) for i in cfg.fullatt_block_indexes)
        self.patch_embed = _PatchEmbed(int(cfg.in_channels), int(cfg.temporal_patch_size), self.patch, dim)
        quarter = dim // heads // 2
        theta = float(rope.get("rope_theta", 10000.0))
        inv_freq = 1.0 / (theta ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter))
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)
        self.blocks = nn.ModuleList(
            _Block(dim, heads, int(cfg.intermediate_size), cfg.hidden_act) for _ in range(cfg.depth)
        )
        self.merger = _Merger(int(cfg.out_hidden_size), dim, self.merge)

    def _rope(self, grid: tuple[int, int, int]) -> torch.Tensor:
        """[t*h*w, head_dim / 2] rotary angles of one item's patches (merge-block order): rows, then columns."""
        t, h, w = grid
        m = self.merge
        rows = torch.arange(h).view(h // m, m, 1, 1).expand(h // m, m, w // m, m).transpose(1, 2).flatten()
        cols = torch.arange(w).view(1, 1, w // m, m).expand(h // m, m, w // m, m).transpose(1, 2).flatten()
        inv = self.inv_freq
        angles = torch.cat([rows[:, None].float() * inv, cols[:, None].float() * inv], dim=-1)
        return angles.repeat(t, 1)

    def forward(
        self, pixels: torch.Tensor, grids: Sequence[tuple[int, int, int]]
    ) -> tuple[torch.Tensor, None]:
        """pixels [sum t*h*w, C*T*P*P] of the items in order -> ([sum t*h*w / merge^2, out_hidden], None)."""
        unit = self.merge * self.merge
        order, windows, frames, angles = [], [], [], []
        offset = 0
        for grid in grids:
            idx, sizes = window_order(tuple(int(g) for g in grid), self.merge, self.window)
            order.append(idx + offset)
            windows += [s * unit for s in sizes]
            frames += [grid[1] * grid[2]] * grid[0]
            angles.append(self._rope(grid))
            offset += grid[0] * grid[1] * grid[2] // unit
        order_t = torch.cat(order).to(pixels.device)
        h = self.patch_embed(pixels)
        n = h.shape[0]

        def by_window(x: torch.Tensor) -> torch.Tensor:
            return x.view(n // unit, unit, -1)[order_t].reshape(n, -1)

        h = by_window(h)
        emb = by_window(torch.cat(angles).to(pixels.device))
        emb = torch.cat((emb, emb), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        for i, block in enumerate(self.blocks):
            h = block(h, cos, sin, frames if i in self.full_attention else windows)
        merged = self.merger(h)
        return merged[torch.argsort(order_t)], None
