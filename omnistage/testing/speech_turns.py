"""Synthetic speech for tests and benchmarks of turn detection and noise reduction (24 kHz int16): a voiced
signal the WebRTC VAD takes for speech, spoken turns of phrases with hesitation pauses, noise at a chosen SNR,
and the measures (false ends, end latency, SNR) that compare detectors and denoisers on them.

The turns carry the cue semantic VAD reads (``entrypoints.realtime.vad``): a phrase the speaker goes on from is
cut off at full level (a hesitation), the turn's last phrase trails off (final lowering). That is a property
of these synthetic turns, chosen to match the prosodic finding; it is not a measurement on recorded speech.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

RATE = 24000
FADE_S = 0.5  # a trailing-off ending: the amplitude falls to 0 over the phrase's last 500 ms (its last word)


def speech_like(seconds: float, seed: int = 0) -> np.ndarray:
    """int16: a harmonic tone with a gliding pitch and a 4 Hz syllable envelope, plus a little noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * RATE)) / RATE
    f0 = 140 + 30 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / RATE
    sig = sum(np.sin(k * phase) / k for k in range(1, 30))
    sig = sig * (0.55 + 0.45 * np.sin(2 * np.pi * 4 * t)) + 0.05 * rng.standard_normal(t.size)
    return (sig / np.abs(sig).max() * 0.5 * 32767).astype(np.int16)


def silence(seconds: float) -> np.ndarray:
    return np.zeros(int(seconds * RATE), dtype=np.int16)


def phrase(seconds: float, seed: int, trailing: bool) -> np.ndarray:
    audio = speech_like(seconds, seed).astype(np.float64)
    if trailing:
        n = int(FADE_S * RATE)
        audio[-n:] *= np.linspace(1.0, 0.0, n)
    return audio.astype(np.int16)


@dataclass(frozen=True)
class Turn:
    audio: np.ndarray  # int16, ending in silence
    speech_end_ms: int  # where the last phrase ends
    pauses_ms: tuple[int, ...]  # the hesitation pauses inside the turn


def turns(n: int, seed: int = 0, tail_s: float = 3.0) -> list[Turn]:
    """``n`` turns of 2-3 phrases (0.6-1.5 s) with hesitation pauses of 300-1000 ms between them."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        k = int(rng.integers(2, 4))
        parts, pauses = [silence(0.5)], []
        for j in range(k):
            parts.append(phrase(float(rng.uniform(0.6, 1.5)), seed * 1000 + i * 10 + j, trailing=j == k - 1))
            if j < k - 1:
                pauses.append(int(rng.integers(15, 51)) * 20)  # whole 20 ms frames
                parts.append(silence(pauses[-1] / 1000))
        end = sum(p.size for p in parts) * 1000 // RATE
        out.append(Turn(np.concatenate([*parts, silence(tail_s)]), end, tuple(pauses)))
    return out


@dataclass(frozen=True)
class TurnStats:
    turns: int
    false_ends: int  # turns cut at a pause before the speaker was done
    missed: int  # turns whose end was never found
    mean_latency_ms: float  # end of speech -> the detector's end (turns ended once, at the right place)
    max_latency_ms: int


def measure(make_detector: Callable[[], Any], turns_: list[Turn], chunk: int = 2400) -> TurnStats:
    """Run a fresh detector (``make_detector()``: ``feed(samples)`` -> events with ``kind`` and ``ms``, as
    ``SpeechDetector``) over each turn, fed ``chunk`` samples at a time."""
    false_ends = missed = 0
    latencies = []
    for turn in turns_:
        det = make_detector()
        stops = [e.ms for i in range(0, turn.audio.size, chunk) for e in det.feed(turn.audio[i:i + chunk])
                 if e.kind == "stopped"]
        if any(ms < turn.speech_end_ms for ms in stops):
            false_ends += 1
        elif not stops:
            missed += 1
        else:
            latencies.append(stops[0] - turn.speech_end_ms)
    return TurnStats(len(turns_), false_ends, missed, float(np.mean(latencies)) if latencies else float("nan"),
                     max(latencies, default=0))


def with_noise(clean: np.ndarray, snr_db: float, seed: int = 0) -> np.ndarray:
    """``clean`` plus stationary noise (white noise shaped toward low frequencies, like fan or road noise) at
    ``snr_db`` over the clean signal's power."""
    rng = np.random.default_rng(seed)
    white = rng.standard_normal(clean.size)
    spectrum = np.fft.rfft(white) / np.sqrt(1.0 + np.fft.rfftfreq(clean.size, 1 / RATE) / 500.0)
    noise = np.fft.irfft(spectrum, clean.size)
    x = clean.astype(np.float64)
    noise *= np.sqrt(np.mean(x ** 2) / np.mean(noise ** 2) / 10 ** (snr_db / 10))
    return np.clip(x + noise, -32768, 32767).astype(np.int16)


def snr_db(clean: np.ndarray, test: np.ndarray) -> float:
    """The SNR of ``test`` against the ``clean`` reference (everything that differs counts as noise)."""
    x, y = clean.astype(np.float64), test.astype(np.float64)
    return float(10 * np.log10(np.sum(x ** 2) / max(np.sum((y - x) ** 2), 1e-9)))
