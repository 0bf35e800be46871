"""Stateful streaming Code2Wav: the concatenated stream equals one-shot decoding, whatever the chunking."""

from __future__ import annotations

import dataclasses
import functools
import math
import random

import pytest
import torch
from test_code2wav import build_pair, random_codes, randomize_, tiny_hf_config
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

from omnistage.models.loader import load_into
from omnistage.models.qwen3_omni.code2wav import Code2Wav, Code2WavConfig
from omnistage.models.qwen3_omni.code2wav_stream import Code2WavStreamer, Code2WavStreamState

TOL = 1e-4  # float32 streaming vs one-shot (measured ~1e-6)


@functools.cache
def _load(model_dir) -> Code2Wav:
    model = Code2Wav(Code2WavConfig.from_checkpoint(model_dir))
    load_into(model, model_dir, "code2wav.")
    return model.eval()


@pytest.fixture(params=["tiny", "tiny-gqa"])
def model(request, tiny_ckpt, gqa_ckpt) -> Code2Wav:
    return _load(tiny_ckpt if request.param == "tiny" else gqa_ckpt)


def one_shot(model: Code2Wav, codes: torch.Tensor) -> torch.Tensor:
    """codes [Q, T] -> wave [samples_for_frames(T)]"""
    if codes.shape[-1] == 0:
        return torch.zeros(0, dtype=model.code_embedding.weight.dtype)
    with torch.no_grad():
        return model(codes[None])[0, 0]


def stream_interleaved(streamer, requests, schedules, rounds, seed):
    """Decode every request by its schedule of chunk sizes, several requests per batched call.

    Each round takes a random subset of the unfinished requests (so rows sit at different positions with
    different chunk lengths); a row may also bring zero frames. Checks each call's lengths, padding and
    that input states are left untouched. Returns each request's concatenated stream.
    """
    model = streamer.model
    rng = random.Random(seed)
    q = model.config.num_quantizers
    pos = [0] * len(requests)
    step = [0] * len(requests)
    states: list[Code2WavStreamState | None] = [None] * len(requests)
    pieces: list[list[torch.Tensor]] = [[] for _ in requests]
    for _ in range(rounds):
        pending = [r for r in range(len(requests)) if step[r] < len(schedules[r])]
        if not pending:
            break
        rows = rng.sample(pending, rng.randint(1, len(pending)))
        idle = [r for r in range(len(requests)) if r not in rows and rng.random() < 0.3]
        rows += idle  # rows with no new frames: state and position unchanged
        sizes = [schedules[r][step[r]] if r not in idle else 0 for r in rows]
        width = max(sizes)
        codes = torch.full((len(rows), q, width), -1, dtype=torch.long)  # padding holds invalid ids
        for i, (r, n) in enumerate(zip(rows, sizes)):
            codes[i, :, :n] = requests[r][:, pos[r] : pos[r] + n]
        before = [None if states[r] is None else states[r].buffer.clone() for r in rows]
        out = streamer.decode(codes, torch.tensor(sizes), [states[r] for r in rows])
        for i, (r, n) in enumerate(zip(rows, sizes)):
            expect = model.samples_for_frames(pos[r] + n) - model.samples_for_frames(pos[r])
            assert out.wave_lengths[i].item() == expect
            assert torch.count_nonzero(out.wave[i, expect:]) == 0
            if before[i] is not None:
                assert torch.equal(states[r].buffer, before[i])
            pieces[r].append(out.wave[i, :expect])
            states[r] = out.states[i]
            pos[r] += n
            assert states[r].frames == pos[r]
            step[r] += r not in idle
    assert all(p == req.shape[-1] for p, req in zip(pos, requests))
    return [torch.cat(p) if p else torch.zeros(0) for p in pieces]


def random_schedule(rng: random.Random, total: int, first_max: int, later_max: int) -> list[int]:
    sizes = []
    while sum(sizes) < total:
        limit = first_max if not sizes else later_max
        sizes.append(min(rng.randint(1, limit), total - sum(sizes)))
    return sizes


