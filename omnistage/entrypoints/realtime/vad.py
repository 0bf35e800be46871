"""Server voice activity detection: where speech starts and stops in a stream of 24 kHz pcm16.

The WebRTC VAD (``webrtcvad-wheels``: Google's GMM detector, C, CPU, no model files) classifies 20 ms frames
of 16 kHz audio; the input is resampled to 16 kHz on the fly (soxr, streaming). The API's ``threshold`` in
[0, 1] sets both the detector's aggressiveness (``TurnDetection.aggressiveness``) and a level floor: a frame
quieter than ``-60 + 30 * threshold`` dBFS (RMS) is silence whatever the detector says (it fires on faint
noise). On top of the per-frame decisions:
- speech starts once ``START_VOICED`` of the last ``START_FRAMES`` frames are voiced; it is reported at the
  first of those voiced frames minus ``prefix_padding_ms`` (the API's ``audio_start_ms``: the start of the
  audio the turn will hold);
- speech stops after ``silence_duration_ms`` of unvoiced frames; it is reported at the end of that silence
  (the API's ``audio_end_ms``: the turn holds the trailing silence, as OpenAI's does).
Times are milliseconds of input audio since the session started (whole frames, so exact sample offsets).

``semantic_vad`` ends a turn by the same frames with a rule on how the speech before a pause ended, instead of a
fixed silence: speakers trail off at the end of what they say (final lowering: the last syllables are quieter)
and stop at full level when they hesitate mid-sentence. When a pause begins, the level of the last
``TAIL_FRAMES`` voiced frames (300 ms; mean power, dB) is compared with the turn's voiced frames before them:
``TRAILING_DB`` (3 dB) or more below is a trailing-off ending, and the turn ends after the short silence of its ``eagerness``
(``config.SEMANTIC_SILENCE_MS``: low 800 ms, medium / auto 400 ms, high 200 ms); otherwise after the long one
(2000 / 1200 / 600 ms), so a hesitation is waited out. A documented heuristic on the audio, not a model of the
words: ``benchmarks/turn_detection.py`` measures it against server VAD on synthetic turns
(``testing.speech_turns``: hesitation pauses held, turn ends trailing off).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import soxr
import webrtcvad

from omnistage.entrypoints.realtime.config import AUDIO_RATE, TurnDetection

VAD_RATE = 16000
FRAME_MS = 20
FRAME_SAMPLES = VAD_RATE * FRAME_MS // 1000
START_FRAMES = 5  # 100 ms window
START_VOICED = 3  # voiced frames in the window that make a start (a click or a single frame does not)
TAIL_FRAMES = 15  # semantic_vad: the last 300 ms of voiced frames before a pause (a word or so)
TRAILING_DB = 3.0  # ... this much below the turn's voiced frames before them: the speech trailed off
MIN_BODY_FRAMES = 5  # voiced frames before the tail needed to compare with


@dataclass(frozen=True)
class SpeechEvent:
    kind: str  # "started" | "stopped"
    ms: int  # audio_start_ms (padding included) or audio_end_ms


def _floor(config: TurnDetection) -> float:
    """The RMS (int16 units) below which a frame is silence."""
    return 32768.0 * 10 ** ((-60.0 + 30.0 * config.threshold) / 20)


class SpeechDetector:
    def __init__(self, config: TurnDetection, input_rate: int = AUDIO_RATE) -> None:
        self.config = config
        self.vad = webrtcvad.Vad(config.aggressiveness)
        self.floor = _floor(config)
        self.resampler = soxr.ResampleStream(input_rate, VAD_RATE, 1, dtype="int16", quality="HQ")
        self.pending = np.zeros(0, dtype=np.int16)
        self.frames = 0  # frames classified so far
        self.window: deque[tuple[int, bool]] = deque(maxlen=START_FRAMES)  # (frame index, voiced)
        self.in_speech = False
        self.silent_frames = 0
        self.needed_ms = config.silence_ms(False)  # the silence that ends the pause going on
        self.tail: deque[float] = deque(maxlen=TAIL_FRAMES)  # power of the last voiced frames
        self.voiced_power, self.voiced_frames = 0.0, 0  # the turn's voiced frames so far

    def reconfigure(self, config: TurnDetection) -> None:
        self.config = config
        self.vad.set_mode(config.aggressiveness)
        self.floor = _floor(config)

    def feed(self, samples: np.ndarray) -> list[SpeechEvent]:
        """Classify the new samples (int16 at the input rate); the speech starts and stops they complete."""
        out = self.resampler.resample_chunk(samples)
        buf = np.concatenate((self.pending, out)) if self.pending.size else out
        n = buf.shape[0] // FRAME_SAMPLES
        frames = buf[:n * FRAME_SAMPLES].reshape(n, FRAME_SAMPLES)
        power = np.mean(frames.astype(np.float64) ** 2, axis=1)
        events = []
        for frame, p in zip(frames, power):
            event = self._frame(bool(p >= self.floor ** 2) and self.vad.is_speech(frame.tobytes(), VAD_RATE),
                                float(p))
            if event is not None:
                events.append(event)
        self.pending = buf[n * FRAME_SAMPLES:].copy()
        return events

    def _frame(self, voiced: bool, power: float) -> SpeechEvent | None:
        index = self.frames
        self.frames += 1
        if not self.in_speech:
            self.window.append((index, voiced))
            if sum(v for _, v in self.window) >= START_VOICED:
                first = next(i for i, v in self.window if v)
                self.in_speech, self.silent_frames = True, 0
                self.window.clear()
                self.tail.clear()
                self.voiced_power, self.voiced_frames = 0.0, 0
                return SpeechEvent("started", max(0, first * FRAME_MS - self.config.prefix_padding_ms))
            return None
        if voiced:
            self.silent_frames = 0
            self.tail.append(power)
            self.voiced_power += power
            self.voiced_frames += 1
        else:
            if self.silent_frames == 0:  # a pause begins: how did the speech before it end?
                self.needed_ms = self.config.silence_ms(self._trailed_off())
            self.silent_frames += 1
        if self.silent_frames * FRAME_MS >= self.needed_ms:
            self.in_speech = False
            return SpeechEvent("stopped", (index + 1) * FRAME_MS)
        return None

    def _trailed_off(self) -> bool:
        before = self.voiced_frames - len(self.tail)
        if before < MIN_BODY_FRAMES:  # too little speech to tell (a short "yes"): wait as for a hesitation
            return False
        tail = sum(self.tail)
        tail_db = 10 * np.log10(tail / len(self.tail) + 1e-9)
        body_db = 10 * np.log10((self.voiced_power - tail) / before + 1e-9)
        return bool(tail_db <= body_db - TRAILING_DB)

    def reset(self) -> None:
        """Forget a speech in progress (the buffer was cleared or committed by the client)."""
        self.in_speech, self.silent_frames = False, 0
        self.window.clear()
