"""Media content parts of API requests (``input_audio``, ``image_url``, ``audio_url``, ``video_url``) ->
decoded media in the chat-template part style the engine takes, within per-request limits.

Two phases, both in the server's preprocessing threads: ``MediaReader.read`` checks a part without decoding it
(data URL syntax and media type, base64 size before decoding it, local paths strictly inside the allowed
directory, file sizes before reading them, the item count) and returns its bytes; ``MediaReader.decode`` then
decodes them with ``models.media`` under ``DecodeLimits`` (seconds, pixels, frames checked from the header
first, then while decoding). Every refusal is a ``MediaRejection`` naming the part (``messages.1.content.2``).
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from omnistage.core.validation import check_positive_int
from omnistage.models.media import (
    AUDIO_RATE,
    DecodeLimits,
    MediaError,
    MediaLimitError,
    load_audio,
    load_image,
    load_video,
)

# Part type -> (kind of media, the field holding it). ``input_audio`` carries base64 data and a format;
# the ``*_url`` parts carry a data URL (or a local file under the allowed directory).
PART_KINDS = {"input_audio": "audio", "image_url": "image", "audio_url": "audio", "video_url": "video"}
# Container formats ``input_audio.format`` may name (decoding goes by the bytes, not by this name).
INPUT_AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg", "opus", "webm", "m4a", "aac", "mp4")
_DATA_URL_HEADER_CHARS = 256  # where the comma of "data:<media type>[;params];base64," must appear
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]{1,15}):")  # a URL's scheme (two letters at least: not "C:")

# What a request may carry by default (see ``MediaLimits``).
DEFAULT_MAX_ITEMS = 16
DEFAULT_MAX_BYTES = 8 << 20
DEFAULT_MAX_AUDIO_SECONDS = 300.0
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096
DEFAULT_MAX_VIDEO_SECONDS = 60.0
DEFAULT_MAX_VIDEO_FRAMES = 1800
DEFAULT_MAX_VIDEO_PIXELS = 1 << 27  # 384 MiB as RGB: 60 s of 720p, or 32 s of 1080p, at 2 frames per second


@dataclass(frozen=True)
class MediaLimits:
    """Per-request bounds on media input, and where local files may be read from.

    ``max_items``: media parts per request; ``max_bytes``: encoded media bytes per request, all parts together
    (base64-decoded data URLs plus files read); ``max_audio_seconds``: audio per request, all clips and video
    tracks together; ``max_image_pixels``: per image and per video frame; ``max_video_seconds``,
    ``max_video_frames`` (frames decoded from the file, before sampling) and ``max_video_pixels`` (all frames
    sampled from it together: their memory): per video. ``allowed_dir``: local
    files (plain paths, relative ones taken from this directory, and ``file://`` URLs) are read only when
    set, and only when they resolve, symlinks followed, strictly inside it; None = no local files."""

    max_items: int = DEFAULT_MAX_ITEMS
    max_bytes: int = DEFAULT_MAX_BYTES
    max_audio_seconds: float = DEFAULT_MAX_AUDIO_SECONDS
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_video_seconds: float = DEFAULT_MAX_VIDEO_SECONDS
    max_video_frames: int = DEFAULT_MAX_VIDEO_FRAMES
    max_video_pixels: int = DEFAULT_MAX_VIDEO_PIXELS
    allowed_dir: str | None = None

    def __post_init__(self) -> None:
        for name in ("max_items", "max_bytes", "max_image_pixels", "max_video_frames", "max_video_pixels"):
            check_positive_int(getattr(self, name), name)
        for name in ("max_audio_seconds", "max_video_seconds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a positive finite number, got {value!r}")
        if self.allowed_dir is not None and not Path(self.allowed_dir).is_dir():
            raise ValueError(f"allowed_dir {self.allowed_dir!r} is not a directory")

    @property
    def base64_bytes(self) -> int:
        """Size of ``max_bytes`` as base64 text (what a request body carries for it)."""
        return 4 * -(-self.max_bytes // 3)


class MediaRejection(ValueError):
    """A media part refused: ``where`` is the part (``messages.1.content.2``), ``code`` the API error code
    (``invalid_media``, ``media_limit_exceeded``, ``media_url_not_allowed``)."""

    def __init__(self, where: str, message: str, code: str) -> None:
        super().__init__(f"content part {where}: {message}")
        self.where, self.code = where, code


@dataclass
class MediaBytes:
    """One media part, checked and read but not decoded."""

    where: str
    kind: str  # audio | image | video
    data: bytes


@dataclass
class MediaBudget:
    """What is left of one request's limits (``MediaReader.budget()`` starts one per request)."""

    items: int
    bytes: int
    audio_seconds: float


class MediaReader:
    """Reads and decodes media parts against the limits; ``budget()`` starts a request's account (the reader
    itself holds no per-request state, so the preprocessing threads share one)."""

    def __init__(self, limits: MediaLimits) -> None:
        self.limits = limits
        self.allowed = Path(limits.allowed_dir).resolve(strict=True) if limits.allowed_dir is not None else None

    def budget(self) -> MediaBudget:
        lim = self.limits
        return MediaBudget(lim.max_items, lim.max_bytes, lim.max_audio_seconds)

    # ---- phase 1: check and read, no decoding -------------------------------------------------------
    def read(self, budget: MediaBudget, where: str, part_type: str, body: Any) -> MediaBytes:
        """``body``: the part's ``input_audio`` ({data, format}) or ``*_url`` ({url}) object (pydantic)."""
        kind = PART_KINDS[part_type]
        if budget.items == 0:
            raise MediaRejection(where, f"a request may hold at most {self.limits.max_items} media parts",
                                 "media_limit_exceeded")
        budget.items -= 1
        if part_type == "input_audio":
            if body.format.lower() not in INPUT_AUDIO_FORMATS:
                raise MediaRejection(where, f"unknown input_audio format {body.format!r}; supported: "
                                            f"{list(INPUT_AUDIO_FORMATS)}", "invalid_media")
            data = self._base64(where, body.data, budget)
        else:
            data = self._url(where, kind, body.url, budget)
        return MediaBytes(where, kind, data)

    def _take_bytes(self, where: str, size: int, budget: MediaBudget) -> None:
        if size > budget.bytes:
            raise MediaRejection(where, f"the media holds {size} bytes, more than the {budget.bytes} bytes left of "
                                        f"this request's limit of {self.limits.max_bytes}", "media_limit_exceeded")
        budget.bytes -= size

    def _base64(self, where: str, text: str, budget: MediaBudget) -> bytes:
        size = len(text) // 4 * 3 - (text.endswith("=") + text.endswith("=="))
        self._take_bytes(where, max(size, 0), budget)  # before decoding anything
        try:
            data = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise MediaRejection(where, f"the data is not valid base64: {exc}", "invalid_media") from None
        if not data:
            raise MediaRejection(where, "the data is empty", "invalid_media")
        return data

    def _url(self, where: str, kind: str, url: str, budget: MediaBudget) -> bytes:
        if url[:5].lower() == "data:":
            head, comma, _ = url[:_DATA_URL_HEADER_CHARS].partition(",")
            params = head[5:].split(";")
            media_type = params[0].strip().lower()
            if not comma or params[-1].strip().lower() != "base64":
                raise MediaRejection(where, "a data URL must read data:<media type>;base64,<data>", "invalid_media")
            if not media_type.startswith(f"{kind}/"):
                raise MediaRejection(where, f"the data URL's media type {media_type or '(none)'!r} is not {kind}/*",
                                     "invalid_media")
            return self._base64(where, url[len(head) + 1 :], budget)
        match = _SCHEME.match(url)
        scheme = match[1].lower() if match else ""
        if scheme in ("http", "https"):
            raise MediaRejection(where, "this server does not fetch URLs: send the media inline as a data: URL "
                                        "(data:<media type>;base64,<data>)", "media_url_not_allowed")
        if scheme not in ("", "file"):
            raise MediaRejection(where, f"unsupported URL scheme {scheme!r}: send the media as a data: URL",
                                 "media_url_not_allowed")
        if self.allowed is None:
            raise MediaRejection(where, "this server reads no local files: send the media as a data: URL (a server "
                                        "started with --allowed-media-dir reads files under that directory)",
                                 "media_url_not_allowed")
        if scheme == "file":
            try:
                parts = urlsplit(url)
            except ValueError as exc:
                raise MediaRejection(where, f"not a valid file URL: {exc}", "invalid_media") from None
            if parts.netloc not in ("", "localhost"):
                raise MediaRejection(where, f"file URL host {parts.netloc!r} is not this machine",
                                     "media_url_not_allowed")
            path = unquote(parts.path)
        else:
            path = url
        return self._file(where, path, budget)

    def _file(self, where: str, path: str, budget: MediaBudget) -> bytes:
        """A file strictly inside the allowed directory: lexically first (so nothing is said about files
        outside it), then with symlinks resolved, then as opened (a path swapped after the check)."""
        outside = MediaRejection(where, f"{path!r} is not inside the allowed media directory", "media_url_not_allowed")
        if "\x00" in path:
            raise outside
        lexical = Path(os.path.normpath(self.allowed / path))  # an absolute path replaces the base
        if not lexical.is_relative_to(self.allowed):
            raise outside
        try:
            real = lexical.resolve(strict=True)
        except (OSError, RuntimeError):
            raise MediaRejection(where, f"no file {path!r} in the allowed media directory", "invalid_media") from None
        if not real.is_relative_to(self.allowed):
            raise outside
        try:  # O_NONBLOCK: a FIFO must not hang the thread; it is refused below as not a regular file
            fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise MediaRejection(where, f"cannot open {path!r}: {exc.strerror}", "invalid_media") from None
        try:
            opened = Path(f"/proc/self/fd/{fd}")
            if opened.exists() and not Path(os.readlink(opened)).is_relative_to(self.allowed):
                raise outside
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise MediaRejection(where, f"{path!r} is not a regular file", "invalid_media")
            self._take_bytes(where, st.st_size, budget)
            data = _read_at_most(fd, st.st_size + 1)
        finally:
            os.close(fd)
        if len(data) > st.st_size:  # it grew after the size was checked
            raise MediaRejection(where, f"{path!r} changed while it was read", "invalid_media")
        if not data:
            raise MediaRejection(where, f"{path!r} is empty", "invalid_media")
        return data

    # ---- phase 2: decode ---------------------------------------------------------------------------
    def decode(self, budget: MediaBudget, item: MediaBytes, use_audio_in_video: bool, fps: float | None) -> dict:
        """The part as the engine's chat messages take it (decoded arrays, images, frames)."""
        lim = self.limits
        limits = DecodeLimits(max_audio_seconds=budget.audio_seconds, max_image_pixels=lim.max_image_pixels,
                              max_video_seconds=lim.max_video_seconds, max_video_frames=lim.max_video_frames,
                              max_video_pixels=lim.max_video_pixels)
        try:
            if item.kind == "audio":
                audio = load_audio(item.data, AUDIO_RATE, limits)
                self._spend_audio(budget, audio.shape[0])
                return {"type": "audio", "audio": audio}
            if item.kind == "image":
                return {"type": "image", "image": load_image(item.data, limits)}
            video = load_video(item.data, fps, with_audio=use_audio_in_video, limits=limits)
        except MediaLimitError as exc:
            message = str(exc)
            if exc.bound == "max_audio_seconds" and budget.audio_seconds < lim.max_audio_seconds:
                message += f" (what is left of this request's {lim.max_audio_seconds:g} s of audio)"
            raise MediaRejection(item.where, message, "media_limit_exceeded") from None
        except MediaError as exc:
            reason = str(exc)
            if reason.startswith("cannot decode"):  # the decoder's own reason, if it gave one
                reason = reason.partition(": ")[2] or "not a format this server decodes"
            raise MediaRejection(item.where, f"cannot decode the {item.kind}: {reason}", "invalid_media") from None
        part = {"type": "video", "video": video.frames, "fps": video.fps}
        if use_audio_in_video:
            if video.audio is None:
                raise MediaRejection(item.where, "use_audio_in_video needs the video's audio track, and it has none",
                                     "invalid_media")
            self._spend_audio(budget, video.audio.shape[0])
            part["audio"] = video.audio
        return part

    @staticmethod
    def _spend_audio(budget: MediaBudget, samples: int) -> None:
        budget.audio_seconds = max(budget.audio_seconds - samples / AUDIO_RATE, 0.0)


def _read_at_most(fd: int, n: int) -> bytes:
    chunks = []
    while n > 0 and (chunk := os.read(fd, n)):
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)
