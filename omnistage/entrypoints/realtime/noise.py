"""Input noise reduction (``audio.input.noise_reduction``): a streaming spectral Wiener filter applied to the
input audio as it is appended, before the VAD, the buffer and the model (as OpenAI's, which filters the audio
"before it is sent to VAD and the model").

The 24 kHz stream is cut into frames of ``FFT`` samples (21 ms, sqrt-Hann windows, 50 % overlap: the
weighted overlap-add reconstructs the input exactly when the gain is 1), so the output lags the input by
``DELAY`` samples (10.7 ms). Per frequency bin:
- the noise power is tracked by minimum statistics (the minimum of the smoothed power over the last
  ``MIN_WINDOW_S``, times a bias factor): stationary noise (fans, road, hum) is followed, speech is not, and
  no noise-only lead-in is needed;
- the gain is Wiener's, ``xi / (1 + xi)`` with the a-priori SNR ``xi`` estimated decision-directed (smoothed
  over frames, which keeps the residual noise from "musical" warbling), floored at the profile's gain floor.
Profiles (``PROFILES``): ``near_field`` (a headset or phone held close: speech well above the noise, so a deep
floor, -18 dB) and ``far_field`` (a laptop or room microphone: quieter, reverberant speech, so a gentler floor,
-10 dB, and less noise over-estimation, keeping the speech's tails). ``tests/entrypoints/test_realtime_parts.py``
measures the SNR gain on noisy synthetic speech.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from omnistage.entrypoints.realtime.config import AUDIO_RATE

FFT = 512
HOP = FFT // 2
DELAY = FFT - HOP
MIN_WINDOW_S = 1.5  # noise tracking: the minimum over this much audio (longer than a syllable or a word)
_BLOCKS = 6  # ... kept as the minima of this many sub-windows
_SMOOTH = 0.8  # per-bin power smoothing before the minimum
_DD = 0.96  # decision-directed weight of the previous frame's estimate


@dataclass(frozen=True)
class Profile:
    floor_db: float  # the lowest gain
    bias: float  # noise = minimum of the smoothed power x bias (the minimum sits below the mean)


PROFILES = {"near_field": Profile(floor_db=-18.0, bias=2.0), "far_field": Profile(floor_db=-10.0, bias=1.5)}


class NoiseReducer:
    """One session's filter state; ``process`` takes int16 samples (any count) and returns the filtered ones
    completed so far (whole hops: the rest waits for the next call)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.profile = PROFILES[kind]
        self.floor = 10 ** (self.profile.floor_db / 20)
        self.window = np.sqrt(np.hanning(FFT + 1)[:FFT])  # periodic: squared windows sum to 1 at 50 % overlap
        self.frame = np.zeros(FFT)  # the last FFT input samples
        self.overlap = np.zeros(HOP)  # the second half of the previous output frame
        self.pending = np.zeros(0, dtype=np.int16)
        bins = FFT // 2 + 1
        self.smoothed = np.zeros(bins)
        self.block_min = np.full(bins, np.inf)
        self.minima: list[np.ndarray] = []  # of the last sub-windows
        self.block_frames = 0
        self.block_len = max(1, int(MIN_WINDOW_S * AUDIO_RATE / HOP / _BLOCKS))
        self.prev_clean = np.zeros(bins)  # |gain * X|^2 of the previous frame
        self.frames = 0

    def process(self, samples: np.ndarray) -> np.ndarray:
        data = np.concatenate((self.pending, samples)) if self.pending.size else samples
        n = data.shape[0] // HOP
        out = np.empty(n * HOP, dtype=np.float64)
        for i in range(n):
            out[i * HOP:(i + 1) * HOP] = self._hop(data[i * HOP:(i + 1) * HOP].astype(np.float64))
        self.pending = data[n * HOP:].copy()
        return np.clip(np.round(out), -32768, 32767).astype(np.int16)

    def _hop(self, hop: np.ndarray) -> np.ndarray:
        self.frame = np.concatenate((self.frame[HOP:], hop))
        spec = np.fft.rfft(self.frame * self.window)
        power = spec.real ** 2 + spec.imag ** 2
        noise = self._track(power)
        post = power / noise
        xi = _DD * self.prev_clean / noise + (1 - _DD) * np.maximum(post - 1.0, 0.0)
        gain = np.maximum(xi / (1.0 + xi), self.floor)
        self.prev_clean = gain ** 2 * power
        y = np.fft.irfft(spec * gain, FFT) * self.window
        out = self.overlap + y[:HOP]
        self.overlap = y[HOP:].copy()
        return out

    def _track(self, power: np.ndarray) -> np.ndarray:
        """The noise power per bin (minimum statistics)."""
        self.frames += 1
        self.smoothed = power if self.frames == 1 else _SMOOTH * self.smoothed + (1 - _SMOOTH) * power
        self.block_min = np.minimum(self.block_min, self.smoothed)
        self.block_frames += 1
        if self.block_frames == self.block_len:
            self.minima = [*self.minima[-(_BLOCKS - 1):], self.block_min]
            self.block_min, self.block_frames = np.full_like(self.block_min, np.inf), 0
        floor = np.minimum.reduce([*self.minima, self.block_min]) if self.minima else self.block_min
        return np.maximum(floor * self.profile.bias, 1e-3)
