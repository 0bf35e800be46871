"""The input audio buffer of one session: 24 kHz pcm16 samples of the turn being spoken, addressed by
absolute sample offsets since the session started (so VAD times map to exact samples), bounded in size."""

from __future__ import annotations

import numpy as np

from omnistage.entrypoints.realtime.config import AUDIO_RATE

MIN_COMMIT_MS = 100  # OpenAI's minimum for a committed buffer (and for an audio part of an item)


def ms_to_samples(ms: int) -> int:
    return ms * AUDIO_RATE // 1000


class InputAudioBuffer:
    def __init__(self, max_samples: int) -> None:
        self.max_samples = max_samples
        self.chunks: list[np.ndarray] = []
        self.start = 0  # absolute offset of the first stored sample
        self.stored = 0  # samples stored
        self.total = 0  # samples received since the session started (stored or not)

    @property
    def end(self) -> int:
        return self.start + self.stored

    @property
    def full(self) -> bool:
        return self.stored >= self.max_samples

    def append(self, samples: np.ndarray) -> int:
        """Store what fits; returns how many samples were dropped for want of room. Samples are stored only
        while they continue the stored audio (after a drop, later audio would leave a gap)."""
        self.total += samples.shape[0]
        if self.end != self.total - samples.shape[0]:  # a gap: earlier audio was dropped
            return samples.shape[0]
        room = self.max_samples - self.stored
        keep = samples[:room]
        if keep.size:
            self.chunks.append(keep)
            self.stored += keep.shape[0]
        return samples.shape[0] - keep.shape[0]

    def _joined(self) -> np.ndarray:
        if len(self.chunks) != 1:
            self.chunks = [np.concatenate(self.chunks) if self.chunks else np.zeros(0, dtype=np.int16)]
        return self.chunks[0]

    def take(self, start: int | None = None, end: int | None = None) -> np.ndarray:
        """Remove and return the stored samples in [start, end) (default: all); everything before ``end``
        goes with them, the stored audio after ``end`` stays."""
        audio = self._joined()
        lo = max(0, (start if start is not None else self.start) - self.start)
        hi = min(self.stored, (end if end is not None else self.end) - self.start)
        out = audio[lo:hi].copy() if hi > lo else np.zeros(0, dtype=np.int16)
        cut = max(0, hi)
        self.chunks = [audio[cut:]] if cut < self.stored else []
        self.stored -= cut
        self.start += cut
        if not self.stored:
            self.start = self.total
        return out

    def keep_last(self, samples: int) -> None:
        """Drop stored audio older than the last ``samples`` (silence before any speech)."""
        extra = self.stored - samples
        if extra > 0:
            audio = self._joined()
            self.chunks = [audio[extra:]]
            self.stored -= extra
            self.start += extra

    def clear(self) -> None:
        self.chunks, self.stored, self.start = [], 0, self.total
