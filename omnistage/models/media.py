"""Decode user media into plain arrays: audio as float32 mono at a target rate, images as RGB PIL images,
videos as uint8 frames [T, H, W, 3] with their frame rate (and the audio track when asked).

Audio files (wav, flac, mp3, ogg, ...) are read with soundfile and resampled with soxr; containers soundfile
cannot read (m4a, video files) go through PyAV. A bare audio array is taken to be at the target rate already
(as transformers' processors do); pass ``(array, sample_rate)`` otherwise.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

AUDIO_RATE = 16000
# Frames sampled per second from a video file when the caller gives no rate, and the most frames kept
# (qwen-omni-utils' defaults).
DEFAULT_VIDEO_FPS = 2.0
MAX_VIDEO_FRAMES = 768


class MediaError(ValueError):
    """A media input that cannot be decoded or has the wrong shape; the message says which and why."""


def _is_source(x: Any) -> bool:
    return isinstance(x, (str, Path, bytes, bytearray))


def _open(src: str | Path | bytes | bytearray):
    if isinstance(src, (bytes, bytearray)):
        return io.BytesIO(bytes(src))
    path = Path(src)
    if not path.is_file():
        raise MediaError(f"no such file: {src}")
    return path


def resample(audio: np.ndarray, rate: int, target: int = AUDIO_RATE) -> np.ndarray:
    audio = np.asarray(audio, dtype=np.float32)
    if rate == target:
        return audio
    import soxr

    return soxr.resample(audio, rate, target, quality="HQ").astype(np.float32, copy=False)


def _mono(audio: np.ndarray) -> np.ndarray:
    if audio.ndim == 1:
        return audio
    if audio.ndim == 2:  # soundfile gives [samples, channels]
        return audio.mean(axis=1)
    raise MediaError(f"audio must be 1-D samples (or [samples, channels]), got shape {audio.shape}")


def load_audio(src: Any, target_rate: int = AUDIO_RATE) -> np.ndarray:
    """float32 mono samples at ``target_rate`` from an array (taken at ``target_rate``), ``(array, rate)``,
    a file path or the file's bytes."""
    if isinstance(src, tuple):
        if len(src) != 2:
            raise MediaError("an audio tuple must be (samples, sample_rate)")
        samples, rate = src
        if not isinstance(rate, (int, np.integer)) or rate <= 0:
            raise MediaError(f"sample rate must be a positive int, got {rate!r}")
        audio = _mono(np.asarray(_to_numpy(samples), dtype=np.float32))
        return resample(audio, int(rate), target_rate)
    if _is_source(src):
        audio, rate = _decode_audio_file(src)
        return resample(audio, rate, target_rate)
    audio = _mono(np.asarray(_to_numpy(src), dtype=np.float32))
    if audio.size == 0:
        raise MediaError("audio is empty")
    return audio


def _to_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # torch tensor
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _decode_audio_file(src: str | Path | bytes | bytearray) -> tuple[np.ndarray, int]:
    import soundfile

    handle = _open(src)
    try:
        audio, rate = soundfile.read(handle, dtype="float32", always_2d=True)
    except Exception:  # formats libsndfile does not read (m4a, aac, video containers): FFmpeg via PyAV
        if isinstance(handle, io.BytesIO):
            handle.seek(0)
        decoded = _decode_audio_stream(handle)
        if decoded is None:
            raise MediaError(f"cannot decode audio from {_name(src)}") from None
        return decoded
    if audio.size == 0:
        raise MediaError(f"{_name(src)} holds no audio samples")
    return audio.mean(axis=1), int(rate)


def _name(src: Any) -> str:
    return "the given bytes" if isinstance(src, (bytes, bytearray)) else str(src)


