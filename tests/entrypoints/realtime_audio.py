"""Test audio for realtime sessions: a synthetic voiced signal the WebRTC VAD takes for speech, and helpers
to send it as the API's base64 pcm16 chunks."""

from __future__ import annotations

import base64

import numpy as np

RATE = 24000


def speech_like(seconds: float, seed: int = 0) -> np.ndarray:
    """int16 at 24 kHz: a harmonic tone with a gliding pitch and a 4 Hz syllable envelope, plus a little noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * RATE)) / RATE
    f0 = 140 + 30 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / RATE
    sig = sum(np.sin(k * phase) / k for k in range(1, 30))
    sig = sig * (0.55 + 0.45 * np.sin(2 * np.pi * 4 * t)) + 0.05 * rng.standard_normal(t.size)
    return (sig / np.abs(sig).max() * 0.5 * 32767).astype(np.int16)


def silence(seconds: float) -> np.ndarray:
    return np.zeros(int(seconds * RATE), dtype=np.int16)


def b64_chunks(samples: np.ndarray, ms: int = 100) -> list[str]:
    step = RATE * ms // 1000
    return [base64.b64encode(samples[i:i + step].astype("<i2").tobytes()).decode() for i in range(0, samples.size, step)]


def pcm(b64: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(b64), dtype="<i2")
