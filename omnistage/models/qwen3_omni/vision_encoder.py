"""Qwen3-Omni vision encoder (``thinker.visual.*``) over the flattened patches of several images/videos.

Patches arrive as the processor lays them out: per item, temporal groups, then 2x2 merge blocks in raster
order, then the patches inside a block (so every 4 consecutive rows are one merged token). Per patch: a 3-D
patch convolution (a linear map of the flattened patch); a learned square position table resampled
bilinearly (align_corners) to the item's grid, in that merge-block order; 2-D rotary on (row, col); blocks
attending within one frame; after each block listed in ``deepstack_visual_indexes`` a merger of its own
(``merger_list[k]``) gives deepstack feature k; the final ``merger`` gives the visual tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.models.layers.mlp import activation
from omnistage.models.layers.rotary import apply_rotary
from omnistage.models.layers.segment_attention import segment_attention

Grid = tuple[int, int, int]


class _PatchEmbed(nn.Module):
    def __init__(self, in_channels: int, temporal: int, patch: int, dim: int) -> None:
        super().__init__()
        self.proj = nn.Conv3d(in_channels, dim, kernel_size=(temporal, patch, patch), stride=(temporal, patch, patch))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        # Kernel = stride = the patch: the convolution is a linear map of the flattened (C, T, P, P) patch.
        w = self.proj.weight
        return F.linear(pixels.to(w.dtype), w.reshape(w.shape[0], -1), self.proj.bias)


class _VisionAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frames: Sequence[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.heads, self.head_dim).unbind(1)
        # Rotary in float32 as transformers does, whatever the weights' dtype.
        q = apply_rotary(q.float(), cos, sin).to(x.dtype)
        k = apply_rotary(k.float(), cos, sin).to(x.dtype)
        out = segment_attention(q, k, v, frames, self.head_dim**-0.5)
        return self.proj(out.reshape(n, -1))


class _VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden)
        self.linear_fc2 = nn.Linear(hidden, dim)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class _VisionBlock(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, act: str) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = _VisionAttention(dim, heads)
        self.mlp = _VisionMLP(dim, hidden, act)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frames: Sequence[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, frames)
        return x + self.mlp(self.norm2(x))


class _Merger(nn.Module):
    """Groups of ``merge**2`` rows -> one token. ``post_norm``: LayerNorm after the grouping (deepstack)."""

    def __init__(self, dim: int, merge: int, out_dim: int, post_norm: bool) -> None:
        super().__init__()
        self.width = dim * merge * merge
        self.post_norm = post_norm
        self.ln_q = nn.LayerNorm(self.width if post_norm else dim, eps=1e-6)
        self.mlp = nn.ModuleList([nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, out_dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln_q(x.view(-1, self.width)) if self.post_norm else self.ln_q(x).view(-1, self.width)
        for layer in self.mlp:
            x = layer(x)
        return x


def _block_order_rows_cols(h: int, w: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) of every patch of an h x w grid in merge-block order."""
    rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
    cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
    return rows.transpose(1, 2).flatten(), cols.transpose(1, 2).flatten()


