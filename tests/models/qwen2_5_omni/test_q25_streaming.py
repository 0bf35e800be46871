"""Streaming Token2Wav: windows vs one-shot decoding, the vocoder's context bound, noise alignment, batching.

The ODE runs 4 steps here instead of 10 (12 network evaluations instead of 36): what these tests check —
alignment of codes, noise, DiT blocks and vocoder context between windows and the one-shot decode — does not
depend on the step count, and the suite stays fast.
"""

from __future__ import annotations

import pytest
import torch
from q25_reference import loaded

from omnistage.models.qwen2_5_omni.dit import ODEConfig
from omnistage.models.qwen2_5_omni.streaming import ChunkPlan, Token2WavStream
from omnistage.models.qwen2_5_omni.token2wav import NoiseStream, Token2WavWindow

NUM_CODES = 48
SEED = 7


@pytest.fixture(autouse=True, scope="module")
def _short_ode():
    t2w = loaded().token2wav
    before, t2w.ode = t2w.ode, ODEConfig(num_steps=4)
    yield
    t2w.ode = before


def _codes(n: int = NUM_CODES, seed: int = 5) -> torch.Tensor:
    vocab = loaded().config.talker_config.vocab_size
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _noise(seed: int = SEED) -> NoiseStream:
    return NoiseStream(torch.Generator().manual_seed(seed), loaded().token2wav.mel_dim)


@torch.inference_mode()
def _one_shot(codes: torch.Tensor, voice: str = "Ethan", seed: int = SEED) -> torch.Tensor:
    t2w = loaded().token2wav
    return t2w(codes[None], _noise(seed).take(codes.numel() * t2w.repeats)[None], [voice])[0]


def _stream(plan: ChunkPlan, codes: torch.Tensor, piece: int = 5, voice: str = "Ethan", seed: int = SEED):
    """Push codes in pieces: (windows, number of codes pushed when the first window became ready)."""
    t2w = loaded().token2wav
    dit = t2w.code2wav_dit_model
    stream = Token2WavStream(plan, dit.block_size, dit.repeats, voice, _noise(seed))
    windows, first_ready = [], None
    for i in range(0, codes.numel(), piece):
        ready = stream.push(codes[i : i + piece])
        if ready and first_ready is None:
            first_ready = min(i + piece, codes.numel())
        windows += ready
    return windows + stream.finish(), first_ready


@torch.inference_mode()
def test_window_covering_everything_is_one_shot():
    codes = _codes()
    windows, first = _stream(ChunkPlan(chunk_blocks=3, past_blocks=100, future_blocks=100), codes)
    assert first is None  # its look-ahead is never complete before the end
    audio = torch.cat(loaded().token2wav.decode_windows(windows))
    # Float rounding only (the ODE runs over other shapes): measured 1.03e-5 on an AVX2 CPU, 1e-4 is the
    # waveform contract everywhere else.
    assert (audio - _one_shot(codes)).abs().max().item() <= 1e-4


