"""Audio encoders: WAV via the stdlib reader, FLAC via an independent minimal decoder written here
(checks CRC-8, CRC-16, STREAMINFO and the MD5) and libsndfile (soundfile, a test dependency)."""

from __future__ import annotations

import hashlib
import io
import wave

import numpy as np
import pytest
import soundfile as sf
import torch

from omnistage.entrypoints.audio_format import (
    encode,
    encode_flac,
    encode_wav,
    normalize_format,
    to_int16,
    wav_header,
)


class _Reader:
    def __init__(self, data: bytes, pos: int = 0) -> None:
        self.data, self.bit = data, pos * 8

    def u(self, n: int) -> int:
        v = 0
        for _ in range(n):
            v = (v << 1) | ((self.data[self.bit >> 3] >> (7 - (self.bit & 7))) & 1)
            self.bit += 1
        return v

    def s(self, n: int) -> int:
        v = self.u(n)
        return v - (1 << n) if v >> (n - 1) else v

    def align(self) -> None:
        self.bit = (self.bit + 7) // 8 * 8


def _crc(data: bytes, poly: int, width: int) -> int:
    crc, top, mask = 0, 1 << (width - 1), (1 << width) - 1
    for b in data:
        crc ^= b << (width - 8)
        for _ in range(8):
            crc = ((crc << 1) ^ poly) & mask if crc & top else (crc << 1) & mask
    return crc


def decode_flac(data: bytes) -> tuple[int, np.ndarray]:
    """Decoder for the subset the encoder writes (mono, 16-bit, fixed/verbatim subframes)."""
    assert data[:4] == b"fLaC"
    r = _Reader(data, 4)
    assert r.u(1) == 1 and r.u(7) == 0  # last block, STREAMINFO
    assert r.u(24) == 34
    r.u(16), r.u(16), r.u(24), r.u(24)
    rate, channels, bps, total = r.u(20), r.u(3) + 1, r.u(5) + 1, r.u(36)
    md5 = data[r.bit // 8 + 0: r.bit // 8 + 16]
    r.bit += 128
    assert (channels, bps) == (1, 16)
    out: list[int] = []
    while r.bit // 8 < len(data):
        start = r.bit // 8
        assert r.u(14) == 0b11111111111110 and r.u(2) == 0
        assert r.u(4) == 0b0111
        r.u(4)
        assert r.u(4) == 0 and r.u(3) == 0b100 and r.u(1) == 0
        first = r.u(8)
        for _ in range(bin(first)[2:].zfill(8).index("0") - 1 if first >= 0xC0 else 0):
            r.u(8)
        n = r.u(16) + 1
        assert r.u(8) == _crc(data[start:r.bit // 8 - 1], 0x07, 8)
        assert r.u(1) == 0
        kind = r.u(6)
        assert r.u(1) == 0
        if kind == 0:
            block = [r.s(16)] * n
        elif kind == 1:
            block = [r.s(16) for _ in range(n)]
        else:
            assert kind & 0b111000 == 0b001000
            order = kind & 7
            block = [r.s(16) for _ in range(order)]
            assert r.u(2) == 0 and r.u(4) == 0
            k = r.u(4)
            res = []
            for _ in range(n - order):
                q = 0
                while r.u(1) == 0:
                    q += 1
                u = (q << k) | r.u(k)
                res.append(u >> 1 if u % 2 == 0 else -((u + 1) >> 1))
            coeffs = {0: [], 1: [1], 2: [2, -1], 3: [3, -3, 1], 4: [4, -6, 4, -1]}[order]
            for e in res:
                block.append(e + sum(c * block[-1 - i] for i, c in enumerate(coeffs)))
        r.align()
        assert r.u(16) == _crc(data[start:r.bit // 8 - 2], 0x8005, 16)
        out.extend(block)
    samples = np.array(out, dtype=np.int16)
    assert len(samples) == total
    assert hashlib.md5(samples.astype("<i2").tobytes()).digest() == md5
    return rate, samples


def _signal(n: int, seed: int = 0) -> np.ndarray:
    g = np.random.default_rng(seed)
    t = np.arange(n) / 24000
    return (np.sin(2 * np.pi * 220 * t) * 15000 + g.normal(0, 200, n)).astype(np.int16)


@pytest.mark.parametrize("n", [1, 3, 17, 4096, 9001])
def test_flac_round_trip(n):
    x = _signal(n)
    rate, y = decode_flac(encode_flac(x, 24000))
    assert rate == 24000
    np.testing.assert_array_equal(y, x)


def test_flac_noise_and_extremes_round_trip():
    g = np.random.default_rng(1)
    x = g.integers(-32768, 32768, 5000).astype(np.int16)  # incompressible -> verbatim
    x[:4] = [-32768, 32767, -32768, 32767]
    np.testing.assert_array_equal(decode_flac(encode_flac(x, 24000))[1], x)
    silence = np.zeros(4500, dtype=np.int16)
    data = encode_flac(silence, 24000)
    assert len(data) < 80  # constant signal compresses to almost nothing
    np.testing.assert_array_equal(decode_flac(data)[1], silence)


def test_flac_decodes_with_libsndfile():
    x = _signal(10000, seed=3)
    y, rate = sf.read(io.BytesIO(encode_flac(x, 24000)), dtype="int16")
    assert rate == 24000
    np.testing.assert_array_equal(y, x)


def test_wav_and_pcm():
    audio = torch.tensor([0.0, 0.5, -0.5, 1.0, -1.0, 2.0, -3.0])
    samples = to_int16(audio)
    assert samples.tolist() == [0, 16384, -16384, 32767, -32767, 32767, -32767]
    with wave.open(io.BytesIO(encode(audio, "wav", 24000))) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth(), w.getnframes()) == (24000, 1, 2, 7)
        assert np.frombuffer(w.readframes(7), dtype="<i2").tolist() == samples.tolist()
    assert encode(audio, "pcm", 24000) == samples.astype("<i2").tobytes()
    assert encode_wav(samples, 24000)[:44] == wav_header(7, 24000)
    assert len(wav_header(None, 24000)) == 44


def test_format_names():
    assert [normalize_format(f) for f in ("WAV", "pcm", "pcm16", "flac")] == ["wav", "pcm16", "pcm16", "flac"]
    for bad in ("mp3", "opus", "aac", ""):
        with pytest.raises(ValueError, match="unsupported audio format"):
            normalize_format(bad)


def test_empty_audio_encodes_to_files_decoders_accept():
    empty = torch.zeros(0)
    data = encode(empty, "wav", 24000)
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getnframes(), w.getframerate(), w.getnchannels(), w.getsampwidth()) == (0, 24000, 1, 2)
    samples, rate = sf.read(io.BytesIO(data), dtype="int16")
    assert rate == 24000 and len(samples) == 0
    # FLAC's STREAMINFO cannot say "0 samples" (0 = unknown; libsndfile then fails): one silent sample.
    data = encode(empty, "flac", 24000)
    samples, rate = sf.read(io.BytesIO(data), dtype="int16")
    assert rate == 24000 and samples.tolist() == [0]
    assert decode_flac(data)[1].tolist() == [0]
    assert encode(empty, "pcm", 24000) == b""