def test_stream_equals_one_shot_interleaved(model):
    """Random schedules (first chunk 1..N, later chunks 1..M), six requests sharing batched calls."""
    streamer = Code2WavStreamer(model)
    rng = random.Random(0)
    q = model.config.num_quantizers
    totals = [110, 60, 1, 30, 45, 0]  # crosses the 72-frame window; one-frame and zero-frame answers
    requests = [random_codes(q, t, seed=10 + i)[0] for i, t in enumerate(totals)]
    schedules = [random_schedule(rng, t, first_max=6, later_max=30) for t in totals]
    streams = stream_interleaved(streamer, requests, schedules, rounds=400, seed=1)
    worst = 0.0
    for codes, got in zip(requests, streams):
        expect = one_shot(model, codes)
        assert got.shape == expect.shape == (model.samples_for_frames(codes.shape[-1]),)
        if expect.numel():
            worst = max(worst, (got - expect).abs().max().item())
    print(f"max |stream - one-shot| = {worst:.2e}")
    assert worst <= TOL


def test_one_frame_chunks_and_one_big_chunk(model):
    """The extremes: every frame its own call, and all frames in a single call (= decode)."""
    streamer = Code2WavStreamer(model)
    codes = random_codes(model.config.num_quantizers, 24, seed=4)[0]
    expect = one_shot(model, codes)
    single = stream_interleaved(streamer, [codes], [[1] * 24], rounds=24, seed=0)[0]
    whole = stream_interleaved(streamer, [codes], [[24]], rounds=1, seed=0)[0]
    assert (single - expect).abs().max().item() <= TOL
    assert (whole - expect).abs().max().item() <= TOL


def test_zero_and_one_frame_answers(model):
    streamer = Code2WavStreamer(model)
    q = model.config.num_quantizers
    out = streamer.decode(torch.zeros(2, q, 0, dtype=torch.long), [0, 0], [None, None])
    assert out.wave.shape == (2, 0) and out.wave_lengths.tolist() == [0, 0]
    assert [s.frames for s in out.states] == [0, 0]
    assert all(torch.count_nonzero(s.buffer) == 0 for s in out.states)
    codes = random_codes(q, 1, seed=2)
    out = streamer.decode(codes, [1], [None])
    assert out.wave_lengths.tolist() == [model.samples_for_frames(1)]
    assert (out.wave[0] - one_shot(model, codes[0])).abs().max().item() <= TOL
    # 70 frames fill a CPU row tile alone: the idle rows get tiles of their own with nothing to decode.
    codes = random_codes(q, 71, seed=3)
    out2 = streamer.decode(torch.cat((codes[..., :70], codes[..., 1:])), [70, 0], [None, out.states[0]])
    assert out2.wave_lengths.tolist() == [model.samples_for_frames(70), 0]
    assert torch.count_nonzero(out2.wave[1]) == 0
    assert torch.equal(out2.states[1].buffer, out.states[0].buffer) and out2.states[1].frames == 1
    assert (out2.wave[0] - one_shot(model, codes[0, :, :70])).abs().max().item() <= TOL


def test_retry_after_failure_gives_identical_output(model, monkeypatch):
    """A batch that fails mid-pass leaves the states as they were; retrying gives the same result as a
    run that never failed, bit for bit."""
    streamer = Code2WavStreamer(model)
    q = model.config.num_quantizers
    codes = random_codes(q, 40, seed=6, batch=2)
    first = streamer.decode(codes[..., :20], [20, 13], [None, None])
    kept = [s.buffer.clone() for s in first.states]
    second = torch.cat((codes[:1, :, 20:25], codes[1:, :, 13:18]))
    clean = streamer.decode(second, [5, 5], first.states)

    def fail(*args, **kwargs):
        raise RuntimeError("boom")

    # The last layer, after every other update (the method the active decoder kernels call).
    method = "forward_stream" if model.reference_kernels else "apply_padded_channels_last"
    monkeypatch.setattr(model.decoder[-1], method, fail)
    with pytest.raises(RuntimeError, match="boom"):
        streamer.decode(second, [5, 5], first.states)
    monkeypatch.undo()
    assert all(torch.equal(s.buffer, b) for s, b in zip(first.states, kept))
    retried = streamer.decode(second, [5, 5], first.states)
    assert torch.equal(retried.wave, clean.wave)
    assert torch.equal(retried.wave_lengths, clean.wave_lengths)
    assert all(torch.equal(a.buffer, b.buffer) and a.frames == b.frames
               for a, b in zip(retried.states, clean.states))


