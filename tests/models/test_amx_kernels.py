"""omnistage's AMX kernels (Intel AMX CPUs only; skipped elsewhere): convolutions and linear layers equal float64
references within float32 rounding for float32 rows (three bfloat16 parts against bfloat16-valued weights) and
within bfloat16 rounding for bfloat16 rows; odd shapes, dilations, batches, residuals; a row's result does not
depend on its batch mates; weights that are not bfloat16 values are refused; Code2Wav's decoder on them equals
the reference kernels one-shot and streamed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_code2wav import random_codes, randomize_
from test_code2wav_kernels import assert_kept_rows_stream_as_one_shot
from test_code2wav_stream import stream_interleaved

from omnistage.models.layers import amx_kernels
from omnistage.models.layers.conv import CausalConv1d, CausalConvTranspose1d, slide_window
from omnistage.models.qwen3_omni.code2wav import Code2Wav, Code2WavConfig, DecoderBlock
from omnistage.models.qwen3_omni.code2wav_stream import Code2WavStreamer

pytestmark = pytest.mark.skipif(not amx_kernels.available(), reason="this CPU has no AMX (or no compiler for it)")


def _bf16_valued(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(torch.bfloat16).float()


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, dilation: int) -> torch.Tensor:
    """float64 convolution of x [B, T, C] with w [N, C, taps] -> [B, T', N]."""
    out = F.conv1d(x.double().transpose(1, 2), w.double(), None if bias is None else bias.double(), dilation=dilation)
    return out.transpose(1, 2)


SHAPES = [  # batch, length, channels, outputs, taps, dilation
    (1, 37, 32, 32, 1, 1),
    (3, 70, 200, 90, 3, 2),  # channels and outputs off the 32 blocks, rows off the 16-row tiles
    (2, 129, 96, 96, 7, 9),
    (1, 300, 768, 64, 7, 3),  # many input chunks
    (5, 1, 40, 33, 1, 1),  # one row per request
]


@pytest.mark.parametrize("batch, length, channels, outputs, taps, dilation", SHAPES)
def test_conv_equals_float64(batch, length, channels, outputs, taps, dilation):
    w = _bf16_valued(outputs, channels, taps, seed=1, scale=channels**-0.5)
    bias = torch.randn(outputs, generator=torch.Generator().manual_seed(2))
    x = torch.randn(batch, length + (taps - 1) * dilation, channels, generator=torch.Generator().manual_seed(3))
    packed = amx_kernels.pack(w)
    expect = _reference(x, w, bias, dilation)
    float32 = _reference(x.float(), w, bias, dilation).float()  # the float32 conv's own rounding, for scale
    got = amx_kernels.conv(x, packed, dilation, bias)
    assert got.dtype == torch.float32 and got.shape == expect.shape
    scale = expect.abs().max().item()
    f32_err = (F.conv1d(x.transpose(1, 2), w, bias, dilation=dilation).transpose(1, 2).double() - expect).abs().max()
    err = (got.double() - expect).abs().max().item()
    assert err <= max(8 * f32_err.item(), 2e-6 * scale), (err, f32_err.item())
    # residual: written into it, the same sum
    residual = torch.randn_like(got)
    summed = amx_kernels.conv(x, packed, dilation, bias, residual=residual.clone())
    assert (summed.double() - (expect + residual.double())).abs().max().item() <= err + 1e-5 * scale
    # bfloat16 rows: one part; the result rounded to bfloat16
    xb = x.to(torch.bfloat16)
    gotb = amx_kernels.conv(xb, packed, dilation, bias)
    expectb = _reference(xb.float(), w, bias, dilation)
    assert gotb.dtype == torch.bfloat16
    assert (gotb.double() - expectb).abs().max().item() <= 2 ** -8 * expectb.abs().max().item()
    assert float32.shape == got.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_after_left_context_through_snake_equals_float64(dtype):
    """The fused form: ``left`` rows as they are, then x through SnakeBeta, never stored: equals the float64
    convolution of cat(left, snake(x)); without ``left`` (a kernel-1 convolution's) too, with a residual."""
    gen = torch.Generator().manual_seed(9)
    w = _bf16_valued(48, 40, 7, seed=10, scale=0.15)
    packed = amx_kernels.pack(w)
    bias = torch.randn(48, generator=gen)
    alpha, scale = torch.rand(40, generator=gen) + 0.5, torch.rand(40, generator=gen) + 0.5
    x, left = (torch.randn(3, n, 40, generator=gen).to(dtype) for n in (50, 12))
    snaked = x.double() + (torch.sin(x.double() * alpha.double()) * scale.double()) ** 2
    expect = _reference(torch.cat((left.double(), snaked), 1), w, bias, 2)
    got = amx_kernels.conv(x, packed, 2, bias, left=left, snake=(alpha, scale))
    tol = 1e-5 if dtype == torch.float32 else 2**-7  # (bfloat16: the activation rounded before the product)
    assert got.dtype == dtype and got.shape == expect.shape
    assert (got.double() - expect).abs().max().item() <= tol * expect.abs().max().item()
    point = amx_kernels.pack(_bf16_valued(40, 40, seed=11, scale=0.15))
    residual = torch.randn(3, 50, 40, generator=gen).to(dtype)
    want = _reference(snaked, amx_kernels.unpack(point), None, 1) + residual.double()
    got = amx_kernels.conv(x, point, 1, None, residual.clone(), snake=(alpha, scale))
    assert (got.double() - want).abs().max().item() <= tol * want.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_left_context_through_snake_gives_the_bits_of_the_concatenation(dtype):
    """``snake_left``: the left rows activated as x's are, the bits of the concatenated signal's convolution; a
    streamed upsampling convolution reads its previous input that way (rows with new inputs and without)."""
    gen = torch.Generator().manual_seed(12)
    alpha, scale = torch.rand(64, generator=gen) + 0.5, torch.rand(64, generator=gen) + 0.5
    x, left = (torch.randn(3, n, 64, generator=gen).to(dtype) for n in (41, 6))
    packed = amx_kernels.pack(_bf16_valued(40, 64, 7, seed=13, scale=0.15))
    bias = torch.randn(40, generator=gen)
    got = amx_kernels.conv(x, packed, 1, bias, left=left, snake=(alpha, scale), snake_left=True)
    assert torch.equal(got, amx_kernels.conv(torch.cat((left, x), 1), packed, 1, bias, snake=(alpha, scale)))
    layer = CausalConvTranspose1d(64, 32, 10, 5).to(dtype)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_((torch.randn(p.shape, generator=gen) / p[0].numel() ** 0.5).to(torch.bfloat16))
    assert layer.use_amx()
    last = torch.randn(3, 1, 64, generator=gen).to(dtype)
    for valid in (torch.tensor([41, 0, 17]), 41, 0):
        with torch.no_grad():
            out, kept = layer.forward_stream(x, last, valid, None, channels_last=True, snake=(alpha, scale))
            extended = torch.cat((last, x), 1)
            assert torch.equal(out, layer.forward_channels_last(extended, (alpha, scale)))
        assert torch.equal(kept, slide_window(extended, valid, 1, dim=1))


def test_a_row_does_not_depend_on_its_batch():
    """Each request's rows give the same bits alone or among others, at any position in the row tiles."""
    w = _bf16_valued(64, 48, 7, seed=4, scale=0.15)
    packed = amx_kernels.pack(w)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4, 50 + 6 * 2, 48, generator=gen)
    together = amx_kernels.conv(x, packed, 2)
    for b in range(4):
        assert torch.equal(amx_kernels.conv(x[b : b + 1].clone(), packed, 2)[0], together[b])
    rows = torch.randn(45, 48, generator=gen)
    linear = amx_kernels.pack(_bf16_valued(40, 48, seed=6))
    whole = amx_kernels.linear(rows, linear)
    for lo, hi in ((0, 1), (3, 20), (17, 45)):
        assert torch.equal(amx_kernels.linear(rows[lo:hi].clone(), linear), whole[lo:hi])