def _decode_audio_stream(handle) -> tuple[np.ndarray, int] | None:
    """Mono float32 samples and rate of the first audio stream of a container, None if it has none."""
    import av

    try:
        with av.open(handle) as container:
            if not container.streams.audio:
                return None
            stream = container.streams.audio[0]
            rate = stream.codec_context.sample_rate
            resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
            chunks = []
            for frame in container.decode(stream):
                for out in resampler.resample(frame):
                    chunks.append(out.to_ndarray().reshape(-1))
            for out in resampler.resample(None):
                chunks.append(out.to_ndarray().reshape(-1))
    except av.error.FFmpegError as e:
        raise MediaError(f"cannot decode media: {e}") from None
    if not chunks:
        return None
    return np.concatenate(chunks).astype(np.float32, copy=False), int(rate)


def load_image(src: Any):
    """An RGB PIL image from a PIL image, a uint8 array [H, W, 3] (or [H, W]), a file path or the file's bytes."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(src, Image.Image):
        image = src
    elif _is_source(src):
        try:
            image = Image.open(_open(src))
            image.load()
        except (UnidentifiedImageError, OSError) as e:
            raise MediaError(f"cannot decode image from {_name(src)}: {e}") from None
    else:
        arr = _to_numpy(src)
        if arr.dtype != np.uint8 or arr.ndim not in (2, 3) or (arr.ndim == 3 and arr.shape[2] not in (3, 4)):
            raise MediaError(f"an image array must be uint8 [H, W, 3], got {arr.dtype} {arr.shape}")
        image = Image.fromarray(arr)
    return image.convert("RGB")


@dataclass(frozen=True)
class Video:
    frames: np.ndarray  # uint8 [T, H, W, 3]
    fps: float  # frames per second the frames represent
    audio: np.ndarray | None = None  # float32 mono (the video's own track), if loaded


def load_video(
    src: Any, fps: float | None = None, with_audio: bool = False, audio: Any = None, audio_rate: int = AUDIO_RATE
) -> Video:
    """Frames from a uint8 array [T, H, W, 3] (``fps`` = its frame rate, default 1) or from a file, sampled
    at ``fps`` frames per second (default 2). ``with_audio`` also loads the file's audio track at
    ``audio_rate``; for frame arrays pass the track as ``audio`` (anything ``load_audio`` takes)."""
    if fps is not None and (not isinstance(fps, (int, float)) or fps <= 0):
        raise MediaError(f"video fps must be a positive number, got {fps!r}")
    track = load_audio(audio, audio_rate) if audio is not None else None
    if _is_source(src):
        frames, rate = _decode_video_file(src, fps if fps is not None else DEFAULT_VIDEO_FPS)
        if with_audio and track is None:
            handle = _open(src)
            decoded = _decode_audio_stream(handle)
            track = None if decoded is None else resample(*decoded, audio_rate)
        return Video(frames, rate, track)
    frames = src
    if isinstance(frames, (list, tuple)):
        frames = np.stack([np.asarray(load_image(f)) for f in frames])
    frames = _to_numpy(frames)
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3 or frames.shape[0] == 0:
        raise MediaError(f"video frames must be uint8 [T, H, W, 3], got {frames.dtype} {frames.shape}")
    return Video(np.ascontiguousarray(frames), float(fps) if fps is not None else 1.0, track)


def _decode_video_file(src: str | Path | bytes | bytearray, fps: float) -> tuple[np.ndarray, float]:
    """Frames sampled uniformly at about ``fps`` per second; returns (frames, the rate they represent)."""
    import av

    try:
        with av.open(_open(src)) as container:
            if not container.streams.video:
                raise MediaError(f"{_name(src)} has no video stream")
            stream = container.streams.video[0]
            frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
            rate = stream.average_rate or stream.guessed_rate or Fraction(1)
    except av.error.FFmpegError as e:
        raise MediaError(f"cannot decode video from {_name(src)}: {e}") from None
    if not frames:
        raise MediaError(f"{_name(src)} holds no video frames")
    native = float(rate)
    total = len(frames)
    duration = total / native
    count = max(1, min(total, MAX_VIDEO_FRAMES, round(duration * fps)))
    # Evenly spaced frame indices; the sampled frames then stand for count / duration frames per second.
    index = np.linspace(0, total - 1, count).round().astype(int)
    return np.stack([frames[i] for i in index]), count / duration
