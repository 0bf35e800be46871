"""OpenAI-compatible HTTP server over ``AsyncOmni``.

Endpoints: ``POST /v1/chat/completions`` (text, audio, images and video in; text, or text + audio out),
``POST /v1/audio/speech``,
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus).

Choices worth knowing as a client:
- ``model`` must be the served model name; anything else is 404 ``model_not_found`` (as OpenAI does).
- Sampling: ``temperature``, ``top_p``, ``seed``, ``max_tokens``/``max_completion_tokens``,
  ``frequency_penalty``, ``presence_penalty``, ``logit_bias`` (and the extensions ``top_k``,
  ``repetition_penalty``, ``min_tokens``, ``ignore_eos``) apply to the Thinker; unset fields keep the stage
  defaults from the pipeline config. The Talker keeps its stage defaults, except that a greedy
  ``temperature`` (0, or below 1e-5) makes the Talker greedy too (a request that asks for determinism gets
  it end to end) and ``seed`` seeds it. The extension object ``talker: {temperature, top_p, top_k,
  repetition_penalty, seed, max_tokens, min_tokens}`` (``extra_body`` in the openai SDK) overrides Talker
  sampling field by field. ``frequency_penalty`` / ``presence_penalty`` follow OpenAI's formula over the
  tokens the request generated so far (not its prompt).
- ``stop``: stop strings are matched on the decoded text in the server; the text before the stop string
  is returned and the request is finished with ``finish_reason="stop"``. A stop string that is exactly
  one token is also given to the Thinker as a stop token id, so the Thinker ends there by itself and the
  speech covers the returned text. A multi-token stop string ends the request by aborting it in every
  stage, so audio produced after that point is cut.
- Audio: non-streamed chat returns ``message.audio.data`` in ``audio.format`` (wav, pcm16, flac);
  streamed chat sends base64 pcm16 (24 kHz mono little-endian) chunks in ``delta.audio.data`` whatever
  ``audio.format`` says (as OpenAI requires pcm16 for streaming); the text streams in ``delta.content``
  and the full transcript comes in the last audio delta. An answer without speech still carries a valid
  file (a 0-sample WAV; FLAC cannot say "0 samples", see ``audio_format``, so it holds one silent sample).
- Speech: an omni model speaks its *own answer*; there is no TTS-only mode, so ``input`` is sent as the
  user message and the spoken answer is returned. ``response_format`` wav / pcm / flac; ``speed`` other
  than 1.0 is rejected. ``stream_format="audio"`` streams raw pcm chunk by chunk; wav and flac are sent
  in one piece once complete (their headers carry exact sizes). ``stream_format="sse"`` sends
  ``speech.audio.delta`` events with base64 pcm and needs ``response_format="pcm"``.
- A client that disconnects mid-stream has its request aborted in every stage.
- ``X-Request-Id`` (1-128 characters of ``[A-Za-z0-9-_.:]``) becomes the engine's request id (and the
  response ``id``); without it the server makes one.

Validation before admission (nothing reaches the engine unless all of it passes). Every rejection is a
400 with OpenAI's body ``{"error": {"message", "type", "param", "code"}}`` whose ``param`` names the field
(``messages.0.content``, ``talker.seed``, ...), unless said otherwise:
- Body: larger than ``ServerLimits.max_body_bytes`` (default: 12 bytes per prompt character + the media byte
  limit as base64 + 1 MiB, i.e. 13.0 MB for a 4096-token context and the default media limits; 1.8 MB for a
  model without media input) -> 413 ``request_too_large`` (no ``param``); not UTF-8, not JSON, or
  nested deeper than Python's JSON parser allows (about 1000 levels, rejected as soon as the parser gets
  there) -> 400 ``invalid_json`` (no ``param``).
- Types and text: JSON Schema's strict types (``true`` is not a number, ``"0.5"`` is not a number, ``1e9``
  is not an integer); roles other than system, developer, user, assistant; any string holding a lone
  surrogate (``"\\ud800"``), i.e. text that is not valid Unicode.
- Ranges (OpenAI's): ``temperature`` in [0, 2], ``top_p`` in (0, 1], ``frequency_penalty`` and
  ``presence_penalty`` in [-2, 2], ``logit_bias`` at most 1024 entries, token ids inside the vocabulary,
  biases in [-100, 100]; ``n`` = 1; ``stop`` at most 4 strings of at most 256 characters; ``seed`` in
  [-2**63, 2**64 - 1] (what torch accepts); extensions ``top_k`` >= -1, ``repetition_penalty`` in (0, 2],
  ``min_tokens`` <= the maximum. ``talker.*`` follows the same ranges. A temperature below 1e-5 is greedy:
  dividing float32 logits by it would overflow to NaN, and greedy is the limit it asks for, so it is not
  rejected (``SamplingParams.greedy``).
- Length: ``max_tokens`` / ``max_completion_tokens`` >= 1 and prompt + maximum <= the context length
  (400 naming that field, code ``context_length_exceeded``, OpenAI's wording); ``talker.max_tokens`` <= the
  Talker's configured ``max_tokens`` (the deployment's cap: a client may shorten the audio, not lengthen
  it beyond what the operator allows). The prompt's messages and characters are counted before rendering and
  tokenizing (at most one message per token of context; ``max_prompt_chars``, default 16 per token) and its
  tokens after; any over -> 400 ``context_length_exceeded`` on ``messages`` / ``input``. Speech ``input``
  holds at most 4096 characters (OpenAI's limit).
- Content parts: ``text``, and media in user messages (below). ``file`` -> 400 naming the part (code
  ``unsupported_content``), as is a media part the model has no encoder for; any other type -> 400 on its ``type``.
- Fields that would change the answer but are not implemented -> 400 ``unsupported_parameter``:
  ``logprobs: true``, ``top_logprobs`` > 0, ``tools``, ``functions``, ``tool_choice`` / ``function_call``
  other than "none", ``tool_calls`` in a message, ``response_format`` other than ``{"type": "text"}``,
  ``web_search_options``, speech ``instructions``, speech ``speed`` != 1. Unknown voices, audio formats and
  modalities are 400s too. Other unknown fields change nothing and are ignored (the SDK sends some).

Media input (models with audio / vision towers; ``GET /playground/info`` lists them in ``input_modalities``):
user messages may hold ``{"type": "input_audio", "input_audio": {"data": <base64>, "format": "wav"
| "mp3" | "flac" | "ogg" | "opus" | "webm" | "m4a" | "aac" | "mp4"}}`` (decoded by content, the format name is
checked only), ``{"type": "image_url", "image_url": {"url": ...}}`` (``detail`` accepted and ignored: the
model's processor sizes images), ``audio_url`` and ``video_url`` likewise. A URL is a data URL
(``data:<image|audio|video>/<subtype>;base64,<data>``, its media type matching the part) or, only when the server
was started with ``--allowed-media-dir DIR``, a local file: a path (relative ones from DIR) or a ``file://``
URL that resolves, symlinks followed, strictly inside DIR. The server has no network: http(s) URLs are
refused. ``mm_processor_kwargs`` (as vLLM): ``use_audio_in_video`` (videos bring their audio track,
interleaved with the frames by time) and ``fps`` (frames sampled per second of video, default 2); other keys
are refused. Audio is mixed to mono and resampled to 16 kHz; videos are sampled at ``fps`` (at most 768
frames). Limits per request (``media_input.MediaLimits``, ``omnistage serve --max-media-*``), each checked
as early as it can be: media parts (default 16, counted before anything is read); encoded bytes, all parts
together (8 MiB: the base64 length is checked before decoding, a file's size before reading it); seconds of
audio, all clips and video tracks together (300 s, about 3900 tokens); pixels per image and per video frame
(4096 x 4096); per video, seconds (60), frames decoded (1800) and the pixels of the frames sampled from it
(2**27, 384 MiB as RGB: 60 s of 720p or 32 s of 1080p at 2 frames per second; a lower ``fps`` samples fewer).
Seconds, pixels and frames are read from the file's header before decoding where the format states them, and
counted again while decoding (so a lying header costs at most the limit's worth of work); a video is decoded
twice (count, then keep only the sampled frames). The context length is checked once the prompt is rendered
(an image of N pixels costs about N / 1024 tokens after the processor's resizing, audio about 13 tokens per
second). A bad media part is a 400 whose message starts with the part (``content part messages.1.content.2:
...``) and whose ``param`` is the part: code ``invalid_media`` (malformed base64 or data URL, a media type that
is not the part's, a file that cannot be decoded or is missing, media in a non-user message, a video without
the audio track ``use_audio_in_video`` needs, audio too short for the model), ``media_limit_exceeded``, or
``media_url_not_allowed`` (http(s) or other schemes, local files when none are allowed or outside DIR; the
message never shows where a path resolves). With ``"modalities": ["text", "audio"]`` the answer to a media
prompt is spoken too (the Talker conditions on the media rows as transformers' does). Decoding runs in the
preprocessing pool, and a client that disconnects before its first output (e.g. while its media are being
encoded) is aborted at once.

Bounded work: the body is kept only up to the limit (the rest of a bigger one, up to 64 MiB, is read and
dropped so the client reads the 413; beyond that the connection is closed); JSON parsing, validation, media
decoding, prompt rendering, tokenization and audio encoding run in a small thread pool, never on the event loop, so
``/health`` and streaming clients keep being served while a huge request is being rejected; after a big
body, freed heap pages are handed back to the OS (``malloc_trim``).

Errors: a full waiting queue is 429 with ``Retry-After``; a dead engine is 503; a request the engine fails
while serving it (and only that request) gets a 500 ``request_failed`` with the reason. Every error,
including an unexpected exception (500, logged with its traceback), is an ordinary complete response, so
the keep-alive connection stays usable. Once a stream has started the status line is gone: the error is
sent in-band (SSE) or, for raw pcm, the stream ends without its terminating chunk and the connection is
closed.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import ctypes
import ctypes.util
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from omnistage.config.stage_config import EXECUTOR_BACKENDS
from omnistage.core.sampling_params import SamplingParams
from omnistage.core.validation import check_positive_int
from omnistage.entrypoints import audio_format
from omnistage.entrypoints.detokenizer import IncrementalDetokenizer, StopStringMatcher
from omnistage.entrypoints.media_input import (
    DEFAULT_MAX_AUDIO_SECONDS,
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_ITEMS,
    DEFAULT_MAX_VIDEO_FRAMES,
    DEFAULT_MAX_VIDEO_PIXELS,
    DEFAULT_MAX_VIDEO_SECONDS,
    PART_KINDS,
    MediaBudget,
    MediaBytes,
    MediaLimits,
    MediaReader,
    MediaRejection,
)
from omnistage.entrypoints.metrics import CONTENT_TYPE, RequestTimer, ServerMetrics
from omnistage.entrypoints.playground import router as playground_router
from omnistage.entrypoints.protocol import (
    AssistantMessage,
    AudioOutput,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    Choice,
    ChunkDelta,
    ContentPart,
    ModelCard,
    ModelList,
    SpeechRequest,
    StageSamplingParams,
    Usage,
    error_param,
)
from omnistage.entrypoints.realtime import RealtimeLimits, realtime_router
from omnistage.entrypoints.stage_sampling import SamplingFieldError, stage_params
from omnistage.models.family import PreparedPrompt
from omnistage.pipeline.client import EngineClient
from omnistage.pipeline.omni import AsyncOmni, EngineDeadError, QueueFullError

logger = logging.getLogger("omnistage.server")

RETRY_AFTER_S = 1
AUDIO_EXPIRY_S = 3600
_STAGE_FIELDS = ("temperature", "top_p", "top_k", "repetition_penalty", "seed", "max_tokens", "min_tokens")
MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_STOP_CHARS = 256
MAX_LOGIT_BIAS = 1024
MAX_SPEECH_INPUT_CHARS = 4096  # OpenAI's limit
PROMPT_CHARS_PER_TOKEN = 16  # default character budget per token of context (real text averages ~4)
BODY_BYTES_PER_PROMPT_CHAR = 12  # an astral character JSON-escaped as a surrogate pair (12 bytes)
BODY_BYTES_EXTRA = 1 << 20
DRAIN_BYTES = 64 << 20  # how much of an oversized body is read and dropped to deliver the 413
TRIM_AFTER_BYTES = 1 << 16  # after a body this big (parsed and tokenized in the pool threads), trim the heap


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

    def __post_init__(self) -> None:
        check_positive_int(self.preprocess_threads, "preprocess_threads")
        for name in ("max_body_bytes", "max_prompt_chars"):
            if getattr(self, name) is not None:
                check_positive_int(getattr(self, name), name)

    def prompt_chars(self, max_model_len: int) -> int:
        return self.max_prompt_chars or PROMPT_CHARS_PER_TOKEN * max_model_len

    def body_bytes(self, max_model_len: int, media: bool = True) -> int:
        """``media``: whether the model takes media input (else no room is made for it)."""
        text = BODY_BYTES_PER_PROMPT_CHAR * self.prompt_chars(max_model_len)
        return self.max_body_bytes or text + (self.media.base64_bytes if media else 0) + BODY_BYTES_EXTRA


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _submit_error(exc: BaseException) -> APIError:
    """Map what ``AsyncOmni.generate`` raises to an HTTP error."""
    if isinstance(exc, QueueFullError):
        return APIError(429, f"server is busy: {exc}", "rate_limit_error", code="queue_full",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), "server_error", code="engine_dead", headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, ValueError):
        return APIError(400, str(exc))
    return APIError(500, f"internal error: {exc!r}", "server_error")


def _unsupported(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="unsupported_parameter")


def _schema_error(errors: list[Any]) -> APIError:
    """pydantic errors -> one 400 naming the first bad field."""
    first = errors[0] if errors else {}
    msgs = []
    for e in errors[:5]:
        msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
        msgs.append(f"{error_param(tuple(e.get('loc', ()))) or 'body'}: {msg}")
    code = "invalid_json" if first.get("type") == "json_invalid" else "invalid_request"
    return APIError(400, "; ".join(msgs) or "invalid request", param=error_param(tuple(first.get("loc", ()))),
                    code=code)


# ---- reading and parsing bodies ---------------------------------------------------------------------
def _too_large(limit: int, close: bool) -> APIError:
    return APIError(413, f"request body is larger than this server's limit of {limit} bytes",
                    code="request_too_large", headers={"Connection": "close"} if close else None)


async def _drain(chunks: AsyncIterator[bytes], budget: int) -> bool:
    """Read and drop the rest of a body, up to ``budget`` bytes; True if it ended within the budget."""
    async for chunk in chunks:
        budget -= len(chunk)
        if budget < 0:
            return False
    return True


async def _read_body(raw: Request, limit: int) -> bytearray:
    """The request body, refused with 413 once it passes ``limit`` bytes. Like nginx's lingering close, an
    oversized body is read and dropped up to ``DRAIN_BYTES`` more, so the client (which usually sends
    everything before reading) gets the 413 on a connection that stays usable; a bigger one is answered at
    once and the connection closed (the client may then see a reset instead of the 413)."""
    chunks = raw.stream()
    declared = raw.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise APIError(400, "invalid Content-Length header", headers={"Connection": "close"}) from None
        if size > limit:
            drained = size <= limit + DRAIN_BYTES and await _drain(chunks, size)
            raise _too_large(limit, close=not drained)
    buf = bytearray()
    async for chunk in chunks:
        buf += chunk
        if len(buf) > limit:
            seen = len(buf)
            del buf
            raise _too_large(limit, close=not await _drain(chunks, limit + DRAIN_BYTES - seen))
    return buf


def _parse_json(body: bytes | bytearray) -> Any:
    try:
        return json.loads(body)
    except RecursionError:
        raise APIError(400, "the JSON body is nested too deeply", code="invalid_json") from None
    except UnicodeDecodeError:
        raise APIError(400, "the request body is not valid UTF-8", code="invalid_json") from None
    except ValueError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None


def _validate(model: type[BaseModel], body: bytes | bytearray) -> Any:
    data = _parse_json(body)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _schema_error(exc.errors()) from None


def _release_freed_memory() -> None:
    """glibc keeps freed heap pages of big, short-lived requests mapped (up to its trim threshold in every
    thread's arena); malloc_trim hands them back so a rejected maximal body does not stay in the RSS."""
    if _malloc_trim is not None:
        _malloc_trim(0)


def _load_malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc
        return None


_malloc_trim = _load_malloc_trim()


def _translate(fn: Callable[[bytearray], Any], box: list[bytearray]) -> tuple[Any, APIError | None]:
    """Run a translator entry point on the body in ``box`` (in the pool). A rejection is returned, not
    raised, stripped of its traceback and context: those hold the frames and the parsed body, and a big
    rejected body must be gone before its memory is trimmed."""
    body = box.pop()
    big = len(body) > TRIM_AFTER_BYTES
    try:
        return fn(body), None
    except APIError as err:
        err.__traceback__ = err.__context__ = err.__cause__ = None
        return None, err
    finally:
        del body
        if big:
            _release_freed_memory()


# ---- request translation ---------------------------------------------------------------------------
@dataclass
class _Job:
    prompt: PreparedPrompt
    modalities: tuple[str, ...]
    params: dict[str, SamplingParams]  # by stage name
    speaker: str | None
    stops: list[str] = field(default_factory=list)
    stop_token_ids: frozenset[int] = frozenset()

    @property
    def wants_audio(self) -> bool:
        return "audio" in self.modalities

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt.token_ids)