def test_only_bfloat16_valued_weights_are_taken():
    w = _bf16_valued(32, 32, 3, seed=7)
    assert amx_kernels.takes(w) and amx_kernels.takes(w.to(torch.bfloat16))
    w[0, 0, 0] += 1e-4  # no longer a bfloat16 value: three parts would not be exact products
    assert not amx_kernels.takes(w)
    assert not amx_kernels.takes(torch.zeros(4, 4, dtype=torch.float16))


@pytest.mark.parametrize(
    "make",
    [lambda: CausalConv1d(64, 64, 7, dilation=3), lambda: CausalConv1d(48, 40, 1),
     lambda: CausalConvTranspose1d(64, 32, 10, 5), lambda: CausalConvTranspose1d(64, 32, 4, 4)],
    ids=["k7-d3", "k1", "transposed-2x", "transposed-1x"],
)
def test_layers_on_amx_equal_their_other_kernels(make):
    gen = torch.Generator().manual_seed(8)
    layer = make()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_((torch.randn(p.shape, generator=gen) / p[0].numel() ** 0.5).to(torch.bfloat16).float())
    x = torch.randn(3, 41, layer.conv.in_channels, generator=gen)
    weight, transposed = layer.conv.weight.detach().clone(), isinstance(layer, CausalConvTranspose1d)
    with torch.no_grad():
        other = layer.forward_channels_last(x)
        # A transposed convolution's calls with too few inputs for the tiles (none; one too for two taps)
        short = [layer.forward_channels_last(x[:, :n]) for n in range(1 + bool(layer.trim))] if transposed else []
        assert layer.use_amx() and layer.amx_weight is not None
        got = layer.forward_channels_last(x)
        # One copy of the weight: the unpacked one is released (the tiles' copy gives it back exactly; packing
        # again is a no-op), and the calls the tiles do not take read it from the tiles' copy.
        packed = layer.amx_weight
        assert layer.conv.weight.numel() == 0 and layer.use_amx() and layer.amx_weight is packed
        assert all(torch.equal(layer.forward_channels_last(x[:, :n]), want) for n, want in enumerate(short))
    assert got.shape == other.shape
    assert (got - other).abs().max().item() <= 1e-5 * other.abs().max().item()
    packed_as = weight if not transposed else layer._gemm_weight(weight).t().reshape(
        layer.amx_weight.outputs, layer.amx_weight.taps, -1).permute(0, 2, 1)
    assert torch.equal(amx_kernels.unpack(layer.amx_weight), packed_as)
    with pytest.raises(RuntimeError, match="fast=False"):
        layer.state_dict()