@torch.inference_mode()
def test_vocoder_context_bound_reproduces_one_shot_vocoding():
    """BigVGAN.context_frames is a true bound: vocoding slices with that much context on each side and keeping
    the middle gives the one-shot samples; with a quarter of it the seams show."""
    t2w = loaded().token2wav
    codes = _codes()
    mel = t2w.mel(codes[None], _noise().take(codes.numel() * t2w.repeats)[None], ["Ethan"])
    whole = t2w.code2wav_bigvgan_model(mel)[0]

    def stitched(context: int) -> torch.Tensor:
        parts, total, hop = [], mel.shape[-1], t2w.hop
        for s in range(0, total, 24):
            e, a = min(total, s + 24), max(0, s - context)
            wave = t2w.code2wav_bigvgan_model(mel[:, :, a : min(total, e + context)])[0]
            parts.append(wave[(s - a) * hop : (e - a) * hop])
        return torch.cat(parts)

    assert (stitched(t2w.vocoder_context) - whole).abs().max().item() <= 1e-5
    assert (stitched(t2w.vocoder_context // 4) - whole).abs().max().item() > 1e-3


@pytest.mark.parametrize(
    "plan,tol",
    [
        # Enough DiT context that truncation no longer shows on this model: pins noise/code/block alignment.
        (ChunkPlan(chunk_blocks=3, past_blocks=8, future_blocks=4), 1e-4),
        # Qwen's own geometry (3 new blocks, 2 back, 1 ahead): an approximation; measured max 0.2 here.
        (ChunkPlan(), 0.5),
        # Growing chunks (3, 3, 6 blocks here) keep the alignment exact and the first audio as early.
        (ChunkPlan(chunk_blocks=3, past_blocks=8, future_blocks=4, max_chunk_blocks=24), 1e-4),
        (ChunkPlan(max_chunk_blocks=24), 0.5),
    ],
)
@torch.inference_mode()
def test_chunked_audio_length_latency_and_deviation(plan, tol):
    t2w = loaded().token2wav
    dit = t2w.code2wav_dit_model
    codes = _codes()
    windows, first = _stream(plan, codes)
    # Audio starts once one chunk plus its look-ahead of codes exists, long before the end.
    needed = (plan.chunk_blocks + plan.future_blocks) * dit.block_size // dit.repeats
    assert first == -(-needed // 5) * 5 < NUM_CODES
    waves = t2w.decode_windows(windows)
    assert [w.numel() for w in waves] == [w.keep_frames * t2w.hop for w in windows]
    audio, ref = torch.cat(waves), _one_shot(codes)
    assert audio.shape == ref.shape  # no gap, no overlap
    assert (audio - ref).abs().max().item() <= tol


@torch.inference_mode()
def test_windows_batched_across_requests_equal_solo():
    """Windows of two requests (different codes, voices, noise; one window length shared, others not) decoded in
    one call give each request's audio as decoded alone."""
    t2w = loaded().token2wav
    a, _ = _stream(ChunkPlan(), _codes(NUM_CODES, 1), voice="Ethan", seed=1)
    b, _ = _stream(ChunkPlan(), _codes(NUM_CODES - 17, 2), voice="Chelsie", seed=2)
    mixed = t2w.decode_windows([a[1], b[0], a[0], b[-1], a[-1], b[1]])
    solo = t2w.decode_windows(a[:2] + a[-1:]) + t2w.decode_windows(b[:2] + b[-1:])
    expect = [solo[1], solo[3], solo[0], solo[5], solo[2], solo[4]]
    for got, want in zip(mixed, expect):
        assert got.shape == want.shape and (got - want).abs().max().item() <= 1e-4  # batch-size rounding


@pytest.mark.parametrize("plan", [ChunkPlan(), ChunkPlan(max_chunk_blocks=6)])
def test_stream_memory_stays_bounded(plan):
    dit = loaded().token2wav.code2wav_dit_model
    stream = Token2WavStream(plan, dit.block_size, dit.repeats, "Ethan", _noise())
    for _ in range(100):
        stream.push(torch.zeros(4, dtype=torch.long))
    largest = plan.max_chunk_blocks or plan.chunk_blocks
    limit = (plan.past_blocks + largest + plan.future_blocks) * dit.block_size
    assert stream.total_frames == 800 and stream._rows.shape[0] <= limit
    assert stream._codes.numel() * dit.repeats == stream._rows.shape[0]


def test_growing_chunks_sizes_readiness_and_work():
    """Each chunk takes as many new blocks as were handed out (3, 3, 6, 12, then the cap), becomes ready only
    when its codes and look-ahead exist, and the windows cover the answer once, in order, with less DiT work
    than fixed chunks."""
    dit = loaded().token2wav.code2wav_dit_model
    block = dit.block_size
    fixed, grown = ChunkPlan(), ChunkPlan(max_chunk_blocks=12)
    assert [grown.next_chunk(e) for e in (0, 3, 6, 12, 24, 36)] == [3, 3, 6, 12, 12, 12]
    stream = Token2WavStream(grown, block, dit.repeats, "Ethan", _noise())
    codes_per_block = block // dit.repeats
    windows, pushed, ready_at = [], 0, []
    for _ in range(60 * codes_per_block):  # 60 blocks of codes, one code at a time
        got = stream.push(torch.zeros(1, dtype=torch.long))
        pushed += 1
        ready_at += [pushed] * len(got)
        windows += got
    windows += stream.finish()
    kept = [w.keep_frames // block for w in windows]
    assert kept == [3, 3, 6, 12, 12, 12, 12]
    ends = [sum(kept[: i + 1]) for i in range(len(kept))]
    # a chunk is handed out the moment its last block and one block of look-ahead exist (the last at finish)
    assert ready_at == [(e + grown.future_blocks) * codes_per_block for e in ends[:-1]]
    assert all(w.keep_start == min(w.keep_start, grown.past_blocks * block) for w in windows)

    def decoded_frames(plan: ChunkPlan) -> int:
        s = Token2WavStream(plan, block, dit.repeats, "Ethan", _noise())
        return sum(w.noise.shape[0] for w in s.push(torch.zeros(60 * codes_per_block, dtype=torch.long)) + s.finish())

    # windows: first 3 + 1 ahead, then 2 back + chunk + 1 ahead, the last with nothing ahead (the one-shot: 60)
    assert decoded_frames(fixed) == (4 + 18 * 6 + 5) * block
    assert decoded_frames(grown) == (4 + 6 + 9 + 15 + 15 + 15 + 14) * block


def test_noise_stream_pieces_equal_one_draw():
    g = torch.Generator().manual_seed(3)
    whole = torch.randn(1, 2 * 37, 80, generator=g)
    stream = NoiseStream(torch.Generator().manual_seed(3), 80)
    pieces = torch.cat([stream.take(2 * n) for n in (1, 5, 3, 12, 16)])
    assert torch.equal(pieces, whole[0])
    torch.manual_seed(3)  # the reference draws from the global generator
    assert torch.equal(torch.randn(1, 2 * 37, 80), whole)


def test_window_validation():
    with pytest.raises(ValueError, match="outside"):
        Token2WavWindow(torch.zeros(4, dtype=torch.long), torch.zeros(8, 80), "Ethan", keep_start=6, keep_frames=3)
    with pytest.raises(ValueError, match="chunk_blocks"):
        ChunkPlan(chunk_blocks=0)
    with pytest.raises(ValueError, match="max_chunk_blocks"):
        ChunkPlan(max_chunk_blocks=0)
    assert [ChunkPlan(chunk_blocks=5, max_chunk_blocks=2).next_chunk(e) for e in (0, 5, 50)] == [5, 5, 5]
