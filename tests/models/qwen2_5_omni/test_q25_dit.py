"""The DiT's block attention, computed block by block, against the reference's masked T x T attention; the DiT
on AMX tiles against its unpacked layers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from q25_reference import checkpoint_dir

from omnistage.models.layers import amx_kernels
from omnistage.models.layers.fast_linear import fast_kernels
from omnistage.models.qwen2_5_omni.dit import BlockSpan, ODEConfig, block_attention
from omnistage.models.qwen2_5_omni.loading import load_config, load_token2wav


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


@pytest.mark.skipif(not amx_kernels.available(), reason="this CPU has no AMX (or no compiler for it)")
@torch.inference_mode()
def test_dit_on_amx_tiles_equals_its_unpacked_layers():
    """Under ``fast`` the DiT's linear layers run on AMX tiles where the weights are bfloat16 values (a checkpoint
    stored in bfloat16): the mel of a 3-window batch equals the unpacked model's within float32 rounding."""
    config = load_config(checkpoint_dir())

    def model(packed: bool):
        t2w = load_token2wav(checkpoint_dir(), config)
        for p in t2w.parameters():  # as a bfloat16 checkpoint loads in float32
            p.copy_(p.to(torch.bfloat16).float())
        t2w.ode = ODEConfig(num_steps=3)
        return fast_kernels(t2w, packed)

    plain, fast = model(False), model(True)
    blocks = fast.code2wav_dit_model.transformer_blocks
    assert all(type(m) is not torch.nn.Linear and m.amx_weight is not None
               for m in blocks.modules() if isinstance(m, torch.nn.Linear))
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 100, (3, 20), generator=g)
    noise = torch.randn(3, 20 * plain.repeats, plain.mel_dim, generator=g)
    voice = plain.voices[0]
    want = plain.mel(codes, noise, [voice] * 3)
    got = fast.mel(codes, noise, [voice] * 3)
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