class _Translator:
    """Turns API request bodies into engine inputs, validating everything that can be checked up front.
    Its entry points (``chat``, ``speech``) run in the preprocessing thread pool."""

    def __init__(self, omni: EngineClient, served_model_name: str, limits: ServerLimits) -> None:
        self.omni = omni
        self.info = omni.info
        self.served_model_name = served_model_name
        self.max_prompt_chars = limits.prompt_chars(self.info.max_model_len)
        # Token ids a request may name (logit_bias): the text stage's logits, else the tokenizer's.
        self.vocab_size = self.info.vocab_size or len(omni.tokenizer)
        self.media = MediaReader(limits.media)
        self.input_kinds = frozenset(self.info.input_modalities) - {"text"}  # audio / image / video the model takes

    def check_model(self, model: str) -> None:
        if model != self.served_model_name:
            raise APIError(404, f"The model {model!r} does not exist; this server serves "
                                f"{self.served_model_name!r}", param="model", code="model_not_found")

    def voice(self, voice: str | None, param: str) -> str | None:
        if "audio" not in self.info.output_modalities or not self.info.voices:
            raise APIError(400, "this server has no audio stages; request modalities ['text'] only",
                           param="modalities")
        name = (voice or self.info.default_voice or "").lower()
        if name not in self.info.voices:
            raise APIError(400, f"unknown voice {voice!r}; available: {sorted(self.info.voices)}",
                           param=param, code="invalid_voice")
        return name

    def prompt(self, messages: list[dict[str, Any]], param: str, **options: Any) -> PreparedPrompt:
        """Render and tokenize; ``options`` go to the model's media processing (``use_audio_in_video``)."""
        if not messages:
            raise APIError(400, "messages must not be empty", param=param)
        if len(messages) >= self.info.max_model_len:  # each message costs at least one token
            raise APIError(400, f"{len(messages)} messages cannot fit in this model's context of "
                                f"{self.info.max_model_len} tokens", param=param, code="context_length_exceeded")
        chars = sum(_text_chars(m["content"]) for m in messages)
        if chars > self.max_prompt_chars:  # before tokenizing: the tokenizer's work is bounded by this
            raise APIError(400, f"The prompt has {chars} characters; this server accepts at most "
                                f"{self.max_prompt_chars}", param=param, code="context_length_exceeded")
        try:
            prepared = self.omni.render_prompt(messages, **options)
        except ValueError as exc:
            part = _PROCESSOR_PART.search(str(exc))
            if part is not None:  # the model's processor refused a media part: name it as the API does
                where = f"messages.{part[1]}.content.{part[2]}"
                raise APIError(400, f"content part {where}{str(exc)[part.end():]}", param=where,
                               code="invalid_media") from exc
            limit = self.info.max_model_len - 1
            if "at most" in str(exc):
                raise APIError(400, f"This model's maximum context length is {limit} tokens; {exc}", param=param,
                               code="context_length_exceeded") from exc
            raise APIError(400, str(exc), param=param) from exc
        return prepared

    def check_context(self, num_prompt: int, max_tokens: int | None, param: str) -> None:
        limit = self.info.max_model_len
        if max_tokens is not None and num_prompt + max_tokens > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                f"{num_prompt + max_tokens} tokens ({num_prompt} in the messages, {max_tokens} in "
                                "the completion). Please reduce the length of the messages or completion.",
                           param=param, code="context_length_exceeded")

    def logit_bias(self, bias: dict[int, float] | None) -> dict[int, float] | None:
        if not bias:
            return None
        if len(bias) > MAX_LOGIT_BIAS:
            raise APIError(400, f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS} are allowed",
                           param="logit_bias")
        for tok in bias:
            if tok >= self.vocab_size:
                raise APIError(400, f"Invalid key in 'logit_bias': {tok} is not a token id of this model "
                                    f"(0 <= id < {self.vocab_size})", param=f"logit_bias.{tok}")
        return bias

    def params(self, thinker: dict[str, Any], talker: StageSamplingParams | None) -> dict[str, SamplingParams]:
        overrides = {k: getattr(talker, k) for k in _STAGE_FIELDS} if talker is not None else {}
        try:
            return stage_params(self.info, thinker, overrides)
        except SamplingFieldError as exc:
            raise APIError(400, str(exc), param=exc.param) from exc

    def messages(self, messages: list[ChatMessage], budget: MediaBudget
                 ) -> tuple[list[dict[str, Any]], list[MediaBytes]]:
        """API messages -> the engine's chat messages, and their media parts read (checked, not decoded yet:
        ``decode_media`` puts the decoded parts in their place). A message without media keeps its text
        parts joined into one string."""
        out: list[dict[str, Any]] = []
        media: list[MediaBytes] = []
        for i, m in enumerate(messages):
            if m.tool_calls:
                raise _unsupported(f"messages.{i}.tool_calls", "tool calls are not supported")
            if m.function_call is not None:
                raise _unsupported(f"messages.{i}.function_call", "function calls are not supported")
            content: str | list[Any] = m.content or ""
            if isinstance(m.content, list):
                parts: list[Any] = []
                for j, part in enumerate(m.content):
                    parts.append(self.part(m.role, part, f"messages.{i}.content.{j}", budget))
                    if isinstance(parts[-1], MediaBytes):
                        media.append(parts[-1])
                if any(isinstance(p, MediaBytes) for p in parts):
                    content = parts
                else:
                    content = "".join(p["text"] for p in parts)
            out.append({"role": "system" if m.role == "developer" else m.role, "content": content})
        return out, media

    def part(self, role: str, part: ContentPart, where: str, budget: MediaBudget) -> dict[str, str] | MediaBytes:
        if part.type == "text":
            if part.text is None:
                raise APIError(400, f"content part {where} of type 'text' needs a 'text' string", param=f"{where}.text")
            return {"type": "text", "text": part.text}
        kind = PART_KINDS.get(part.type)
        if kind is None:
            if part.type == "file":
                raise APIError(400, f"content part {where} has type 'file', which is not supported: send audio as "
                                    "'input_audio' or 'audio_url', images as 'image_url', video as 'video_url'",
                               param=where, code="unsupported_content")
            supported = ["text", *PART_KINDS] if self.input_kinds else ["text"]
            raise APIError(400, f"content part {where} has unknown type {part.type!r}; supported: "
                                f"{', '.join(map(repr, supported))}", param=f"{where}.type")
        if kind not in self.input_kinds:
            raise APIError(400, f"content part {where} has type {part.type!r}, but this model takes no {kind} input",
                           param=where, code="unsupported_content")
        if role != "user":
            raise APIError(400, f"content part {where}: media parts are accepted in user messages only, not in "
                                f"{role!r} messages", param=where, code="invalid_media")
        body = getattr(part, part.type)
        if body is None:
            raise APIError(400, f"content part {where} of type {part.type!r} needs a {part.type!r} object",
                           param=f"{where}.{part.type}")
        try:
            return self.media.read(budget, where, part.type, body)
        except MediaRejection as exc:
            raise APIError(400, str(exc), param=exc.where, code=exc.code) from None

    def decode_media(self, messages: list[dict[str, Any]], budget: MediaBudget, use_audio_in_video: bool,
                     fps: float | None) -> None:
        """Decode every media part (in prompt order) and put it in its place in ``messages``."""
        for m in messages:
            if isinstance(m["content"], list):
                for j, p in enumerate(m["content"]):
                    if isinstance(p, MediaBytes):
                        try:
                            m["content"][j] = self.media.decode(budget, p, use_audio_in_video, fps)
                        except MediaRejection as exc:
                            raise APIError(400, str(exc), param=exc.where, code=exc.code) from None

    def stops(self, stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise APIError(400, f"stop holds {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed",
                           param="stop")
        for i, s in enumerate(stops):
            if len(s) > MAX_STOP_CHARS:
                raise APIError(400, f"stop strings hold at most {MAX_STOP_CHARS} characters; this one has {len(s)}",
                               param="stop" if isinstance(stop, str) else f"stop.{i}")
        return stops

    @staticmethod
    def check_unsupported(req: ChatCompletionRequest) -> None:
        if req.n not in (None, 1):
            raise APIError(400, "only n=1 is supported", param="n")
        if req.logprobs:
            raise _unsupported("logprobs", "logprobs are not supported yet")
        if req.top_logprobs:
            raise _unsupported("top_logprobs", "top_logprobs are not supported yet")
        for name in ("tools", "functions"):
            if getattr(req, name):
                raise _unsupported(name, f"{name} are not supported: this server does not call tools")
        for name in ("tool_choice", "function_call"):
            if getattr(req, name) not in (None, "none"):
                raise _unsupported(name, f"{name} is not supported: this server does not call tools")
        if req.response_format is not None and req.response_format.type != "text":
            raise _unsupported("response_format", f"response_format {req.response_format.type!r} is not "
                                                  "supported; only 'text'")
        if req.web_search_options is not None:
            raise _unsupported("web_search_options", "web search is not supported")

    def chat(self, body: bytes | bytearray) -> tuple[ChatCompletionRequest, _Job, str]:
        req = _validate(ChatCompletionRequest, body)
        self.check_model(req.model)
        self.check_unsupported(req)
        modalities = tuple(req.modalities or ("text",))
        if sorted(modalities) not in (["text"], ["audio", "text"]):
            raise APIError(400, f"modalities must be ['text'] or ['text', 'audio'], got {list(modalities)}",
                           param="modalities")
        fmt = "wav"
        speaker = None
        if "audio" in modalities:
            audio = req.audio
            speaker = self.voice(audio.voice if audio else None, "audio.voice")
            try:
                fmt = audio_format.normalize_format(audio.format if audio else "wav")
            except ValueError as exc:
                raise APIError(400, str(exc), param="audio.format") from exc
        budget = self.media.budget()
        messages, media = self.messages(req.messages, budget)
        stops = self.stops(req.stop)
        mm = req.mm_processor_kwargs
        if mm is not None and not self.input_kinds:
            raise APIError(400, "mm_processor_kwargs is not supported: this model takes no media input",
                           param="mm_processor_kwargs", code="unsupported_parameter")
        if req.max_completion_tokens is not None:
            max_tokens, max_param = req.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, max_param = req.max_tokens, "max_tokens"
        stop_ids = self.single_token_stops(stops)
        thinker = {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
                   "repetition_penalty": req.repetition_penalty, "frequency_penalty": req.frequency_penalty,
                   "presence_penalty": req.presence_penalty, "logit_bias": self.logit_bias(req.logit_bias),
                   "seed": req.seed, "max_tokens": max_tokens, "min_tokens": req.min_tokens,
                   "ignore_eos": req.ignore_eos or None}
        if stop_ids:
            thinker["stop_token_ids"] = tuple(sorted(stop_ids))
        params = self.params(thinker, req.talker)
        # Everything cheap has passed: now the media are decoded, then the prompt rendered.
        options = {}
        if media:
            uav = mm is not None and mm.use_audio_in_video
            self.decode_media(messages, budget, uav, mm.fps if mm is not None else None)
            if uav:
                options["use_audio_in_video"] = True
        prompt = self.prompt(messages, "messages", **options)
        self.check_context(len(prompt.token_ids), max_tokens, max_param)
        job = _Job(prompt, ("text", "audio") if "audio" in modalities else ("text",), params, speaker,
                   stops, frozenset(stop_ids))
        return req, job, fmt

    def single_token_stops(self, stops: list[str]) -> set[int]:
        out = set()
        for s in stops:
            ids = self.omni.tokenizer.encode(s, add_special_tokens=False)
            if len(ids) == 1:
                out.add(int(ids[0]))
        return out

    def speech(self, body: bytes | bytearray) -> tuple[SpeechRequest, _Job, str]:
        req = _validate(SpeechRequest, body)
        self.check_model(req.model)
        if req.speed != 1.0:
            raise APIError(400, "speed is not supported (only 1.0): the model cannot change its speaking rate",
                           param="speed", code="unsupported_parameter")
        if req.instructions:
            raise _unsupported("instructions", "instructions are not supported: the model speaks its own answer")
        if not req.input.strip():
            raise APIError(400, "input must not be empty", param="input")
        if len(req.input) > MAX_SPEECH_INPUT_CHARS:
            raise APIError(400, f"input has {len(req.input)} characters; at most {MAX_SPEECH_INPUT_CHARS} are "
                                "allowed", param="input", code="context_length_exceeded")
        try:
            fmt = audio_format.normalize_format(req.response_format)
        except ValueError as exc:
            raise APIError(400, str(exc), param="response_format") from exc
        if req.stream_format == "sse" and fmt != "pcm16":
            raise APIError(400, "stream_format 'sse' sends pcm chunks; use response_format 'pcm'",
                           param="response_format")
        speaker = self.voice(req.voice, "voice")
        prompt = self.prompt([{"role": "user", "content": req.input}], "input")
        self.check_context(len(prompt.token_ids), req.max_tokens, "max_tokens")
        thinker = {"temperature": req.temperature, "seed": req.seed, "max_tokens": req.max_tokens}
        params = self.params(thinker, req.talker)
        return req, _Job(prompt, ("text", "audio"), params, speaker), fmt


# Where the model's processor names a part ("messages[1].content[2]: ..."): the same indices as the API's.
_PROCESSOR_PART = re.compile(r"messages\[(\d+)\]\.content\[(\d+)\]")


def _text_chars(content: str | list[Any]) -> int:
    if isinstance(content, str):
        return len(content)
    return sum(len(p["text"]) for p in content if isinstance(p, dict) and p.get("type") == "text")


# ---- one running request ---------------------------------------------------------------------------
class _Run:
    """Drives one ``AsyncOmni.generate`` call and turns deltas into ("text" | "audio", value) events.

    ``start()`` submits and waits for the first delta, so submit errors become HTTP errors before any
    response bytes are sent. Leaving ``events()`` early (stop string, client gone) closes the engine
    stream, which aborts the request in every stage.
    """

    def __init__(self, omni: EngineClient, job: _Job, request_id: str, metrics: ServerMetrics) -> None:
        self.omni, self.job, self.request_id = omni, job, request_id
        self.detok = IncrementalDetokenizer(omni.tokenizer)
        self.stopper = StopStringMatcher(job.stops)
        self.metrics = metrics
        self.timer: RequestTimer | None = None
        self.finish_reason: str | None = None
        self.num_tokens = 0
        self.num_frames = 0
        self._agen: Any = None
        self._first: Any = None
        self.text = ""  # the answer text released so far (stop strings cut off)
        self.error: str | None = None  # why the engine failed this request

    async def start(self) -> None:
        submitted = time.monotonic()  # latencies count from here: queueing, media encoding and prefill included
        self._agen = self.omni.generate(self.job.prompt, self.job.modalities, self.job.params,
                                        self.job.speaker, self.request_id)
        try:
            self._first = await self._agen.__anext__()
        except asyncio.CancelledError:  # the client left before any output: the request was aborted
            RequestTimer(self.metrics, self.job.num_prompt_tokens, submitted).finish("abort", None)
            raise
        except StopAsyncIteration as exc:
            raise APIError(500, "engine returned no output", "server_error") from exc
        except Exception as exc:
            raise _submit_error(exc) from exc
        self.timer = RequestTimer(self.metrics, self.job.num_prompt_tokens, submitted)

    def _text(self, piece: str) -> str:
        piece = self.stopper.feed(piece)
        self.text += piece
        return piece

    async def events(self) -> AsyncIterator[tuple[str, Any]]:
        d, done = self._first, False
        try:
            while True:
                new = d.new_token_ids
                if new:
                    self.num_tokens += len(new)
                    self.timer.tokens(len(new))
                    piece = self._text(self.detok.add(new))
                    if piece:
                        yield "text", piece
                    if self.stopper.stopped and not d.finished and not (set(new) & self.job.stop_token_ids):
                        # A multi-token stop string: nothing stops the Thinker but us.
                        self.finish_reason = "stop"
                        return
                if d.codes is not None:
                    self.num_frames += int(d.codes.shape[-1])
                if d.audio is not None and d.audio.numel():
                    self.timer.audio(int(d.audio.numel()))
                    yield "audio", d.audio
                if d.finished:
                    tail = self._text(self.detok.flush()) + ("" if self.stopper.stopped else self._text_flush())
                    if tail:
                        yield "text", tail
                    self.finish_reason = "stop" if self.stopper.stopped else d.finish_reason
                    self.error = d.error
                    done = True
                    return
                d = await self._agen.__anext__()
        finally:
            if not done:
                await self._agen.aclose()  # aborts the request in every stage
            self.timer.finish(self.finish_reason or "abort", self.omni.info.sample_rate)

    def failure(self) -> APIError:
        """The error a request that the engine failed gets (its own failure, not the server's)."""
        return APIError(500, f"the engine failed while generating this request: {self.error or 'unknown error'}",
                        "server_error", code="request_failed")

    def _text_flush(self) -> str:
        piece = self.stopper.flush()
        self.text += piece
        return piece

    def usage(self) -> Usage:
        details = {"audio_tokens": self.num_frames} if self.job.wants_audio else None
        n = self.job.num_prompt_tokens
        return Usage(prompt_tokens=n, completion_tokens=self.num_tokens, total_tokens=n + self.num_tokens, completion_tokens_details=details)


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _check_finish(run: _Run) -> None:
    if run.finish_reason == "error":
        raise run.failure()


# ---- app -------------------------------------------------------------------------------------------
class _GuardedRoute(APIRoute):
    """Turns an unexpected exception into a plain 500 response (logged with its traceback). Left to
    Starlette, the exception would be re-raised after the 500 was sent and uvicorn would then drop the
    keep-alive connection without ``Connection: close``, failing the client's next request on it."""

    def get_route_handler(self) -> Callable[[Request], Any]:
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                return await handler(request)
            except (APIError, StarletteHTTPException, RequestValidationError):
                raise
            except Exception as exc:
                logger.exception("internal error while serving %s %s", request.method, request.url.path)
                raise APIError(500, f"internal error: {exc!r}", "server_error") from exc

        return guarded


def create_app(omni: EngineClient, served_model_name: str | None = None,
               metrics: ServerMetrics | None = None, limits: ServerLimits | None = None) -> FastAPI:
    """The FastAPI app serving the engine client ``omni``. Pass ``metrics`` when its ``observe_step`` already
    listens to the engine's steps; otherwise a fresh ``ServerMetrics`` is created and subscribed."""
    name = served_model_name or omni.info.name
    limits = limits or ServerLimits()
    if metrics is None:
        metrics = ServerMetrics()
        omni.add_step_listener(metrics.observe_step)
    tr = _Translator(omni, name, limits)
    max_body_bytes = limits.body_bytes(omni.info.max_model_len, media=bool(tr.input_kinds))
    pool = ThreadPoolExecutor(limits.preprocess_threads, thread_name_prefix="omnistage-preprocess")

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="omnistage", version="0.1.0", lifespan=lifespan)
    app.router.route_class = _GuardedRoute
    app.state.omni, app.state.metrics, app.state.served_model_name = omni, metrics, name
    app.state.limits, app.state.preprocess_pool = limits, pool
    app.include_router(playground_router)  # GET / (the browser playground) and /playground/*
    # What chat messages may hold (the playground shows its media controls from this).
    app.state.input_modalities = ("text", *sorted(tr.input_kinds))
    app.include_router(realtime_router(omni, name, metrics, pool, limits.realtime))  # WS /v1/realtime

    async def off_loop(fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    async def translate(fn: Callable[[bytearray], Any], raw: Request) -> Any:
        box = [await _read_body(raw, max_body_bytes)]  # the pool thread takes the only reference
        result, error = await off_loop(_translate, fn, box)
        if error is not None:
            raise error
        return result

    def encode_audio(chunks: list[torch.Tensor], fmt: str) -> bytes:
        wave = torch.cat(chunks) if chunks else torch.zeros(0)
        return audio_format.encode(wave, fmt, omni.info.sample_rate)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(_schema_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        return _error_response(APIError(exc.status_code, str(exc.detail), kind, headers=exc.headers))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        return _error_response(APIError(500, f"internal error: {exc!r}", "server_error"))

    @app.get("/health")
    async def health() -> Response:
        if omni.dead is not None:
            return _error_response(APIError(503, f"engine stopped: {type(omni.dead).__name__}: {omni.dead}", "server_error",
                                            code="engine_dead"))
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=name)])

    @app.get("/metrics")
    async def prometheus() -> Response:
        if omni.dead is None:
            try:
                metrics.update_resources(await omni.resource_stats())
            except EngineDeadError:
                pass
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/chat/completions")
    async def chat(raw: Request) -> Any:
        rid = _request_id(raw, "chatcmpl")
        req, job, fmt = await translate(tr.chat, raw)
        run = _Run(omni, job, rid, metrics)
        if not await _unless_gone(run.start(), raw):
            return Response(status_code=CLIENT_CLOSED)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(_chat_stream(run, name, include_usage), media_type="text/event-stream")
        texts, audio = [], []
        events: list[tuple[str, Any]] = []
        if not await _unless_gone(_collect(run, events), raw):
            return Response(status_code=CLIENT_CLOSED)
        for kind, value in events:
            (texts if kind == "text" else audio).append(value)
        _check_finish(run)
        text = "".join(texts)
        audio_out = None
        if job.wants_audio:
            data = _b64(await off_loop(encode_audio, audio, fmt))
            audio_out = AudioOutput(id=f"audio_{uuid.uuid4().hex}", expires_at=int(time.time()) + AUDIO_EXPIRY_S,
                                    data=data, transcript=text)
        return ChatCompletionResponse(
            id=rid, model=name, usage=run.usage(),
            choices=[Choice(message=AssistantMessage(content=text, audio=audio_out), finish_reason=run.finish_reason)],
        )

    @app.post("/v1/audio/speech")
    async def speech(raw: Request) -> Response:
        rid = _request_id(raw, "speech")
        req, job, fmt = await translate(tr.speech, raw)
        run = _Run(omni, job, rid, metrics)
        if not await _unless_gone(run.start(), raw):
            return Response(status_code=CLIENT_CLOSED)
        if req.stream_format == "sse":
            return StreamingResponse(_speech_sse(run), media_type="text/event-stream")
        if fmt == "pcm16":
            return StreamingResponse(_speech_pcm(run), media_type=audio_format.MEDIA_TYPES[fmt])
        events: list[tuple[str, Any]] = []
        if not await _unless_gone(_collect(run, events), raw):
            return Response(status_code=CLIENT_CLOSED)
        audio = [v for kind, v in events if kind == "audio"]
        _check_finish(run)
        return Response(await off_loop(encode_audio, audio, fmt), media_type=audio_format.MEDIA_TYPES[fmt])

    return app


