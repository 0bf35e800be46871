"""Wide causal convolutions as products of small DFTs (``dft_conv``): equal to torch's convolution up to float
rounding for any taps, dilation, channel counts, batch and length (blocks that cross items, partial last
blocks), with bias and residual, float32 and bfloat16; the vocoder's convolutions take them where they pay,
and a Code2Wav decoder on them equals the reference kernels, one-shot and streamed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_code2wav import random_codes, randomize_
from test_code2wav_stream import stream_interleaved

from omnistage.models.layers import cpu_kernels, dft_conv
from omnistage.models.layers.conv import CausalConv1d
from omnistage.models.qwen3_omni.code2wav import Code2Wav, Code2WavConfig
from omnistage.models.qwen3_omni.code2wav_stream import Code2WavStreamer

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler: the direct path serves")


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        yield


def _exact(padded: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dilation: int) -> torch.Tensor:
    """The convolution in float64 ([B, T_in, C] in, [B, T, C_out] out)."""
    out = F.conv1d(padded.double().transpose(1, 2), weight.double(), None if bias is None else bias.double(),
                   dilation=dilation)
    return out.transpose(1, 2)


@pytest.mark.parametrize("taps, dilation", [(7, 1), (7, 3), (7, 9), (3, 2), (2, 1), (16, 1)])
@pytest.mark.parametrize("items, outputs", [(1, 1), (1, 25), (3, 26), (2, 300), (5, 57)])
def test_equals_the_convolution_float32(taps, dilation, items, outputs):
    gen = torch.Generator().manual_seed(taps * 100 + dilation * 10 + items)
    in_channels, out_channels = 100, 72  # not multiples of the kernels' 64-channel chunks or 16 lanes
    weight = torch.randn(out_channels, in_channels, taps, generator=gen) / (taps * in_channels) ** 0.5
    bias = torch.randn(out_channels, generator=gen)
    padded = torch.randn(items, outputs + (taps - 1) * dilation, in_channels, generator=gen)
    residual = torch.randn(items, outputs, out_channels, generator=gen)
    expect = _exact(padded, weight, bias, dilation)
    got = dft_conv.conv(padded, weight, bias, dilation)
    assert got.shape == (items, outputs, out_channels) and got.dtype == torch.float32
    assert (got - expect).abs().max().item() <= 2e-5 * expect.abs().max().item()
    plus = dft_conv.conv(padded, weight, None, dilation, residual=residual)
    assert (plus - (expect - bias + residual)).abs().max().item() <= 2e-5 * expect.abs().max().item()


def test_items_do_not_see_each_other():
    """An item's outputs are the same alone and beside others (blocks crossing items read both)."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(96, 96, 7, generator=gen) / 26
    padded = torch.randn(4, 90 + 6 * 9, 96, generator=gen)
    together = dft_conv.conv(padded, weight, None, 9)
    for b in range(4):
        alone = dft_conv.conv(padded[b : b + 1], weight, None, 9)[0]
        assert (alone - together[b]).abs().max().item() <= 1e-5
    padded[2] = float("nan")  # a poisoned item leaves its neighbours' outputs finite
    poisoned = dft_conv.conv(padded, weight, None, 9)
    assert torch.isfinite(poisoned[[0, 1, 3]]).all() and torch.isnan(poisoned[2]).all()


def test_bfloat16_is_as_close_as_the_direct_convolution():
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(192, 160, 7, generator=gen) / 34
    padded = torch.randn(3, 400 + 18, 160, generator=gen)
    expect = _exact(padded, weight, None, 3)
    direct = _exact(padded.bfloat16(), weight.bfloat16(), None, 3).bfloat16().double()
    got = dft_conv.conv(padded.bfloat16(), weight.bfloat16(), None, 3)
    assert got.dtype == torch.bfloat16
    scale = expect.abs().max().item()
    direct_err = (direct - expect).abs().max().item() / scale
    got_err = (got.double() - expect).abs().max().item() / scale
    print(f"bfloat16 relative error: direct {direct_err:.1e}, dft {got_err:.1e}")
    assert got_err <= 2 * direct_err + 1e-3


