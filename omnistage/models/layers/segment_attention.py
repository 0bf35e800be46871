"""Bidirectional attention within contiguous row segments (encoder windows, video frames).

Rows are flattened ``[N, heads, dim]``; segment k covers the next ``lengths[k]`` rows. Segments of one length
are one SDPA call without a mask; mixed lengths are padded to the longest and masked by key validity.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def segment_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: Sequence[int], scale: float
) -> torch.Tensor:
    """q, k, v: [N, heads, dim] with N = sum(lengths) -> [N, heads, dim]."""
    n, heads, dim = q.shape
    if sum(lengths) != n or any(x <= 0 for x in lengths):
        raise ValueError(f"segment lengths {list(lengths)} must be positive and cover the {n} rows")
    longest = max(lengths)
    if all(x == longest for x in lengths):
        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(len(lengths), longest, heads, dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(split(q), split(k), split(v), scale=scale)
        return out.transpose(1, 2).reshape(n, heads, dim)
    lens = torch.tensor(list(lengths), device=q.device)
    starts = torch.cumsum(lens, 0) - lens
    offs = torch.arange(longest, device=q.device)
    valid = offs[None, :] < lens[:, None]  # [S, L]
    index = (starts[:, None] + offs[None, :]).clamp(max=n - 1)

    def pad(t: torch.Tensor) -> torch.Tensor:
        return t[index].transpose(1, 2)  # [S, heads, L, dim]

    mask = valid[:, None, None, :]  # keys of the segment only; padded queries are dropped below
    out = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), attn_mask=mask, scale=scale)
    return out.transpose(1, 2)[valid]
