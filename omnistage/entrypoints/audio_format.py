"""Encode float waveforms as 16-bit PCM, WAV or FLAC bytes (no external codec library needed).

All formats carry the same int16 samples: ``to_int16`` is the one quantisation step, so a client that
decodes any of them gets identical samples. The FLAC encoder is a small, valid subset of the format:
one mono channel, 16 bits, fixed-size blocks, each block coded as a constant, with the best of the fixed
predictors (orders 0-4, single-partition Rice residual) or verbatim, with CRC-8/CRC-16 and the STREAMINFO MD5.

Zero samples: a WAV with an empty data chunk is valid. FLAC cannot say it: STREAMINFO's total-samples
field 0 means "unknown", and a stream without frames then fails in libsndfile (``psf_fseek() failed``), so
empty audio is written as one silent sample (42 us at 24 kHz), which every decoder reads.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import torch

_ALIASES = {"pcm": "pcm16", "pcm16": "pcm16", "wav": "wav", "flac": "flac"}
MEDIA_TYPES = {"wav": "audio/wav", "pcm16": "audio/pcm", "flac": "audio/flac"}
FLAC_BLOCK_SIZE = 4096


def normalize_format(name: str) -> str:
    """Canonical format name ("pcm" is accepted for "pcm16"); ValueError for anything unsupported."""
    fmt = _ALIASES.get(str(name).lower())
    if fmt is None:
        raise ValueError(f"unsupported audio format {name!r}; supported: wav, pcm16 (pcm), flac")
    return fmt


def to_int16(audio: torch.Tensor | np.ndarray) -> np.ndarray:
    """Float samples in [-1, 1] -> int16 (clipped, rounded)."""
    if isinstance(audio, torch.Tensor):
        audio = audio.detach().to(torch.float32).cpu().numpy()
    x = np.clip(np.asarray(audio, dtype=np.float32).reshape(-1), -1.0, 1.0)
    return np.round(x * 32767.0).astype(np.int16)


def pcm16_bytes(samples: np.ndarray) -> bytes:
    return np.asarray(samples, dtype="<i2").tobytes()


def wav_header(num_samples: int | None, sample_rate: int) -> bytes:
    """44-byte RIFF header for mono int16; ``num_samples=None`` writes the streaming placeholder sizes."""
    data_bytes = 0xFFFFFFFF - 36 if num_samples is None else 2 * num_samples
    riff_size = 0xFFFFFFFF if num_samples is None else 36 + data_bytes
    return (
        b"RIFF" + struct.pack("<I", riff_size) + b"WAVE"
        + b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
        + b"data" + struct.pack("<I", data_bytes)
    )


def encode_wav(samples: np.ndarray, sample_rate: int) -> bytes:
    return wav_header(len(samples), sample_rate) + pcm16_bytes(samples)


def encode(audio: torch.Tensor | np.ndarray, fmt: str, sample_rate: int) -> bytes:
    """Float waveform -> bytes in ``fmt`` (wav / pcm16 / flac)."""
    samples = to_int16(audio)
    fmt = normalize_format(fmt)
    if fmt == "wav":
        return encode_wav(samples, sample_rate)
    if fmt == "flac":
        return encode_flac(samples, sample_rate)
    return pcm16_bytes(samples)


# ---- FLAC ------------------------------------------------------------------------------------------
def _crc_table(poly: int, width: int) -> list[int]:
    top, mask = 1 << (width - 1), (1 << width) - 1
    table = []
    for byte in range(256):
        crc = byte << (width - 8)
        for _ in range(8):
            crc = ((crc << 1) ^ poly) if crc & top else (crc << 1)
        table.append(crc & mask)
    return table


_CRC8 = _crc_table(0x07, 8)
_CRC16 = _crc_table(0x8005, 16)


def _crc8(data: bytes) -> int:
    crc = 0
    for b in data:
        crc = _CRC8[crc ^ b]
    return crc


def _crc16(data: bytes) -> int:
    crc = 0
    for b in data:
        crc = ((crc << 8) & 0xFFFF) ^ _CRC16[(crc >> 8) ^ b]
    return crc


class _Bits:
    """Big-endian bit writer; pieces are numpy 0/1 arrays so Rice coding stays vectorised."""

    def __init__(self) -> None:
        self.parts: list[np.ndarray] = []
        self.length = 0

    def _add(self, bits: np.ndarray) -> None:
        self.parts.append(bits.astype(np.uint8, copy=False))
        self.length += len(bits)

    def uint(self, value: int, width: int) -> None:
        if width:
            self._add((np.int64(value) >> np.arange(width - 1, -1, -1, dtype=np.int64)) & 1)

    def ints(self, values: np.ndarray, width: int) -> None:
        """Two's-complement values, each ``width`` bits."""
        v = np.asarray(values, dtype=np.int64) & ((1 << width) - 1)
        self._add(((v[:, None] >> np.arange(width - 1, -1, -1, dtype=np.int64)) & 1).reshape(-1))

    def rice(self, residual: np.ndarray, k: int) -> None:
        u = np.where(residual >= 0, residual << 1, ((-residual) << 1) - 1)  # zig-zag fold
        q = u >> k
        widths = q + 1 + k
        starts = np.concatenate(([0], np.cumsum(widths)[:-1]))
        out = np.zeros(int(widths.sum()), dtype=np.uint8)
        out[starts + q] = 1  # unary quotient: q zeros then a one
        if k:
            rem = (u[:, None] >> np.arange(k - 1, -1, -1, dtype=np.int64)) & 1
            out[(starts + q + 1)[:, None] + np.arange(k)] = rem
        self._add(out)

    def align(self) -> None:
        if self.length % 8:
            self._add(np.zeros(8 - self.length % 8, dtype=np.uint8))

    def tobytes(self) -> bytes:
        self.align()
        return np.packbits(np.concatenate(self.parts) if self.parts else np.zeros(0, np.uint8)).tobytes()


