"""Streaming Token2Wav: cut a request's growing code sequence into overlapping DiT windows.

Why windows and not exact incremental decoding: the DiT attends within blocks of ``block_size`` mel frames,
plus one block back in ``look_backward_layers`` and one ahead in ``look_ahead_layers`` — but the ODE applies
the network ``4 * (num_steps - 1)`` times (36 with the defaults), each time widening the reach, so a mel frame
of the one-shot result can depend on frames 36 blocks ahead and 72 behind (17 s / 35 s for the real model).
No finite look-ahead reproduces one-shot decoding exactly; the window trades exactness for latency, as Qwen's
own streaming does (block 24 mel frames, 3 new blocks per chunk, 2 blocks of past context, 1 block of
look-ahead — the defaults here). In practice the influence decays fast with distance (measured below).

Chunk ``i`` covers mel frames ``[s, e)``, ``s = i * chunk``, ``e = min(s + chunk, total)``. Its window is
``[max(0, s - past), min(total, e + future)]`` (block multiples, so block boundaries stay aligned with the
one-shot decode); the ODE runs on the window's codes from the *same* noise rows the one-shot decode would use;
the chunk keeps frames ``[s, e)``, and the vocoder reads up to its receptive field of context frames inside
the window (``BigVGAN.context_frames``), so the audio of consecutive chunks joins without a gap or overlap:
the samples of chunk ``i`` are exactly ``[s * hop, e * hop)`` of the utterance (the last chunk also the vocoder's
``tail``), the total length equals the one-shot length, and every difference from one-shot decoding comes from
the DiT's truncated context.
A chunk is ready once the codes of its look-ahead exist (or the Talker has finished); audio starts after
``chunk + future`` blocks of codes instead of the whole answer.

The look-ahead also bounds the vocoder's right context: BigVGAN reads ``context_frames()`` mel frames on each
side (39 for the real vocoder, 28 for the tiny test one), but a chunk only has ``future`` frames past its end.
Measured on the tiny checkpoint (block 8 frames = 4 codes, 400 random codes, 10 ODE steps, seeded noise;
the streaming report in the test helpers, ``testing/qwen2_5_omni/streaming_report.py``), chunked vs one-shot waveform, same length
(192000 samples) in every case; the one-shot decode runs the DiT over 800 mel frames:

    chunk/past/future blocks   DiT frames   codes before audio  max |diff|   RMS(diff)/RMS
    3 / 2 / 1 (Qwen's)         1592         20                  1.0e-01      1.5e-02   (right vocoder context 8 < 28 frames)
    3 / 2 / 1, growing to 24    968         20                  6.9e-02      6.7e-03   (the packaged plan)
    3 / 4 / 1                  2112         20                  1.0e-01      1.5e-02
    3 / 2 / 2                  1848         20                  1.1e-02      1.2e-03
    3 / 6 / 3                  3136         25                  4.5e-05      5.7e-06
    3 / 8 / 4                  3888         30                  9.9e-06      1.9e-06
    1 / 1 / 1                  2384         10                  1.0e-01      4.0e-02

Growing chunks (``ChunkPlan.max_chunk_blocks``) cut the DiT's work on long answers from ~2x the one-shot's to
~1.2x, with the first audio as early and fewer seams. On the small preset, 8 spoken answers of 300 codes at once
(``benchmarks/media_bench.py --bridge-args``, 2 threads, alternating runs): 77.1 / 74.5 s with fixed chunks,
63.2 / 59.4 s growing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omnistage.models.qwen2_5_omni.token2wav import NoiseStream, Token2WavWindow


@dataclass(frozen=True)
class ChunkPlan:
    """Chunk geometry in DiT blocks (``block_size`` mel frames each).

    ``max_chunk_blocks`` None: every chunk has ``chunk_blocks`` new blocks (Qwen's streaming). Else chunks
    grow: each takes as many new blocks as were handed out before it, up to ``max_chunk_blocks`` (never fewer
    than ``chunk_blocks``), so sizes go 3, 3, 6, 12, 24, 24, ... The first audio comes as early as with fixed
    chunks; a chunk is never longer than the audio already handed out, so it is decoded while that plays.
    Why grow: every chunk re-runs the DiT over its past and future context (36 network evaluations over the
    whole window), so fixed 3-block chunks with 2 + 1 context blocks decode each block twice; capped at 24 new
    blocks the overhead falls to (2 + 24 + 1) / 24 = 1.125x, with fewer seams where the context is cut.
    """

    chunk_blocks: int = 3
    past_blocks: int = 2
    future_blocks: int = 1
    max_chunk_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.chunk_blocks < 1 or self.past_blocks < 0 or self.future_blocks < 0:
            raise ValueError(f"chunk_blocks must be >= 1 and past/future blocks >= 0: {self}")
        if self.max_chunk_blocks is not None and self.max_chunk_blocks < 1:
            raise ValueError(f"max_chunk_blocks must be None or >= 1: {self}")

    def next_chunk(self, emitted_blocks: int) -> int:
        """New blocks of the chunk after ``emitted_blocks`` blocks were handed out (a cap at or below
        ``chunk_blocks`` leaves every chunk at ``chunk_blocks``)."""
        if self.max_chunk_blocks is None:
            return self.chunk_blocks
        return max(self.chunk_blocks, min(self.max_chunk_blocks, emitted_blocks))


class Token2WavStream:
    """One request's codes (and their noise rows) -> Token2Wav windows, as the codes arrive.

    ``block_size`` / ``repeats`` are the DiT's (mel frames per block / per code). Memory stays bounded: codes and
    noise older than the next chunk's past context are dropped. ``tail``: the vocoder makes samples past the last
    frame (``BigVGAN.tail``), which only the last window, handed out by ``finish``, carries; without look-ahead
    a chunk then waits for one frame past it, so that ``finish`` always has a window left.
    """

    def __init__(
        self, plan: ChunkPlan, block_size: int, repeats: int, voice: str, noise: NoiseStream, tail: bool = False
    ) -> None:
        if block_size % repeats:
            raise ValueError(f"block_size {block_size} must be a multiple of repeats {repeats}")
        self.plan = plan
        self.repeats = repeats
        self.voice = voice
        self.noise = noise
        self.block_size = block_size
        self.past = plan.past_blocks * block_size
        self.future = plan.future_blocks * block_size
        self._ahead = max(self.future, 1) if tail else self.future  # frames past a chunk before it goes out
        self._codes = torch.empty(0, dtype=torch.long)
        self._rows = torch.empty(0, noise.mel_dim)
        self._offset = 0  # mel frame of _rows[0] (a multiple of repeats)
        self.emitted = 0  # mel frames handed out
        self.finished = False

    @property
    def total_frames(self) -> int:
        return self._offset + self._rows.shape[0]

    def push(self, codes: torch.Tensor | list[int]) -> list[Token2WavWindow]:
        """Append codes; return the windows that became ready (possibly none)."""
        if self.finished:
            raise RuntimeError("codes pushed after the stream finished")
        codes = torch.as_tensor(codes, dtype=torch.long).reshape(-1)
        self._codes = torch.cat((self._codes, codes))
        self._rows = torch.cat((self._rows, self.noise.take(codes.numel() * self.repeats)))
        out = []
        while self.total_frames >= self.emitted + self._chunk() + self._ahead:
            out.append(self._window(self.emitted + self._chunk()))
        return out

    def finish(self) -> list[Token2WavWindow]:
        """No more codes: the windows that cover the rest (none when everything was handed out)."""
        self.finished = True
        out = []
        while self.emitted < self.total_frames:
            out.append(self._window(min(self.emitted + self._chunk(), self.total_frames)))
        return out

    def _chunk(self) -> int:
        """Mel frames of the next chunk (``emitted`` is a block multiple until the last chunk)."""
        return self.plan.next_chunk(self.emitted // self.block_size) * self.block_size

    def _window(self, end: int) -> Token2WavWindow:
        start = self.emitted
        lo = max(0, start - self.past)
        hi = min(self.total_frames, end + self.future)
        a, b = lo - self._offset, hi - self._offset
        window = Token2WavWindow(
            codes=self._codes[a // self.repeats : b // self.repeats].clone(),
            noise=self._rows[a:b].clone(),
            voice=self.voice,
            keep_start=start - lo,
            keep_frames=end - start,
            last=self.finished and end == self.total_frames,
        )
        self.emitted = end
        drop = max(0, self.emitted - self.past) - self._offset  # a multiple of repeats: block multiples
        if drop > 0:
            self._codes = self._codes[drop // self.repeats :]
            self._rows = self._rows[drop:]
            self._offset += drop
        return window