REQUEST_ID_HEADER = "x-request-id"
_REQUEST_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:")


def _request_id(raw: Request, prefix: str) -> str:
    """The client's ``X-Request-Id`` (for log correlation and tests), else a fresh ``prefix-<hex>`` id."""
    given = raw.headers.get(REQUEST_ID_HEADER)
    if given is None:
        return f"{prefix}-{uuid.uuid4().hex}"
    if not 0 < len(given) <= 128 or not set(given) <= _REQUEST_ID_CHARS:
        raise APIError(400, "X-Request-Id must be 1-128 characters of [A-Za-z0-9-_.:]", param="X-Request-Id")
    return given


CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it, but logs say what happened
DISCONNECT_POLL_S = 0.25


async def _collect(run: _Run, into: list[tuple[str, Any]]) -> None:
    async for item in run.events():
        into.append(item)


async def _unless_gone(work: Coroutine[Any, Any, Any], raw: Request) -> bool:
    """Await ``work`` (submitting a request and waiting for its first output, or collecting all of it) while
    watching the client: True once it is done, False if the client disconnected first — then ``work`` is
    cancelled, which closes the engine stream and so aborts the request in every stage (a long prefill, e.g.
    while its media are being encoded, included)."""
    task = asyncio.ensure_future(work)
    while not task.done():
        await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if not task.done() and await raw.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return False
    task.result()
    return True


