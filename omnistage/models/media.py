"""Decode user media into plain arrays: audio as float32 mono at a target rate, images as RGB PIL images,
videos as uint8 frames [T, H, W, 3] with their frame rate (and the audio track when asked).

Audio files (wav, flac, mp3, ogg, ...) are read with soundfile and resampled with soxr; containers soundfile
cannot read (m4a, video files) go through PyAV. A bare audio array is taken to be at the target rate already
(as transformers' processors do); pass ``(array, sample_rate)`` otherwise.

``DecodeLimits`` bound what decoding may produce (for inputs from untrusted clients): each bound is checked
from the file's header before decoding where the format states it, and again while decoding (a header can
lie), so an oversized input costs at most the limit's worth of work. A video file is decoded twice (count,
then convert only the sampled frames into one preallocated array), so memory holds the sampled frames only.
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


class MediaLimitError(MediaError):
    """A media input larger than a bound of its ``DecodeLimits``; ``bound`` names the field."""

    def __init__(self, message: str, bound: str) -> None:
        super().__init__(message)
        self.bound = bound


@dataclass(frozen=True)
class DecodeLimits:
    """Bounds on decoded media; None = unbounded."""

    max_audio_seconds: float | None = None  # an audio input, or a video's audio track
    max_image_pixels: int | None = None  # an image, or one video frame
    max_video_seconds: float | None = None
    max_video_frames: int | None = None  # frames decoded from a video file (before sampling)
    max_video_pixels: int | None = None  # all sampled frames of a video together (3 bytes each as RGB)


NO_LIMITS = DecodeLimits()
_UNKNOWN_FRAMES = 1 << 62  # libsndfile's frame count of a stream whose length it cannot tell


def _check_seconds(seconds: float, limits: DecodeLimits, what: str) -> None:
    bound = f"max_{what}_seconds"
    limit = getattr(limits, bound)
    if limit is not None and seconds > limit:
        raise MediaLimitError(f"the {what} lasts {seconds:.2f} s; at most {limit:g} s are allowed", bound)


def _check_pixels(width: int, height: int, limits: DecodeLimits, what: str) -> None:
    limit = limits.max_image_pixels
    if limit is not None and width * height > limit:
        raise MediaLimitError(f"{what} has {width}x{height} = {width * height} pixels; at most {limit} are allowed",
                              "max_image_pixels")


def _declared_seconds(container, stream) -> float | None:
    """The duration a container's header states for ``stream`` (else for the whole file), if any."""
    import av

    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / av.time_base
    return None


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


def load_audio(src: Any, target_rate: int = AUDIO_RATE, limits: DecodeLimits = NO_LIMITS) -> np.ndarray:
    """float32 mono samples at ``target_rate`` from an array (taken at ``target_rate``), ``(array, rate)``,
    a file path or the file's bytes."""
    if isinstance(src, tuple):
        if len(src) != 2:
            raise MediaError("an audio tuple must be (samples, sample_rate)")
        samples, rate = src
        if not isinstance(rate, (int, np.integer)) or rate <= 0:
            raise MediaError(f"sample rate must be a positive int, got {rate!r}")
        audio = _mono(np.asarray(_to_numpy(samples), dtype=np.float32))
        _check_seconds(audio.shape[0] / rate, limits, "audio")
        return resample(audio, int(rate), target_rate)
    if _is_source(src):
        audio, rate = _decode_audio_file(src, limits)
        return resample(audio, rate, target_rate)
    audio = _mono(np.asarray(_to_numpy(src), dtype=np.float32))
    if audio.size == 0:
        raise MediaError("audio is empty")
    _check_seconds(audio.shape[0] / target_rate, limits, "audio")
    return audio