def _streams_equal_transformers(ratios, rates, decoder_dim: int, reference_kernels: bool):
    """Three requests of 9 frames streamed interleaved in uneven chunks equal transformers' Code2Wav of this
    geometry (weights shared); returns our model and the requests' codes."""
    hf_config = tiny_hf_config(8)
    hf_config.upsampling_ratios, hf_config.upsample_rates, hf_config.decoder_dim = ratios, rates, decoder_dim
    torch.manual_seed(0)
    reference = Qwen3OmniMoeCode2Wav(hf_config).float().eval()
    randomize_(reference, seed=4)
    ours = Code2Wav(hf_config).float().eval()
    ours.load_state_dict(reference.state_dict(), strict=True)
    ours.reference_kernels = reference_kernels
    requests = [random_codes(8, 9, seed=20 + i)[0] for i in range(3)]
    with torch.no_grad():
        expect = [reference(codes[None])[0, 0] for codes in requests]
    schedules = [[1] * 9, [1, 2, 1, 5], [2, 1, 6]]
    streams = stream_interleaved(Code2WavStreamer(ours), requests, schedules, rounds=40, seed=2)
    for got, want in zip(streams, expect, strict=True):
        assert got.shape == want.shape == (ours.samples_for_frames(9),)
        assert (got - want).abs().max().item() <= TOL
    return ours, requests


@pytest.mark.parametrize("decoder_dim,rates", [(50, (3, 2, 4)), (13, (2, 2, 2)), (100, (5, 4))],
                         ids=["50-25-12-6", "13-6-3-1", "100-50-25"])
@pytest.mark.parametrize("reference_kernels", [False, True], ids=["fast", "reference-kernels"])
def test_decoder_widths_that_do_not_halve_evenly_equal_transformers(decoder_dim, rates, reference_kernels):
    """transformers halves the decoder's channels with floor division at every block, whatever decoder_dim is
    (50 -> 25 -> 12 -> 6); such checkpoints used to be refused at load."""
    ours, _ = _streams_equal_transformers((2,), rates, decoder_dim, reference_kernels)
    assert ours.decoder[-1].conv.weight.shape[1] == decoder_dim // 2 ** len(rates)


@pytest.mark.parametrize("ratios", [(), (1,), (1, 2)], ids=["none", "1", "1-2"])
@pytest.mark.parametrize("reference_kernels", [False, True], ids=["fast", "reference-kernels"])
def test_stream_without_pre_upsampling_equals_transformers(ratios, reference_kernels):
    """Checkpoints transformers accepts with no pre-upsampling before the decoder blocks: a first chunk of one
    frame gives the first block one input, so the second block gets none in that call. Its stream starts at the
    call that first brings it inputs (its first block trimmed there), not at the request's first call; it used to
    start at the request's first call and then emit its trimmed block later, off by up to 1.0."""
    ours, requests = _streams_equal_transformers(ratios, (3, 2, 4), 32, reference_kernels)
    # One frame is too few for a sample without pre-upsampling: one-shot decoding gives none (transformers raises:
    # a convolution with no input to pad), as the stream does.
    with torch.no_grad():
        one = ours(requests[0][None, :, :1])
    assert one.shape == (1, 1, ours.samples_for_frames(1)) and (one.numel() == 0) == (math.prod(ratios) == 1)