async def _chat_stream(run: _Run, model: str, include_usage: bool) -> AsyncIterator[str]:
    created = int(time.time())
    audio_id = f"audio_{uuid.uuid4().hex}"

    def chunk(delta: ChunkDelta, finish_reason: str | None = None) -> str:
        body: dict[str, Any] = {
            "id": run.request_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta.model_dump(exclude_none=True), "finish_reason": finish_reason,
                         "logprobs": None}],
        }
        if include_usage:
            body["usage"] = None
        return _sse(body)

    yield chunk(ChunkDelta(role="assistant", content=""))
    try:
        async for kind, value in run.events():
            if kind == "text":
                yield chunk(ChunkDelta(content=value))
            else:
                data = _b64(audio_format.pcm16_bytes(audio_format.to_int16(value)))
                yield chunk(ChunkDelta(audio={"id": audio_id, "data": data, "transcript": ""}))
    except Exception as exc:  # mid-stream failure: the status line is gone, report in-band
        yield _sse(_submit_error(exc).body())
        yield "data: [DONE]\n\n"
        return
    if run.finish_reason == "error":
        yield _sse(run.failure().body())
        yield "data: [DONE]\n\n"
        return
    if run.job.wants_audio:
        yield chunk(ChunkDelta(audio={"id": audio_id, "data": "", "transcript": run.text,
                                      "expires_at": int(time.time()) + AUDIO_EXPIRY_S}))
    yield chunk(ChunkDelta(), run.finish_reason)
    if include_usage:
        yield _sse({"id": run.request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [], "usage": run.usage().model_dump(exclude_none=True)})
    yield "data: [DONE]\n\n"


