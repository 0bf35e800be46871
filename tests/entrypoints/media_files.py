"""Small media files for the server's media tests (seeded, in memory), and how requests carry them."""

from __future__ import annotations

import base64
import io
import tempfile
from pathlib import Path

import numpy as np
import soundfile
from PIL import Image

from omnistage.testing.media_files import write_video

_rng = np.random.default_rng(11)


def noise(seconds: float, rate: int = 16000, channels: int = 1) -> np.ndarray:
    return (_rng.standard_normal((int(seconds * rate), channels)) * 0.1).astype(np.float32)


def audio_file(samples: np.ndarray, rate: int, fmt: str = "WAV") -> bytes:
    buf = io.BytesIO()
    soundfile.write(buf, samples, rate, format=fmt)
    return buf.getvalue()


def image_file(height: int, width: int, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(_rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, format=fmt)
    return buf.getvalue()


def video_file(frames: int, height: int, width: int, fps, track: np.ndarray | None = None) -> bytes:
    """The bytes of a Matroska file (``testing.media_files.write_video``: lossless frames, 16 kHz pcm track)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "clip.mkv"
        write_video(path, _rng.integers(0, 256, (frames, height, width, 3), dtype=np.uint8), fps, track)
        return path.read_bytes()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def data_url(media_type: str, data: bytes) -> str:
    return f"data:{media_type};base64,{b64(data)}"


def input_audio(data: bytes, fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": b64(data), "format": fmt}}


def url_part(kind: str, url: str) -> dict:
    """An ``image_url`` / ``audio_url`` / ``video_url`` part."""
    return {"type": f"{kind}_url", f"{kind}_url": {"url": url}}


def user(*parts: dict | str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]}]


def png_header(width: int, height: int) -> bytes:
    """A PNG that states its size and holds no pixel data: only a decoder that reads it all could tell."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")