def test_seamless_past_300_frames_where_chunked_decode_is_not():
    """transformers' chunked_decode (300-frame chunks, 25 frames of recomputed context) loses 555 samples
    per chunk boundary and deviates from one-shot decoding after it; the stream equals one-shot."""
    reference, ours = build_pair(16)  # grouped-query attention, weights shared with transformers
    codes = random_codes(16, 330, seed=8)
    with torch.no_grad():
        expect = reference(codes)[0, 0]
        chunked = reference.chunked_decode(codes, chunk_size=300, left_context_size=25)[0, 0]
    rng = random.Random(3)
    got = stream_interleaved(Code2WavStreamer(ours), [codes[0]], [random_schedule(rng, 330, 25, 60)], 40, 0)[0]
    stream_diff = (got - expect).abs().max().item()
    spf, lost = ours.samples_per_frame, ours.samples_per_frame * 300 - ours.samples_for_frames(300)
    assert got.shape == expect.shape
    assert chunked.shape[-1] == expect.shape[-1] - lost  # a seam of `lost` samples at frame 300
    # Before the seam chunked decoding is exact; after it, aligned on frame 300, it deviates.
    assert (chunked[: 300 * spf - lost] - expect[: 300 * spf - lost]).abs().max().item() <= TOL
    chunked_diff = (chunked[300 * spf - lost :] - expect[300 * spf :]).abs().max().item()
    print(f"max diff to transformers one-shot: stream {stream_diff:.2e}, chunked_decode {chunked_diff:.2e}")
    assert stream_diff <= TOL
    assert chunked_diff > 100 * TOL


def test_bfloat16_smoke(tiny_ckpt):
    model = Code2Wav(Code2WavConfig.from_checkpoint(tiny_ckpt))
    load_into(model, tiny_ckpt, "code2wav.", torch.bfloat16)
    streamer = Code2WavStreamer(model.eval())
    assert streamer.initial_state().buffer.dtype == torch.bfloat16
    q = model.config.num_quantizers
    requests = [random_codes(q, 30, seed=1)[0], random_codes(q, 12, seed=2)[0]]
    streams = stream_interleaved(streamer, requests, [[1, 4, 25], [12]], rounds=10, seed=0)
    for codes, got in zip(requests, streams):
        assert got.dtype == torch.bfloat16
        assert got.shape == (model.samples_for_frames(codes.shape[-1]),)
        assert torch.isfinite(got).all()
        assert got.float().std() > 0.01


def test_state_layout_of_the_real_model():
    """Per request: K and V of the last 71 frames per layer, the last inputs of every causal convolution
    ((k - 1) * dilation each) and the last input of each decoder block's transposed convolution."""
    hf_config = Qwen3OmniMoeCode2WavConfig()  # the real model's sizes; meta device allocates nothing
    with torch.device("meta"):
        streamer = Code2WavStreamer(Code2Wav(hf_config))
    slots = {slot.name: slot.shape for slot in streamer.slots}
    assert slots["pre_transformer.layers.7.self_attn.v_proj"] == (16, 71, 64)
    assert slots["upsample.1.1.dwconv"] == (1024, 6)
    assert slots["decoder.0"] == (1024, 6)
    assert slots["decoder.1.block.1"] == (1536, 1)  # transposed convolution
    assert slots["decoder.1.block.4.conv1"] == (768, 54)  # dilation 9
    assert slots["decoder.6"] == (96, 6)
    assert len(slots) == 16 + 2 + 1 + 4 * (1 + 3) + 1
    kv = 8 * 2 * 16 * 71 * 64
    assert streamer.state_size == kv + 134_208  # 5.2 MB per request in float32, 90% of it attention
    assert streamer.slots[-1].offset + streamer.slots[-1].size == streamer.state_size


def test_bad_inputs_are_rejected(model):
    streamer = Code2WavStreamer(model)
    q = model.config.num_quantizers
    codes = random_codes(q, 4, seed=0)
    with pytest.raises(ValueError, match="one length and one state per row"):
        streamer.decode(codes, [4, 4], [None])
    with pytest.raises(ValueError, match="lengths must lie"):
        streamer.decode(codes, [5], [None])
    with pytest.raises(ValueError, match="state buffer must be"):
        streamer.decode(codes, [4], [Code2WavStreamState(0, torch.zeros(3))])
    with pytest.raises(ValueError, match="codes must lie"):
        streamer.decode(codes + model.config.codebook_size, [4], [None])
    full_causal = Code2Wav(dataclasses.replace(model.config, sliding_window=None))
    with pytest.raises(ValueError, match="sliding attention window"):
        Code2WavStreamer(full_causal)