def _bilinear_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two taps into a ``side``-long table and their weights for positions on a ``size``-long axis
    (align_corners: the axis ends map to the table ends)."""
    src = index.float() * (side - 1) / torch.clamp(torch.tensor(size - 1), min=1)
    floor = torch.floor(src)
    offsets = torch.arange(2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


class VisionEncoder(nn.Module):
    """Built from ``thinker_config.vision_config``; state-dict names equal the checkpoint's minus
    ``thinker.visual.``."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        rope = getattr(cfg, "rope_parameters", None) or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"vision rope_type {rope.get('rope_type')!r} is not supported (only axial)")
        dim, heads = cfg.hidden_size, cfg.num_heads
        if dim % heads or (dim // heads) % 4:
            raise ValueError(f"vision hidden {dim} / {heads} heads must give a head_dim divisible by 4")
        self.merge = int(cfg.spatial_merge_size)
        self.patch_size = int(cfg.patch_size)
        self.temporal_patch_size = int(cfg.temporal_patch_size)
        self.side = int(cfg.num_position_embeddings**0.5)
        if self.side * self.side != cfg.num_position_embeddings:
            raise ValueError(f"num_position_embeddings {cfg.num_position_embeddings} is not a square")
        self.deepstack_layers = tuple(int(i) for i in cfg.deepstack_visual_indexes)
        if any(not 0 <= i < cfg.depth for i in self.deepstack_layers):
            raise ValueError(f"deepstack_visual_indexes {self.deepstack_layers} out of range for depth {cfg.depth}")
        self.patch_embed = _PatchEmbed(cfg.in_channels, self.temporal_patch_size, self.patch_size, dim)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, dim)
        spatial = dim // heads // 2
        theta = float(rope.get("rope_theta", 10000.0))
        self.inv_freq = nn.Buffer(
            1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial)), persistent=False
        )
        self.blocks = nn.ModuleList(_VisionBlock(dim, heads, cfg.intermediate_size, cfg.hidden_act) for _ in range(cfg.depth))
        self.merger = _Merger(dim, self.merge, cfg.out_hidden_size, post_norm=False)
        self.merger_list = nn.ModuleList(
            _Merger(dim, self.merge, cfg.out_hidden_size, post_norm=True) for _ in self.deepstack_layers
        )

    @property
    def num_deepstack(self) -> int:
        return len(self.deepstack_layers)

    def _grid_tables(self, grids: Sequence[Grid], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """Resampled position embeddings [N, D] and rotary cos/sin [N, head_dim] for every patch."""
        taps, weights, rc = [], [], []
        for t, h, w in grids:
            rows, cols = _block_order_rows_cols(h, w, self.merge)
            h_taps, h_w = _bilinear_taps(rows, h, self.side)
            w_taps, w_w = _bilinear_taps(cols, w, self.side)
            # Tap order (r0c0, r0c1, r1c0, r1c1), summed in that order, as transformers does.
            taps.append((h_taps[:, :, None] * self.side + w_taps[:, None, :]).reshape(-1, 4).repeat(t, 1))
            weights.append((h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4).repeat(t, 1))
            rc.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
        device = self.pos_embed.weight.device
        idx, wts, rc_all = (torch.cat(x).to(device) for x in (taps, weights, rc))
        pos = (self.pos_embed(idx) * wts[:, :, None].to(self.pos_embed.weight.dtype)).sum(1).to(dtype)
        freqs = rc_all[..., None].float() * self.inv_freq.to(device)  # [N, 2, head_dim / 4]
        half = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        emb = torch.cat([half, half], dim=-1)
        return pos, emb.cos(), emb.sin()

    def forward(self, pixels: torch.Tensor, grids: Sequence[Grid]) -> tuple[torch.Tensor, torch.Tensor]:
        """pixels [N, C*T*P*P] of the items in order, grids their (t, h, w) patch grids.

        Returns (tokens [N / merge**2, out], deepstack [num_deepstack, N / merge**2, out]).
        """
        total = sum(t * h * w for t, h, w in grids)
        if pixels.shape[0] != total:
            raise ValueError(f"{pixels.shape[0]} patch rows for grids {list(grids)} ({total} patches)")
        if any(h % self.merge or w % self.merge for _, h, w in grids):
            raise ValueError(f"grids {list(grids)} must divide by the merge size {self.merge}")
        x = self.patch_embed(pixels)
        pos, cos, sin = self._grid_tables(grids, x.dtype)
        x = x + pos
        frames = [h * w for t, h, w in grids for _ in range(t)]
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames)
            if i in self.deepstack_layers:
                deepstack.append(self.merger_list[self.deepstack_layers.index(i)](x))
        tokens = self.merger(x)
        stacked = torch.stack(deepstack) if deepstack else tokens.new_zeros(0, *tokens.shape)
        return tokens, stacked