def _utf8_number(n: int) -> bytes:
    """FLAC's UTF-8-style coding of the frame number."""
    if n < 0x80:
        return bytes([n])
    payload = []
    while True:
        payload.append(0x80 | (n & 0x3F))
        n >>= 6
        nbytes = len(payload) + 1
        if n < (1 << (7 - nbytes)):
            lead = (0xFF << (8 - nbytes)) & 0xFF
            return bytes([lead | n]) + bytes(reversed(payload))


def _best_rice_param(u_sum_by_k: np.ndarray, n: int) -> tuple[int, int]:
    costs = u_sum_by_k + n * (1 + np.arange(len(u_sum_by_k)))
    k = int(np.argmin(costs))
    return k, int(costs[k])


def _encode_subframe(bits: _Bits, x: np.ndarray) -> None:
    n = len(x)
    if n and (x == x[0]).all():  # e.g. silence: one value for the whole block
        bits.uint(0, 8)
        bits.ints(x[:1], 16)
        return
    best: tuple[int, int, int, np.ndarray] | None = None  # (cost, order, k, residual)
    for order in range(min(4, n - 1) + 1):
        residual = np.diff(x, n=order) if order else x
        u = np.where(residual >= 0, residual << 1, ((-residual) << 1) - 1)
        sums = np.array([int((u >> k).sum()) for k in range(15)], dtype=np.int64)
        k, cost = _best_rice_param(sums, len(residual))
        cost += 16 * order + 10
        if best is None or cost < best[0]:
            best = (cost, order, k, residual)
    assert best is not None
    cost, order, k, residual = best
    if cost >= 16 * n:  # incompressible: store verbatim
        bits.uint(0b00000010, 8)
        bits.ints(x, 16)
        return
    bits.uint(0, 1)
    bits.uint(0b001000 | order, 6)
    bits.uint(0, 1)  # no wasted bits
    bits.ints(x[:order], 16)
    bits.uint(0, 2)  # Rice coding, 4-bit parameter
    bits.uint(0, 4)  # partition order 0
    bits.uint(k, 4)
    bits.rice(residual, k)


def _encode_frame(index: int, x: np.ndarray, rate_code: int) -> bytes:
    header = _Bits()
    header.uint(0b11111111111110, 14)
    header.uint(0, 1)
    header.uint(0, 1)  # fixed block size
    header.uint(0b0111, 4)  # block size - 1 follows as 16 bits
    header.uint(rate_code, 4)
    header.uint(0, 4)  # mono
    header.uint(0b100, 3)  # 16 bits per sample
    header.uint(0, 1)
    head = header.tobytes() + _utf8_number(index) + struct.pack(">H", len(x) - 1)
    head += bytes([_crc8(head)])
    body = _Bits()
    _encode_subframe(body, x.astype(np.int64))
    frame = head + body.tobytes()
    return frame + struct.pack(">H", _crc16(frame))


def encode_flac(samples: np.ndarray, sample_rate: int) -> bytes:
    """int16 mono samples -> a complete FLAC file (no samples -> one silent sample, see the module doc)."""
    x = np.asarray(samples, dtype=np.int16).reshape(-1)
    if len(x) == 0:
        x = np.zeros(1, dtype=np.int16)
    n = len(x)
    if not 0 < sample_rate < (1 << 20):
        raise ValueError(f"sample rate {sample_rate} cannot be stored in FLAC")
    block = FLAC_BLOCK_SIZE if n >= FLAC_BLOCK_SIZE else max(n, 16)
    info = _Bits()
    info.uint(block, 16)
    info.uint(block, 16)
    info.uint(0, 24)  # min/max frame size unknown
    info.uint(0, 24)
    info.uint(sample_rate, 20)
    info.uint(0, 3)  # channels - 1
    info.uint(15, 5)  # bits per sample - 1
    info.uint(n, 36)
    streaminfo = info.tobytes() + hashlib.md5(x.astype("<i2").tobytes()).digest()
    out = [b"fLaC", bytes([0x80]) + struct.pack(">I", len(streaminfo))[1:], streaminfo]
    rate_code = {24000: 0b0111, 48000: 0b1010, 16000: 0b0101, 44100: 0b1001}.get(sample_rate, 0)
    for i, start in enumerate(range(0, n, FLAC_BLOCK_SIZE)):
        out.append(_encode_frame(i, x[start:start + FLAC_BLOCK_SIZE], rate_code))
    return b"".join(out)