def _to_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # torch tensor
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _decode_audio_file(
    src: str | Path | bytes | bytearray, limits: DecodeLimits = NO_LIMITS
) -> tuple[np.ndarray, int]:
    import soundfile

    handle = _open(src)
    try:
        with soundfile.SoundFile(handle) as f:
            rate = int(f.samplerate)
            if 0 < f.frames < _UNKNOWN_FRAMES:  # the header's length, before decoding
                _check_seconds(f.frames / rate, limits, "audio")
            # At most one frame more than allowed is decoded, whatever the header said.
            most = limits.max_audio_seconds
            audio = f.read(-1 if most is None else int(most * rate) + 1, dtype="float32", always_2d=True)
    except MediaLimitError:
        raise
    except Exception:  # formats libsndfile does not read (m4a, aac, video containers): FFmpeg via PyAV
        if isinstance(handle, io.BytesIO):
            handle.seek(0)
        decoded = _decode_audio_stream(handle, limits)
        if decoded is None:
            raise MediaError(f"cannot decode audio from {_name(src)}") from None
        return decoded
    if audio.size == 0:
        raise MediaError(f"{_name(src)} holds no audio samples")
    _check_seconds(audio.shape[0] / rate, limits, "audio")
    return audio.mean(axis=1), rate


def _ffmpeg_reason(e: Exception) -> str:
    """FFmpeg's reason without the errno and the '<none>' file name PyAV adds for in-memory files."""
    return getattr(e, "strerror", None) or str(e)


def _name(src: Any) -> str:
    return "the given bytes" if isinstance(src, (bytes, bytearray)) else str(src)


def _decode_audio_stream(handle, limits: DecodeLimits = NO_LIMITS) -> tuple[np.ndarray, int] | None:
    """Mono float32 samples and rate of the first audio stream of a container, None if it has none."""
    import av

    try:
        with av.open(handle) as container:
            if not container.streams.audio:
                return None
            stream = container.streams.audio[0]
            rate = stream.codec_context.sample_rate
            declared = _declared_seconds(container, stream)
            if declared is not None:
                _check_seconds(declared, limits, "audio")
            resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
            chunks = []
            count = 0
            for frame in container.decode(stream):
                for out in resampler.resample(frame):
                    chunks.append(out.to_ndarray().reshape(-1))
                    count += chunks[-1].shape[0]
                _check_seconds(count / rate, limits, "audio")
            for out in resampler.resample(None):
                chunks.append(out.to_ndarray().reshape(-1))
    except av.error.FFmpegError as e:
        raise MediaError(f"cannot decode media: {_ffmpeg_reason(e)}") from None
    if not chunks:
        return None
    return np.concatenate(chunks).astype(np.float32, copy=False), int(rate)