def _code2wav_of_bfloat16_values(decoder_dim: int = 128) -> Code2Wav:
    config = Code2WavConfig(
        codebook_size=64, num_quantizers=8, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=16, decoder_dim=decoder_dim,
    )
    model = Code2Wav(config).eval()
    randomize_(model, seed=3)
    with torch.no_grad():
        for p in model.parameters():  # as a checkpoint stored in bfloat16 loads
            p.copy_(p.to(torch.bfloat16).float())
    return model


def test_code2wav_on_amx_activates_every_row_inside_its_kernels(monkeypatch):
    """On AMX every SnakeBeta of the decoder, one-shot and streamed, is applied by the kernel that reads the rows
    (the AMX convolutions', the last convolution's ``cpu_kernels.snake_conv``, and their kept inputs through the
    same arithmetic): no pass of its own over the signal."""
    from omnistage.models.qwen3_omni.code2wav import SnakeBeta

    model = _code2wav_of_bfloat16_values(256)  # (the last convolution's 16 channels take cpu_kernels.snake_conv)
    model.pack_weights(16)
    calls = []
    monkeypatch.setattr(SnakeBeta, "forward_channels_last", lambda *args: calls.append(args))
    codes = random_codes(8, 30, seed=2, batch=2)
    with torch.no_grad():
        whole = model(codes)[:, 0]
    streams = stream_interleaved(Code2WavStreamer(model), list(codes), [[1, 6, 23], [4, 25, 1]], rounds=12, seed=1)
    assert calls == [] and whole.abs().max() > 0
    assert max((s - w).abs().max().item() for s, w in zip(streams, whole)) <= 1e-4