async def _speech_pcm(run: _Run) -> AsyncIterator[bytes]:
    async for kind, value in run.events():
        if kind == "audio":
            yield audio_format.pcm16_bytes(audio_format.to_int16(value))


async def _speech_sse(run: _Run) -> AsyncIterator[str]:
    try:
        async for kind, value in run.events():
            if kind == "audio":
                data = _b64(audio_format.pcm16_bytes(audio_format.to_int16(value)))
                yield _sse({"type": "speech.audio.delta", "audio": data})
    except Exception as exc:
        yield _sse(_submit_error(exc).body())
        return
    if run.finish_reason == "error":
        yield _sse(run.failure().body())
        return
    n_in, n_out = run.job.num_prompt_tokens, run.num_tokens
    yield _sse({"type": "speech.audio.done",
                "usage": {"input_tokens": n_in, "output_tokens": n_out, "total_tokens": n_in + n_out}})


DEFAULT_MODEL_NAME = "omnistage-tiny"


def serve(model: str | None = None, stage_config: str | None = None, host: str = "127.0.0.1", port: int = 8000,
          max_waiting: int | None = None, served_model_name: str | None = None, dtype: str = "float32",
          device: str = "cpu", log_level: str = "info", limits: ServerLimits | None = None,
          distributed_executor_backend: str | None = None, fast: bool = True) -> None:
    """Start the engine and serve it until interrupted (``omnistage serve``)."""
    import uvicorn

    metrics = ServerMetrics()
    omni = AsyncOmni(model, stage_config=stage_config, dtype=dtype, device=device,
                     max_waiting_requests=max_waiting, on_step=metrics.observe_step,
                     distributed_executor_backend=distributed_executor_backend, fast=fast)
    if model is None and served_model_name is None:
        served_model_name = DEFAULT_MODEL_NAME  # the built-in model's cache dir name carries a build hash
    try:
        app = create_app(omni, served_model_name, metrics, limits)
        uvicorn.run(app, host=host, port=port, log_level=log_level)
    finally:
        omni.shutdown()


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory (default: the built-in tiny model)")
    p.add_argument("--stage-config", default=None,
                   help="pipeline preset name or YAML path (default: the checkpoint family's preset)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-waiting", type=int, default=None, help="reject (429) beyond this many waiting requests")
    p.add_argument("--served-model-name", default=None, help="name clients pass as `model` (default: dir name)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-body-bytes", type=int, default=None,
                   help=f"reject (413) larger request bodies (default: {BODY_BYTES_PER_PROMPT_CHAR} bytes per prompt "
                        f"character + {BODY_BYTES_EXTRA >> 20} MiB)")
    p.add_argument("--max-prompt-chars", type=int, default=None,
                   help=f"reject prompts with more characters, before tokenizing (default: {PROMPT_CHARS_PER_TOKEN} "
                        "per token of context)")
    m = p.add_argument_group("media input (per request)")
    m.add_argument("--allowed-media-dir", default=None,
                   help="let media parts name local files (paths or file:// URLs) inside this directory "
                        "(default: none; data: URLs only)")
    m.add_argument("--max-media-items", type=int, default=DEFAULT_MAX_ITEMS, help="media parts per request (default: %(default)s)")
    m.add_argument("--max-media-bytes", type=int, default=DEFAULT_MAX_BYTES,
                   help="encoded media bytes per request, all parts together (default: %(default)s)")
    m.add_argument("--max-audio-seconds", type=float, default=DEFAULT_MAX_AUDIO_SECONDS,
                   help="seconds of audio per request, all clips and video tracks together (default: %(default)s)")
    m.add_argument("--max-image-pixels", type=int, default=DEFAULT_MAX_IMAGE_PIXELS,
                   help="pixels per image and per video frame (default: %(default)s)")
    m.add_argument("--max-video-seconds", type=float, default=DEFAULT_MAX_VIDEO_SECONDS, help="seconds per video (default: %(default)s)")
    m.add_argument("--max-video-frames", type=int, default=DEFAULT_MAX_VIDEO_FRAMES,
                   help="frames decoded per video file (before sampling) (default: %(default)s)")
    m.add_argument("--max-video-pixels", type=int, default=DEFAULT_MAX_VIDEO_PIXELS,
                   help="pixels of all frames sampled from one video (default: %(default)s)")
    r = p.add_argument_group("realtime sessions (WS /v1/realtime)")
    d = RealtimeLimits()
    r.add_argument("--realtime-max-sessions", type=int, default=d.max_sessions,
                   help="open sessions at once; more are refused (default: %(default)s)")
    r.add_argument("--realtime-max-buffered-audio-s", type=int, default=d.max_buffered_audio_s,
                   help="seconds of input audio in one uncommitted turn (default: %(default)s)")
    r.add_argument("--realtime-max-history-items", type=int, default=d.max_history_items,
                   help="conversation items kept; older ones are dropped (default: %(default)s)")
    r.add_argument("--realtime-max-history-audio-s", type=int, default=d.max_history_audio_s,
                   help="seconds of user audio kept in the conversation (default: %(default)s)")
    r.add_argument("--realtime-max-event-bytes", type=int, default=d.max_event_bytes,
                   help="bytes of one client event (default: %(default)s)")
    r.add_argument("--realtime-idle-timeout-s", type=float, default=d.idle_timeout_s,
                   help="close a session that sends nothing this long while no response runs (default: %(default)s)")
    add_engine_arguments(p)


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """Engine options shared by ``serve`` and ``generate``."""
    p.add_argument("--distributed-executor-backend", choices=list(EXECUTOR_BACKENDS), default=None,
                   help="inproc: every stage in this process; mp: one worker process per stage; ray: one Ray actor "
                        "per stage (default: the stage config's, else inproc)")
    p.add_argument("--fast", action=argparse.BooleanOptionalAction, default=True,
                   help="CPU kernels: oneDNN on weights packed at load and a fused code-predictor frame (default); "
                        "--no-fast: the reference's kernels, bit-identical to transformers' float32 arithmetic. The "
                        "fast kernels round differently: a near-tie may pick another greedy token")


def serve_from_args(args: argparse.Namespace) -> int:
    media = MediaLimits(max_items=args.max_media_items, max_bytes=args.max_media_bytes,
                        max_audio_seconds=args.max_audio_seconds, max_image_pixels=args.max_image_pixels,
                        max_video_seconds=args.max_video_seconds, max_video_frames=args.max_video_frames,
                        max_video_pixels=args.max_video_pixels, allowed_dir=args.allowed_media_dir)
    realtime = RealtimeLimits(max_sessions=args.realtime_max_sessions,
                              max_buffered_audio_s=args.realtime_max_buffered_audio_s,
                              max_history_items=args.realtime_max_history_items,
                              max_history_audio_s=args.realtime_max_history_audio_s,
                              max_event_bytes=args.realtime_max_event_bytes,
                              idle_timeout_s=args.realtime_idle_timeout_s)
    limits = ServerLimits(max_body_bytes=args.max_body_bytes, max_prompt_chars=args.max_prompt_chars, media=media,
                          realtime=realtime)
    serve(args.model, args.stage_config, args.host, args.port, args.max_waiting, args.served_model_name,
          args.dtype, args.device, limits=limits, distributed_executor_backend=args.distributed_executor_backend,
          fast=args.fast)
    return 0
