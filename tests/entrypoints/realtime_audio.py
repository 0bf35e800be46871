"""Test audio for realtime sessions: the synthetic voiced signal the WebRTC VAD takes for speech
(``omnistage.testing.speech_turns``), and helpers to send it as the API's base64 pcm16 chunks."""

from __future__ import annotations

import base64

import numpy as np

from omnistage.testing.speech_turns import RATE, silence, speech_like

__all__ = ["RATE", "b64_chunks", "pcm", "silence", "speech_like"]


def b64_chunks(samples: np.ndarray, ms: int = 100) -> list[str]:
    step = RATE * ms // 1000
    return [base64.b64encode(samples[i:i + step].astype("<i2").tobytes()).decode() for i in range(0, samples.size, step)]


def pcm(b64: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(b64), dtype="<i2")