def test_code2wav_on_amx_equals_the_reference_kernels():
    """Code2Wav's ``fast`` packing puts its decoder convolutions, and the pre-transformer's and upsampling
    blocks' linear layers, on AMX (weights stored as bfloat16 values):
    one-shot and streamed, the waveform equals the reference kernels' within float32 rounding (SnakeBeta and the
    left context applied inside the kernel, the decoder blocks' SnakeBeta inside their upsampling convolutions,
    the streams' histories gathered from the inputs)."""
    model = _code2wav_of_bfloat16_values()
    codes = random_codes(8, 30, seed=5, batch=2)
    with torch.no_grad():
        model.reference_kernels = True
        reference = model(codes)[:, 0]
        model.reference_kernels = False
        convs = [m for m in model.decoder.modules() if isinstance(m, (CausalConv1d, CausalConvTranspose1d))]
        linears = [m for part in (model.pre_transformer, model.upsample) for m in part.modules()
                   if type(m) is torch.nn.Linear]
        # all but the last convolution (one output), and every linear layer before the decoder
        assert model.pack_weights(16) == len(convs) - 1 + len(linears) and len(linears) == 2 * 7 + 2 * 2
        assert all(m.amx_weight is not None and m.weight.numel() == 0 for m in linears)  # one copy held
        # each decoder block's SnakeBeta is applied by its upsampling convolution's kernel, never on its own
        snakes = [block.block[0] for block in model.decoder if isinstance(block, DecoderBlock)]
        for snake in snakes:
            snake.forward_channels_last = None  # (calling it would fail)
        fast = model(codes)[:, 0]
    diff = (fast - reference).abs().max().item()
    assert reference.std() > 0.02 and diff <= 1e-5, diff
    streams = stream_interleaved(Code2WavStreamer(model), list(codes), [[1, 6, 23], [4, 25, 1]], rounds=12, seed=1)
    assert max((s - r).abs().max().item() for s, r in zip(streams, reference)) <= 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_media_towers_on_amx_equal_their_unpacked_layers(tiny_ckpt, dtype):
    """The ``fast`` option with ``many_rows`` (the media towers: every call sees a clip's frames or an image's
    patches) puts every linear layer on AMX (weights stored as bfloat16 values), one copy held; the towers'
    outputs equal their unpacked layers' within the dtype's rounding."""
    import copy

    from omnistage.models.layers.fast_linear import fast_kernels
    from omnistage.models.loader import load_into
    from omnistage.models.qwen3_omni.audio_encoder import AudioEncoder
    from omnistage.models.qwen3_omni.config import load_config
    from omnistage.models.qwen3_omni.vision_encoder import VisionEncoder

    cfg = load_config(tiny_ckpt).thinker_config
    audio, vision = AudioEncoder(cfg.audio_config).eval(), VisionEncoder(cfg.vision_config).eval()
    load_into(audio, tiny_ckpt, "thinker.audio_tower.")
    load_into(vision, tiny_ckpt, "thinker.visual.")
    gen = torch.Generator().manual_seed(0)
    vc = cfg.vision_config
    features = [torch.randn(audio.num_mel_bins, n, generator=gen).to(dtype) for n in (230, 70)]
    grids = [(1, 4, 6), (2, 2, 2)]
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), vc.in_channels * vc.temporal_patch_size * vc.patch_size**2,
                         generator=gen).to(dtype)
    for tower, run in ((audio, lambda m: torch.cat(m(features, [100, 100]))),
                       (vision, lambda m: torch.cat([t.flatten() for t in m(pixels, grids)]))):
        with torch.no_grad():
            for p in tower.parameters():  # as a checkpoint stored in bfloat16 loads
                p.copy_(p.to(torch.bfloat16).float())
        tower = tower.to(dtype)
        packed = fast_kernels(copy.deepcopy(tower), True, many_rows=True)
        linears = [m for m in packed.modules() if isinstance(m, torch.nn.Linear)]
        assert linears and all(getattr(m, "amx_weight", None) is not None and m.weight.numel() == 0 for m in linears)
        with torch.inference_mode():
            want, got = run(tower).float(), run(packed).float()
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        assert want.std() > 0 and (got - want).abs().max().item() <= tol * want.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,length,channels,dilation", [(2, 300, 96, 3), (3, 77, 40, 9), (16, 129, 64, 1)])
def test_residual_unit_in_one_pass_gives_the_two_convolutions_bits(dtype, batch, length, channels, dilation):
    """``residual_unit``: the first convolution's output never stored, the bits of ``conv`` twice (rows off the
    32-row blocks and the 128-row jobs, channels off the 32 blocks, a left context of the first one's reach)."""
    gen = torch.Generator().manual_seed(channels + length)
    w1 = amx_kernels.pack(_bf16_valued(channels, channels, 7, seed=1, scale=0.2))
    w2 = amx_kernels.pack(_bf16_valued(channels, channels, 1, seed=2, scale=0.2))
    b1, b2 = _bf16_valued(channels, seed=3), _bf16_valued(channels, seed=4)
    s1 = (torch.rand(channels, generator=gen) + 0.5, torch.rand(channels, generator=gen) + 0.5)
    s2 = (torch.rand(channels, generator=gen) + 0.5, torch.rand(channels, generator=gen) + 0.5)
    x = torch.randn(batch, length, channels, generator=gen).to(dtype)
    left = torch.randn(batch, 6 * dilation, channels, generator=gen).to(dtype)
    h = amx_kernels.conv(x, w1, dilation, b1, left=left, snake=s1)
    want = amx_kernels.conv(h, w2, 1, b2, residual=x.clone(), snake=s2)
    got = amx_kernels.residual_unit(x, left, dilation, (w1, b1, s1), (w2, b2, s2))
    assert torch.equal(got, want) and not torch.equal(got, x)
    with pytest.raises(ValueError, match="left context"):
        amx_kernels.residual_unit(x, left[:, 1:], dilation, (w1, b1, s1), (w2, b2, s2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_rows_make_a_streamed_unit_give_the_one_shot_bits(dtype):
    """``snake_kept``: a residual unit streamed in two chunks (the second reading the first's kept rows, activated
    by the kernels' arithmetic, as its left context) gives one-shot decoding's bits; per-item counts (0 new rows:
    the old left rows move on) keep what each item's own count keeps."""
    gen = torch.Generator().manual_seed(21)
    channels, dilation = 40, 3
    held = 6 * dilation
    w1 = amx_kernels.pack(_bf16_valued(channels, channels, 7, seed=5, scale=0.2))
    w2 = amx_kernels.pack(_bf16_valued(channels, channels, 1, seed=6, scale=0.2))
    b1, b2 = _bf16_valued(channels, seed=7), _bf16_valued(channels, seed=8)
    s1 = (torch.rand(channels, generator=gen) + 0.5, torch.rand(channels, generator=gen) + 0.5)
    s2 = (torch.rand(channels, generator=gen) + 0.5, torch.rand(channels, generator=gen) + 0.5)
    x = torch.randn(3, 90, channels, generator=gen).to(dtype)
    convs = (w1, b1, s1), (w2, b2, s2)
    left = torch.randn(3, held, channels, generator=gen).to(dtype)
    each = assert_kept_rows_stream_as_one_shot(
        amx_kernels.snake_kept, lambda x, left: amx_kernels.residual_unit(x, left, dilation, *convs), x, left, s1,
        [0, 7, 50])
    assert torch.equal(each[1, : held - 7], left[1, 7:])
    with pytest.raises(ValueError, match="valid counts"):
        amx_kernels.snake_kept(left, x, 91, s1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_output_head_runs_on_amx_at_every_batch_size(dtype):
    """``fast_linear.pack_output_head``: a vocabulary head of bfloat16 values on AMX tiles whatever the rows (a
    request's logits never depend on its batch mates: float32 rows summed part by part at every count, 1 to 3
    tiles a group of 16), within the dtype's rounding of the float64 product; heads that are not bfloat16 values,
    have a bias or are tied to the embedding stay for the panels."""
    from torch import nn

    from omnistage.models.layers.fast_linear import PackedLinear, pack_output_head

    weight = _bf16_valued(1000, 256, seed=3, scale=0.05)
    embedding = nn.Embedding(1000, 256)
    head = nn.Linear(256, 1000, bias=False).to(dtype)
    with torch.no_grad():
        head.weight.copy_(weight)
    assert pack_output_head(head, embedding) == 1 and isinstance(head, PackedLinear) and head.weight.numel() == 0
    x = _bf16_valued(16, 256, seed=4).to(dtype) if dtype == torch.bfloat16 else \
        torch.randn(16, 256, generator=torch.Generator().manual_seed(4))
    batch = head(x)
    assert batch.dtype == dtype and batch.shape == (16, 1000)
    assert all(torch.equal(head(x[i : i + 1]), batch[i : i + 1]) for i in (0, 7, 15))
    assert torch.equal(head(x[3:8]), batch[3:8]) and torch.equal(head(x[2:13]), batch[2:13])
    many = torch.cat((x, x, x[:8]))  # past amx_kernels.FEW_ROWS: the convolution's jobs (bfloat16), groups (float32)
    assert torch.equal(head(many)[:16], batch) and torch.equal(head(many)[32:], batch[:8])
    exact = x.double() @ weight.double().t()
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    assert (batch.double() - exact).abs().max() <= tol * exact.abs().max()
    not_bf16 = nn.Linear(256, 1000, bias=False)
    biased = nn.Linear(256, 1000).to(dtype)
    tied = nn.Linear(256, 1000, bias=False).to(dtype)
    tied.weight = embedding.to(dtype).weight
    with torch.no_grad():
        biased.weight.copy_(weight)
    assert [pack_output_head(h, embedding) for h in (not_bf16, biased, tied)] == [0, 0, 0]
    assert {type(h) for h in (not_bf16, biased, tied)} == {nn.Linear}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_over_few_rows_gives_the_bits_of_many(dtype):
    """``amx_kernels.linear`` up to ``FEW_ROWS`` rows (one split per thread) gives each row the bits the
    convolution's jobs give it among many rows; float32 within float32 rounding of the float64 product."""
    weight = _bf16_valued(300, 96, seed=6)
    packed = amx_kernels.pack(weight)
    x = _bf16_valued(40, 96, seed=7, scale=3.0).to(dtype) if dtype == torch.bfloat16 else \
        torch.randn(40, 96, generator=torch.Generator().manual_seed(7))
    many = amx_kernels.linear(x, packed)
    for lo, hi in ((0, 1), (5, 21), (24, 40)):
        assert torch.equal(amx_kernels.linear(x[lo:hi], packed), many[lo:hi])
    if dtype == torch.float32:
        exact = x.double() @ weight.double().t()
        assert (many.double() - exact).abs().max() <= 1e-5 * exact.abs().max()


def test_rows_per_job_follow_the_planes_and_the_threads():
    """``row_chunk``: long jobs where their planes fit L2 and every thread keeps several jobs, else 128 rows."""
    assert amx_kernels.row_chunk(16, 48000, 96, 1, 54, 2) == 512
    assert amx_kernels.row_chunk(16, 4000, 384, 3, 54, 2) == 512  # (512 + 54) x 384 x 3 x 2 bytes < 1.5 MB
    assert amx_kernels.row_chunk(16, 800, 768, 3, 54, 2) == 256  # 2.6 MB of planes at 512 rows, 1.4 at 256
    assert amx_kernels.row_chunk(1, 800, 96, 1, 6, 2) == 128  # 7 jobs for 2 threads
    assert amx_kernels.row_chunk(2, 4000, 96, 1, 6, 2) == 512
    assert amx_kernels.row_chunk(2, 1500, 96, 1, 6, 2) == 256


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_per_job_do_not_change_the_bits(dtype, monkeypatch):
    """A job's length (halo rows split again at each job's start, the last job short) changes no row's sums."""
    channels, dilation = 64, 9
    gen = torch.Generator().manual_seed(11)
    w1 = amx_kernels.pack(_bf16_valued(channels, channels, 7, seed=1, scale=0.2))
    w2 = amx_kernels.pack(_bf16_valued(channels, channels, 1, seed=2, scale=0.2))
    b1, b2 = _bf16_valued(channels, seed=3), _bf16_valued(channels, seed=4)
    s1 = (torch.rand(channels, generator=gen) + 0.5, torch.rand(channels, generator=gen) + 0.5)
    s2 = (torch.rand(channels, generator=gen) + 0.5, torch.rand(channels, generator=gen) + 0.5)
    x = torch.randn(4, 2 * 512 + 77, channels, generator=gen).to(dtype)
    left = torch.randn(4, 6 * dilation, channels, generator=gen).to(dtype)
    assert amx_kernels.row_chunk(4, x.shape[1], 64, 3, 6 * dilation, torch.get_num_threads()) == 512
    runs = []
    for most in (512, 128):
        monkeypatch.setattr(amx_kernels, "MAX_ROW_CHUNK", most)
        runs.append((amx_kernels.conv(x, w1, dilation, b1, left=left, snake=s1),
                     amx_kernels.residual_unit(x, left, dilation, (w1, b1, s1), (w2, b2, s2))))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_activate_like_float64_at_any_argument(dtype):
    """SnakeBeta as the kernels compute it (their own sine, libmvec's past |x alpha| 8192 or at NaN): through a
    one-tap identity convolution every output is the activation (float32: its three parts summed back exactly;
    bfloat16: rounded, at most one bfloat16 step from float64's). Arguments from 0.01 to ~1e6 rad, vectors
    mixing both paths."""
    channels = 64
    gen = torch.Generator().manual_seed(12)
    x = (torch.rand(1, 6, channels, generator=gen) + 0.01).to(dtype)
    alpha = torch.logspace(0, 6, channels)  # 1 .. 1e6 per channel: a 16-lane vector of each kind and mixed ones
    alpha[::5] = 3.0
    scale = torch.full((channels,), 4.0)  # sin^2 scaled past x: the sine decides the value
    eye = amx_kernels.pack(torch.eye(channels, dtype=torch.bfloat16))
    got = amx_kernels.conv(x, eye, 1, None, snake=(alpha, scale)).double()
    xd = x.double()
    argument = (x.float() * alpha).double()  # rounded to float32 as the kernel (and torch) computes it
    want = xd + (torch.sin(argument) * 4.0) ** 2
    step = want.abs().clamp(min=2**-20) * 2**-7 if dtype == torch.bfloat16 else want.abs().clamp(min=1) * 5e-7
    assert ((got - want).abs() <= step).all()
    nan = x.clone()
    nan[0, 0, 3] = float("nan")
    assert amx_kernels.conv(nan, eye, 1, None, snake=(alpha, scale))[0, 0, 3].isnan()
