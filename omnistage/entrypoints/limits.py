"""ServerLimits: what a request may cost before it is admitted (body bytes, prompt characters, media, realtime
sessions, transcripts) and how many preprocessing threads do the work off the event loop."""

from __future__ import annotations

from dataclasses import dataclass

from omnistage.core.validation import check_positive_int
from omnistage.entrypoints.media_input import MediaLimits
from omnistage.entrypoints.realtime.config import RealtimeLimits
from omnistage.entrypoints.speech_to_text import DEFAULT_MAX_TOKENS

PROMPT_CHARS_PER_TOKEN = 16  # default character budget per token of context (real text averages ~4)
BODY_BYTES_PER_PROMPT_CHAR = 12  # an astral character JSON-escaped as a surrogate pair (12 bytes)
BODY_BYTES_EXTRA = 1 << 20


@dataclass(frozen=True)
class ServerLimits:
    """What a request may cost before it is admitted. ``None`` = derived from the Thinker's context length:
    ``PROMPT_CHARS_PER_TOKEN`` characters per token, and a body that fits such a prompt however it is
    escaped (``BODY_BYTES_PER_PROMPT_CHAR``), plus the media limit's bytes as base64, plus
    ``BODY_BYTES_EXTRA`` for everything else. ``media``: per-request media limits and the allowed media
    directory (``media_input.MediaLimits``). ``realtime``: what realtime sessions may hold."""

    max_body_bytes: int | None = None
    max_prompt_chars: int | None = None
    preprocess_threads: int = 2  # parse / validate / decode media / tokenize / encode off the event loop
    media: MediaLimits = MediaLimits()
    realtime: RealtimeLimits = RealtimeLimits()  # WS /v1/realtime sessions
    max_transcript_tokens: int = DEFAULT_MAX_TOKENS  # one transcript's tokens (/v1/audio/transcriptions, realtime)

    def __post_init__(self) -> None:
        check_positive_int(self.preprocess_threads, "preprocess_threads")
        check_positive_int(self.max_transcript_tokens, "max_transcript_tokens")
        for name in ("max_body_bytes", "max_prompt_chars"):
            if getattr(self, name) is not None:
                check_positive_int(getattr(self, name), name)

    def prompt_chars(self, max_model_len: int) -> int:
        return self.max_prompt_chars or PROMPT_CHARS_PER_TOKEN * max_model_len

    def body_bytes(self, max_model_len: int, media: bool = True) -> int:
        """``media``: whether the model takes media input (else no room is made for it)."""
        text = BODY_BYTES_PER_PROMPT_CHAR * self.prompt_chars(max_model_len)
        return self.max_body_bytes or text + (self.media.base64_bytes if media else 0) + BODY_BYTES_EXTRA