def load_image(src: Any, limits: DecodeLimits = NO_LIMITS):
    """An RGB PIL image from a PIL image, a uint8 array [H, W, 3] (or [H, W]), a file path or the file's bytes."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(src, Image.Image):
        image = src
    elif _is_source(src):
        try:
            image = Image.open(_open(src))  # reads the header only
            _check_pixels(*image.size, limits, "the image")
            image.load()
        except Image.DecompressionBombError as e:
            raise MediaLimitError(str(e), "max_image_pixels") from None
        except UnidentifiedImageError:
            raise MediaError(f"cannot decode image from {_name(src)}: not an image format PIL reads") from None
        except OSError as e:
            raise MediaError(f"cannot decode image from {_name(src)}: {e}") from None
    else:
        arr = _to_numpy(src)
        if arr.dtype != np.uint8 or arr.ndim not in (2, 3) or (arr.ndim == 3 and arr.shape[2] not in (3, 4)):
            raise MediaError(f"an image array must be uint8 [H, W, 3], got {arr.dtype} {arr.shape}")
        image = Image.fromarray(arr)
    _check_pixels(*image.size, limits, "the image")
    return image.convert("RGB")


@dataclass(frozen=True)
class Video:
    frames: np.ndarray  # uint8 [T, H, W, 3]
    fps: float  # frames per second the frames represent
    audio: np.ndarray | None = None  # float32 mono (the video's own track), if loaded


def load_video(
    src: Any, fps: float | None = None, with_audio: bool = False, audio: Any = None, audio_rate: int = AUDIO_RATE,
    limits: DecodeLimits = NO_LIMITS,
) -> Video:
    """Frames from a uint8 array [T, H, W, 3] (``fps`` = its frame rate, default 1) or from a file, sampled
    at ``fps`` frames per second (default 2). ``with_audio`` also loads the file's audio track at
    ``audio_rate``; for frame arrays pass the track as ``audio`` (anything ``load_audio`` takes)."""
    if fps is not None and (not isinstance(fps, (int, float)) or fps <= 0):
        raise MediaError(f"video fps must be a positive number, got {fps!r}")
    track = load_audio(audio, audio_rate, limits) if audio is not None else None
    if _is_source(src):
        frames, rate = _decode_video_file(src, fps if fps is not None else DEFAULT_VIDEO_FPS, limits)
        if with_audio and track is None:
            handle = _open(src)
            decoded = _decode_audio_stream(handle, limits)
            track = None if decoded is None else resample(*decoded, audio_rate)
        return Video(frames, rate, track)
    frames = src
    if isinstance(frames, (list, tuple)):
        frames = np.stack([np.asarray(load_image(f)) for f in frames])
    frames = _to_numpy(frames)
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3 or frames.shape[0] == 0:
        raise MediaError(f"video frames must be uint8 [T, H, W, 3], got {frames.dtype} {frames.shape}")
    return Video(np.ascontiguousarray(frames), float(fps) if fps is not None else 1.0, track)


def _decode_video_file(
    src: str | Path | bytes | bytearray, fps: float, limits: DecodeLimits = NO_LIMITS
) -> tuple[np.ndarray, float]:
    """Frames sampled uniformly at about ``fps`` per second; returns (frames, the rate they represent)."""
    import av

    try:
        total, native, (height, width) = _count_video_frames(src, limits)
        duration = total / native
        _check_seconds(duration, limits, "video")
        count = max(1, min(total, MAX_VIDEO_FRAMES, round(duration * fps)))
        if limits.max_video_pixels is not None and count * height * width > limits.max_video_pixels:
            raise MediaLimitError(f"the {count} frames sampled from the video hold {count * height * width} pixels; "
                                  f"at most {limits.max_video_pixels} are allowed (sample fewer frames per second)",
                                  "max_video_pixels")
        # Evenly spaced frame indices; the sampled frames then stand for count / duration frames per second.
        index = np.linspace(0, total - 1, count).round().astype(int)
        slot = {int(i): k for k, i in enumerate(index)}  # distinct: count <= total
        frames = np.empty((count, height, width, 3), dtype=np.uint8)
        filled = 0
        with av.open(_open(src)) as container:
            for i, frame in enumerate(container.decode(container.streams.video[0])):
                if i in slot:
                    frames[slot[i]] = frame.to_ndarray(format="rgb24")
                    filled += 1
    except av.error.FFmpegError as e:
        raise MediaError(f"cannot decode video from {_name(src)}: {_ffmpeg_reason(e)}") from None
    if filled != count:
        raise MediaError(f"{_name(src)} decoded to fewer frames the second time")
    return frames, count / duration


def _count_video_frames(
    src: str | Path | bytes | bytearray, limits: DecodeLimits
) -> tuple[int, float, tuple[int, int]]:
    """(frames decoded, native frame rate, (height, width) of every frame) of a video file's first video
    stream, within ``limits``."""
    import av

    with av.open(_open(src)) as container:
        if not container.streams.video:
            raise MediaError(f"{_name(src)} has no video stream")
        stream = container.streams.video[0]
        rate = float(stream.average_rate or stream.guessed_rate or Fraction(1))
        cc = stream.codec_context
        _check_pixels(cc.width, cc.height, limits, "a video frame")
        declared = _declared_seconds(container, stream)
        if declared is not None:
            _check_seconds(declared, limits, "video")
        max_frames = limits.max_video_frames
        if max_frames is not None and stream.frames > max_frames:
            raise MediaLimitError(f"the video has {stream.frames} frames; at most {max_frames} are allowed",
                                  "max_video_frames")
        total, size = 0, None
        for frame in container.decode(stream):
            total += 1
            if max_frames is not None and total > max_frames:
                raise MediaLimitError(f"the video has more than {max_frames} frames; at most {max_frames} are allowed",
                                      "max_video_frames")
            if size is None:
                _check_pixels(frame.width, frame.height, limits, "a video frame")
                size = (frame.height, frame.width)
            elif size != (frame.height, frame.width):
                raise MediaError(f"the video's frames change size ({size[1]}x{size[0]} to {frame.width}x{frame.height})")
    if total == 0:
        raise MediaError(f"{_name(src)} holds no video frames")
    return total, rate, size