def test_the_vocoder_convolution_takes_it_where_it_pays(monkeypatch):
    conv = CausalConv1d(128, 128, 7, dilation=3)
    taken = []
    real = dft_conv.conv
    monkeypatch.setattr(dft_conv, "conv", lambda *a, **k: taken.append(a[0].shape) or real(*a, **k))
    big = torch.randn(2, 600, 128)
    out = conv.forward_channels_last(big)
    expect = _exact(F.pad(big, (0, 0, 18, 0)), conv.conv.weight, conv.conv.bias, 3).float()
    assert taken == [(2, 618, 128)] and (out - expect).abs().max().item() <= 1e-5
    conv.forward_channels_last(torch.randn(2, 100, 128))  # 200 outputs: the weight's transform would not pay
    CausalConv1d(32, 32, 7).forward_channels_last(torch.randn(2, 600, 32))  # too few channels
    CausalConv1d(128, 128, 1).forward_channels_last(torch.randn(2, 600, 128))  # one tap: a GEMM
    assert len(taken) == 1


def test_a_decoder_on_it_equals_the_reference_kernels(monkeypatch):
    """decoder_dim 384: blocks of 192 and 96 channels take the DFT path, then 48 and 24 the direct one."""
    config = Code2WavConfig(
        codebook_size=64, num_quantizers=8, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=16, decoder_dim=384,
    )
    model = Code2Wav(config).eval()
    randomize_(model, seed=3)
    codes = random_codes(8, 30, seed=5, batch=2)
    model.reference_kernels = True
    reference = model(codes)[:, 0]
    model.reference_kernels = False
    widths = []
    real = dft_conv.conv
    monkeypatch.setattr(dft_conv, "conv", lambda *a, **k: widths.append(a[1].shape[:2]) or real(*a, **k))
    fast = model(codes)[:, 0]
    assert sorted(set(widths)) == [(96, 96), (192, 192)]
    diff = (fast - reference).abs().max().item()
    assert reference.std() > 0.02 and diff <= 1e-5
    # Streamed in chunks (the DFT path where a call's rows are enough, reading the carried context; else the
    # direct one) == one-shot
    widths.clear()
    streams = stream_interleaved(Code2WavStreamer(model), list(codes), [[5, 25], [10, 20]], rounds=4, seed=1)
    assert (192, 192) in widths
    assert max((s - r).abs().max().item() for s, r in zip(streams, reference)) <= 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_snake_applied_as_blocks_read_equals_snake_then_convolution(dtype):
    """With a left context and SnakeBeta: [left as it is; snake(x)] convolved, SnakeBeta's rows those of
    ``cpu_kernels.snake`` (the kernels' arithmetic, rounded to the type)."""
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(112, 96, 7, generator=gen) / 26
    bias = torch.randn(112, generator=gen)
    x = torch.randn(3, 500, 96, generator=gen).to(dtype)
    left = torch.randn(3, 18, 96, generator=gen).to(dtype)
    alpha, scale = torch.rand(96, generator=gen) + 0.5, torch.rand(96, generator=gen) + 0.5
    activated = cpu_kernels.snake(x, alpha, scale, left)  # [B, 18 + 500, C]
    expect = _exact(activated, weight.to(dtype), bias, 3)
    got = dft_conv.conv(x, weight.to(dtype), bias, 3, left=left, snake=(alpha, scale))
    unfused = dft_conv.conv(activated, weight.to(dtype), bias, 3)
    scale_ = expect.abs().max().item()
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    assert got.shape == (3, 500, 112) and (got.double() - expect).abs().max().item() <= tol * scale_
    assert torch.equal(got, unfused)  # the same rows in, the same blocks: the same bits
    with pytest.raises(ValueError, match="left must be"):
        dft_conv.conv(x, weight.to(dtype), bias, 3, left=left[:, 1:], snake=(alpha, scale))
    with pytest.raises(ValueError, match="give left"):
        dft_conv.conv(x, weight.to(dtype), bias, 3, snake=(alpha, scale))


def test_calls_inside_and_outside_inference_mode_mix():
    """A serving thread runs under inference mode, tests and tools under no_grad: neither leaves the other a
    buffer it may not write."""
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(96, 96, 7, generator=gen) / 26
    padded = torch.randn(2, 600, 96, generator=gen)
    with torch.inference_mode():
        first = dft_conv.conv(padded, weight, None, 1)
    second = dft_conv.conv(padded, weight, None, 1)
    with torch.inference_mode():
        third = dft_conv.conv(padded, weight, None, 1)
    assert torch.equal(first, second) and torch.equal(second, third)
    second.add_(1.0)  # a caller outside inference mode may update the result in place
