"""The DiT's block attention, computed block by block, against the reference's masked T x T attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from omnistage.models.qwen2_5_omni.dit import BlockSpan, block_attention


@pytest.mark.parametrize("back,ahead", [(0, 0), (1, 0), (0, 1), (1, 1), (2, 1)])
@pytest.mark.parametrize("frames", [1, 7, 8, 9, 24, 45, 96])
def test_block_attention_equals_the_masked_reference(frames, back, ahead):
    """Windows shorter than a block, ending inside one and on a boundary; spans reaching past both ends."""
    size = 8
    g = torch.Generator().manual_seed(frames * 10 + back * 3 + ahead)
    q, k, v = (torch.randn(3, 4, frames, 16, generator=g) for _ in range(3))
    blocks = torch.arange(frames) // size
    diff = blocks[None, :] - blocks[:, None]  # key block - query block, as transformers builds its mask
    expect = F.scaled_dot_product_attention(q, k, v, attn_mask=(diff >= -back) & (diff <= ahead))
    span = BlockSpan.of(size, back, ahead, frames, q.device)
    got = block_attention(q, k, v, span)
    assert got.shape == expect.shape
    assert (got - expect).abs().max().item() <= 1e-5
    # slots outside the window are the only masked ones: none when every block is whole and nothing is reached
    assert (span.valid is None) == (frames % size == 0 and back == ahead == 0)
