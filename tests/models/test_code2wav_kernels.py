"""Code2Wav's fast decoder kernels (channels-last convolutions, GEMM pointwise and transposed convolutions,
fused SnakeBeta) equal the reference kernels (torch's [B, C, T] convolutions, as in transformers): layer by
layer, one-shot and streamed, float32 and bfloat16; SnakeBeta's own pass (CPU kernels or eager) equals the
reference's."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from test_code2wav import random_codes, randomize_
from test_code2wav_stream import stream_interleaved

from omnistage.models.layers import cpu_kernels
from omnistage.models.layers.conv import CausalConv1d, CausalConvTranspose1d
from omnistage.models.layers.fast_linear import Bf16StoredEmbedding, fast_kernels
from omnistage.models.qwen3_omni.code2wav import (
    Code2Wav,
    Code2WavConfig,
    ResidualUnit,
    SnakeBeta,
    _snake_eager,
)
from omnistage.models.qwen3_omni.code2wav_stream import Code2WavStreamer

F32_TOL = 1e-5  # fast vs reference kernels in float32 (measured ~1e-6 on the small preset)


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        yield


def _seeded(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    for p in module.parameters():
        p.copy_(torch.randn(p.shape, generator=gen) / max(1, p[0].numel()) ** 0.5)
    return module


def _cl(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2).contiguous()


@pytest.mark.parametrize(
    "make",
    [
        lambda: CausalConv1d(32, 32, 7, dilation=3),
        lambda: CausalConv1d(48, 16, 7),
        lambda: CausalConv1d(32, 32, 1),
        lambda: CausalConv1d(32, 1, 7, dilation=2),  # few outputs: taps GEMM + shifted sums
        lambda: CausalConvTranspose1d(32, 16, 10, 5),
        lambda: CausalConvTranspose1d(32, 16, 4, 4),
        lambda: CausalConvTranspose1d(32, 32, 8, 4),  # stride x outputs a multiple of 32: conv_pairs in float32
    ],
    ids=["k7-d3", "k7-48to16", "k1", "k7-to1", "transposed-2x", "transposed-1x", "transposed-2x-pairs"],
)
def test_channels_last_layers_equal_torch(make):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, make().conv.in_channels, 37, generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        layer = _seeded(make(), seed=2).to(dtype)
        expect = _seeded(make(), seed=2).to(dtype).float()(x.to(dtype).float())  # float32 math, same weights
        got = layer.forward_channels_last(_cl(x.to(dtype)))
        assert got.dtype == dtype and got.shape == _cl(expect).shape
        tol = F32_TOL if dtype == torch.float32 else 2e-2
        assert (got.float() - _cl(expect)).abs().max().item() <= tol * expect.abs().max().item()
        if isinstance(layer, CausalConv1d) and layer.conv.out_channels == layer.conv.in_channels:
            residual = _cl(x.to(dtype))
            summed = layer.forward_channels_last(_cl(x.to(dtype)), residual=residual.clone())
            assert (summed.float() - (got.float() + residual.float())).abs().max().item() <= tol * 4


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler to build omnistage's CPU kernels")
@pytest.mark.parametrize("channels, length", [(32, 37), (64, 5)])
def test_fused_residual_tail_equals_the_separate_passes(channels, length, monkeypatch):
    """A residual unit's second SnakeBeta, kernel-1 convolution and residual as one pass
    (``cpu_kernels.snake_pointwise``, float32 channels-last) equal the separate passes; rows past the kernel's
    row tiles included."""
    unit = _seeded(ResidualUnit(channels, dilation=3), seed=4)
    with torch.no_grad():  # SnakeBeta's log-scale parameters: keep them in a realistic range
        for snake in (unit.act1, unit.act2):
            snake.alpha.mul_(0.3), snake.beta.mul_(0.3)
    x = torch.randn(2, length, channels, generator=torch.Generator().manual_seed(5))
    fused = unit.forward_channels_last(x.clone())
    monkeypatch.setattr(cpu_kernels, "supports_snake_pointwise", lambda x: False)
    separate = unit.forward_channels_last(x.clone())
    assert (fused - separate).abs().max().item() <= F32_TOL * separate.abs().max().item()
    kept = x.clone()
    monkeypatch.undo()
    assert unit.forward_channels_last(kept) is kept  # x is overwritten with the result, as by the separate passes


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler to build omnistage's CPU kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels, outputs, taps, dilation, length, held", [
    (32, 1, 7, 1, 300, 6),  # the decoder's last convolution, rows past a job's tile
    (16, 3, 3, 2, 5, 4),  # several outputs, dilated, fewer rows than a tile
    (48, 2, 7, 3, 700, 0),  # no left context: the first (taps - 1) * dilation rows give no output
])
def test_snake_conv_equals_snake_then_conv(dtype, channels, outputs, taps, dilation, length, held):
    """``cpu_kernels.snake_conv``: [left; SnakeBeta(x)] convolved in one pass equals SnakeBeta, the concatenation
    and torch's convolution; bfloat16 rows within the activation's rounding to bfloat16 and the output's."""
    gen = torch.Generator().manual_seed(7)
    x = (2 * torch.randn(2, length, channels, generator=gen)).to(dtype)
    left = torch.randn(2, held, channels, generator=gen).to(dtype) if held else None
    alpha, scale = torch.rand(channels, generator=gen) + 0.5, torch.rand(channels, generator=gen) + 0.5
    weight = torch.randn(outputs, channels, taps, generator=gen) / (channels * taps) ** 0.5
    bias = torch.randn(outputs, generator=gen)
    got = cpu_kernels.snake_conv(x, left, alpha, scale, weight, bias, dilation)
    activated = _snake_eager(x.float(), alpha, scale).to(dtype).float()
    signal = activated if left is None else torch.cat((left.float(), activated), 1)
    want = torch.nn.functional.conv1d(signal.transpose(1, 2), weight, bias, dilation=dilation).transpose(1, 2)
    assert got.dtype == dtype and got.shape == want.shape == (2, held + length - (taps - 1) * dilation, outputs)
    tol = F32_TOL if dtype == torch.float32 else 2**-7
    assert (got.float() - want).abs().max().item() <= tol * want.abs().max().item()


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler to build omnistage's CPU kernels")
@pytest.mark.parametrize("batch, length, channels, stride, outputs", [
    (3, 7, 64, 3, 32),  # fewer rows than a tile
    (2, 230, 96, 4, 24),  # several jobs per item (96 channels: 240 rows a job), a last short one
    (1, 5, 16, 8, 4),
])
def test_conv_pairs_equals_snake_concatenation_and_the_pairs_gemm(batch, length, channels, stride, outputs):
    """``cpu_kernels.conv_pairs``: each item's [left; SnakeBeta(x)] (a starting item: x, its last row repeated; no
    left: x) read as consecutive pairs times the weight plus bias equals making the pairs and one GEMM."""
    gen = torch.Generator().manual_seed(9)
    x = 2 * torch.randn(batch, length, channels, generator=gen)
    left = torch.randn(batch, 1, channels, generator=gen)
    alpha, scale = torch.rand(channels, generator=gen) + 0.5, torch.rand(channels, generator=gen) + 0.5
    weight = torch.randn(2 * channels, stride * outputs, generator=gen) / (2 * channels) ** 0.5
    bias = torch.randn(stride * outputs, generator=gen)
    panels = cpu_kernels.pack_linear(weight.t())
    start = torch.arange(batch) % 2 == 0
    activated = _snake_eager(x, alpha, scale)
    for case_left, case_start, rows in ((left, start, length), (left, None, length), (None, None, length - 1)):
        for snake in ((alpha, scale), None):
            inputs = activated if snake else x
            items = []
            for b in range(batch):
                if case_left is None or (case_start is not None and case_start[b]):
                    seq = torch.cat((inputs[b], inputs[b, -1:]))
                else:
                    seq = torch.cat((_snake_eager(left[b], alpha, scale) if snake else left[b], inputs[b]))
                items.append(torch.cat((seq[:rows], seq[1 : rows + 1]), 1))
            want = torch.stack(items) @ weight + bias
            got = cpu_kernels.conv_pairs(x, case_left, case_start, snake, panels, bias, rows)
            assert got.shape == want.shape == (batch, rows, stride * outputs)
            assert (got - want).abs().max().item() <= F32_TOL * want.abs().max().item()


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler to build omnistage's CPU kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_rows_make_a_streamed_snake_conv_give_the_one_shot_bits(dtype):
    """``cpu_kernels.snake_kept``: the decoder's last convolution streamed in two chunks (the second reading the
    first's kept rows, activated by ``snake_conv``'s own arithmetic, as its left context) gives one-shot
    decoding's bits; per-item counts (0 new rows: the old left rows move on) keep what each item's count keeps."""
    gen = torch.Generator().manual_seed(9)
    channels, taps, dilation = 32, 7, 1
    held = (taps - 1) * dilation
    x = (2 * torch.randn(3, 90, channels, generator=gen)).to(dtype)
    snake = (torch.rand(channels, generator=gen) + 0.5, torch.rand(channels, generator=gen) + 0.5)
    weight = torch.randn(1, channels, taps, generator=gen) / (channels * taps) ** 0.5
    bias = torch.randn(1, generator=gen)
    left = torch.randn(3, held, channels, generator=gen).to(dtype)
    assert_kept_rows_stream_as_one_shot(cpu_kernels.snake_kept, lambda x, left: cpu_kernels.snake_conv(
        x, left, *snake, weight, bias, dilation), x, left, snake, [0, 3, 50])
    with pytest.raises(ValueError, match="valid counts"):
        cpu_kernels.snake_kept(left, x, 91, snake)


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler to build omnistage's CPU kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_snake_rows_follow_their_context_and_do_not_depend_on_their_neighbours(dtype):
    """``cpu_kernels.snake`` (SnakeBeta where no kernel applies it as it reads): the context rows as they are,
    then x's rows activated within float32 rounding of float64 (bfloat16: the result's rounding), each row's
    bits its own, so a stream's few kept rows activated alone match the chunk's (keep_activated_channels_last)."""
    gen = torch.Generator().manual_seed(4)
    x = (3 * torch.randn(2, 70, 40, generator=gen)).to(dtype)
    context = torch.randn(2, 6, 40, generator=gen).to(dtype)
    alpha, scale = torch.rand(40, generator=gen) + 0.5, torch.rand(40, generator=gen) + 0.5
    got = cpu_kernels.snake(x, alpha, scale, context)
    want = _snake_eager(x.double(), alpha.double(), scale.double())
    assert got.dtype == dtype and got.shape == (2, 76, 40) and torch.equal(got[:, :6], context)
    tol = 4e-6 if dtype == torch.float32 else 2**-8
    assert (got[:, 6:].double() - want).abs().max().item() <= tol * want.abs().max().item()
    alone = cpu_kernels.snake(x[:, 33:38], alpha, scale)
    assert torch.equal(alone, got[:, 39:44]) and torch.equal(cpu_kernels.snake(x, alpha, scale), got[:, 6:])
    with pytest.raises(ValueError, match="context must be"):
        cpu_kernels.snake(x, alpha, scale, context[:, :, :8])


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler to build omnistage's CPU kernels")
@pytest.mark.parametrize("channels", [3, 20, 37])
def test_snake_sine_holds_for_any_width_and_far_arguments(channels):
    """The kernels' sine (a reduction by pi and a polynomial, libm's sinf for a vector with arguments past its
    reduction's range): float32 SnakeBeta within float32 rounding of float64 for channel counts that leave a
    part vector, with far arguments (|alpha x| up to 1e5) next to ordinary ones in the same vector; every value's
    bits its own (a row alone, or a far value's neighbours without it, give the same values)."""
    gen = torch.Generator().manual_seed(11)
    x = 3 * torch.randn(2, 9, channels, generator=gen)
    far = torch.tensor([1e5, -3e4, 9000.5, 8192.25, -2e4, 7e4, 1e4, -8193.0, 5e4, 2e5, 3e3, 9e3, 1e5, -1e5, 4e4,
                        6e4, 8e3, 1.5e4, 2.5e4])
    x[0, 2, ::2] = far[: (channels + 1) // 2]
    alpha, scale = torch.rand(channels, generator=gen) + 0.5, torch.rand(channels, generator=gen) + 0.5
    got = cpu_kernels.snake(x, alpha, scale)
    want = _snake_eager(x.double(), alpha.double(), scale.double())
    # relative to each value (far values are large: a sine's error there is far below their rounding)
    assert ((got.double() - want).abs() <= 4e-6 * want.abs().clamp_min(1.0)).all()
    assert torch.equal(cpu_kernels.snake(x[:, 2:3], alpha, scale), got[:, 2:3])
    near = x.clone()
    near[0, 2, ::2] = 0.5
    assert torch.equal(cpu_kernels.snake(near, alpha, scale)[0, 2, 1::2], got[0, 2, 1::2])


def assert_kept_rows_stream_as_one_shot(kept, conv, x, left, snake, counts) -> torch.Tensor:
    """A kernel's kept-rows function (``snake_kept``) for its convolution ``conv(x, left)`` (left: [B, H, C] left
    context): x in two chunks, the second after the first's kept rows, gives one-shot's bits; per-item counts
    (0 new rows: the carried rows move on) keep what each item's own count keeps. Returns the rows kept
    after ``left`` and the first chunk at ``counts``."""
    zeros = torch.zeros_like(left)
    first, rest = x[:, :50].contiguous(), x[:, 50:].contiguous()
    streamed = torch.cat((conv(first, zeros), conv(rest, kept(zeros, first, 50, snake))), 1)
    assert torch.equal(streamed, conv(x, zeros))
    each = kept(left, first, torch.tensor(counts), snake)
    for b, n in enumerate(counts):
        assert torch.equal(each[b], kept(left[b : b + 1], first[b : b + 1], n, snake)[0])
    assert torch.equal(each[0], left[0])  # no new rows: the carried ones, as they were
    return each


def test_derived_weights_follow_the_weight():
    """The channels-last layouts are derived from the weight once and rebuilt when it changes; weights made
    under inference mode (no version counter) work too."""
    conv = _seeded(CausalConv1d(8, 8, 7, dilation=2), seed=6)
    x = torch.randn(2, 20, 8)
    before = conv.forward_channels_last(x)
    conv.conv.weight.mul_(2)  # in place: same storage, new version
    after = conv.forward_channels_last(x)
    assert torch.allclose(after - conv.conv.bias, 2 * (before - conv.conv.bias), atol=1e-5)
    with torch.inference_mode():
        made = CausalConv1d(8, 8, 1)
        assert made.forward_channels_last(x).shape == (2, 20, 8)


@functools.cache
def _model(decoder_dim: int) -> Code2Wav:
    """Random Code2Wav whose decoder blocks have realistic widths (decoder_dim 64: 32 down to 4 channels)."""
    config = Code2WavConfig(
        codebook_size=64, num_quantizers=8, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=16, decoder_dim=decoder_dim,
    )
    model = Code2Wav(config).eval()
    randomize_(model, seed=3)
    return model


def _decode(model: Code2Wav, codes: torch.Tensor, reference: bool) -> torch.Tensor:
    model.reference_kernels = reference
    try:
        return model(codes)[:, 0]
    finally:
        model.reference_kernels = False


def _counting_snake_conv(monkeypatch) -> list[int]:
    """Counts ``cpu_kernels.snake_conv``'s calls (the decoder's last convolution where its channels allow)."""
    calls = []
    real = cpu_kernels.snake_conv
    monkeypatch.setattr(cpu_kernels, "snake_conv", lambda *a: calls.append(1) or real(*a))
    return calls


# decoder_dim 256: 16 channels at the last convolution, which SnakeBeta and the convolution then take in one pass
@pytest.mark.parametrize("decoder_dim", [64, 256])
def test_fast_decoder_equals_reference_kernels_float32(decoder_dim, monkeypatch):
    model = _model(decoder_dim)
    codes = random_codes(8, 30, seed=5, batch=2)
    reference = _decode(model, codes, reference=True)
    calls = _counting_snake_conv(monkeypatch)
    pairs = []  # conv_pairs' calls: the upsampling blocks whose stride x outputs fill panels (64: 2 of 4; 256: 3)
    real_pairs = cpu_kernels.conv_pairs
    monkeypatch.setattr(cpu_kernels, "conv_pairs", lambda *a: pairs.append(1) or real_pairs(*a))
    fast = _decode(model, codes, reference=False)
    assert len(calls) == (decoder_dim == 256 and cpu_kernels.available())
    assert len(pairs) == ({64: 2, 256: 3}[decoder_dim] if cpu_kernels.available() else 0)
    diff = (fast - reference).abs().max().item()
    print(f"float32 fast vs reference kernels: {diff:.2e} (signal std {reference.std():.2f})")
    assert reference.std() > 0.02 and diff <= F32_TOL
    # Streamed on the fast kernels (rows at different positions, odd chunk sizes) == reference one-shot.
    streams = stream_interleaved(Code2WavStreamer(model), list(codes), [[1, 6, 23], [4, 25, 1]], rounds=12, seed=1)
    worst = max((s - r).abs().max().item() for s, r in zip(streams, reference))
    print(f"float32 fast streamed vs reference one-shot: {worst:.2e}")
    assert worst <= 1e-4


@pytest.mark.parametrize("decoder_dim", [64, 256])
def test_fast_decoder_bfloat16_is_as_close_to_float32_as_the_reference(decoder_dim):
    """bfloat16 rounds differently on the two paths; each is compared to the float32 result it approximates."""
    model = _model(decoder_dim)
    codes = random_codes(8, 30, seed=6, batch=2)
    exact = _decode(model, codes, reference=True)
    half = Code2Wav(model.config).eval()
    half.load_state_dict(model.state_dict())
    half.to(torch.bfloat16)
    reference_err = (_decode(half, codes, reference=True).float() - exact).abs().max().item()
    fast_err = (_decode(half, codes, reference=False).float() - exact).abs().max().item()
    streams = stream_interleaved(Code2WavStreamer(half), list(codes), [[4, 26], [1, 29]], rounds=8, seed=2)
    stream_err = max((s.float() - e).abs().max().item() for s, e in zip(streams, exact))
    print(f"bfloat16 vs float32: reference kernels {reference_err:.3f}, fast {fast_err:.3f}, fast streamed "
          f"{stream_err:.3f} (signal std {exact.std():.2f})")
    assert max(fast_err, stream_err) <= 2 * reference_err + 0.02


@pytest.mark.parametrize("kernels", [True, False], ids=["cpu-kernels", "eager"])
def test_channels_last_snake_equals_the_reference(kernels, monkeypatch):
    """``SnakeBeta.forward_channels_last`` (the CPU kernels' pass, else eager torch) after a strided history
    (a stream's carried inputs): the history as it is, then the reference SnakeBeta's values."""
    if kernels and not cpu_kernels.available():
        pytest.skip("no C compiler to build omnistage's CPU kernels")
    monkeypatch.setattr(cpu_kernels, "supports_snake", lambda x, real=cpu_kernels.supports_snake: kernels and real(x))
    snake = SnakeBeta(24)
    gen = torch.Generator().manual_seed(5)
    snake.alpha.copy_(0.3 * torch.randn(24, generator=gen))  # log-scale, as trained vocoders have them
    snake.beta.copy_(0.3 * torch.randn(24, generator=gen))
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        for length, context in ((50, 6), (123, 18)):
            x = (2 * torch.randn(2, length, 24, generator=gen)).to(dtype)
            left = torch.randn(2, 24, context, generator=gen).to(dtype).transpose(1, 2)  # a strided history
            got = snake.forward_channels_last(x, left)
            reference = snake(x.float().transpose(1, 2)).transpose(1, 2)
            assert got.dtype == dtype and got.shape == (2, context + length, 24)
            assert torch.equal(got[:, :context], left)
            assert (got[:, context:].float() - reference).abs().max().item() <= tol * reference.abs().max().item()
            assert torch.equal(snake.forward_channels_last(x), got[:, context:])


def test_a_float32_code_embedding_of_bfloat16_values_is_kept_as_them(monkeypatch):
    """``fast`` on a float32 Code2Wav whose weights are bfloat16 values (a checkpoint stored in bfloat16): the code
    embedding is held as bfloat16 (half the bytes), and the waveform has the same bits as with the float32 table."""
    from omnistage.models.qwen3_omni import code2wav

    model = copy.deepcopy(_model(64))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16))
    twin = copy.deepcopy(model)
    fast_kernels(model, True)
    with monkeypatch.context() as patch:
        patch.setattr(code2wav, "pack_embedding", lambda *args: 0)
        fast_kernels(twin, True)
    assert isinstance(model.code_embedding, Bf16StoredEmbedding) and type(twin.code_embedding) is torch.nn.Embedding
    assert model.code_embedding.stored_weight.dtype == torch.bfloat16 and model.code_embedding.weight.numel() == 0
    codes = torch.randint(0, 64, (2, 8, 11), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        assert torch.equal(model(codes), twin(codes))
