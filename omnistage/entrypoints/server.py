"""OpenAI-compatible HTTP server over ``AsyncOmni``: the app and its routes. The rooms it calls: ``errors`` (the
error type and bodies), ``body`` (reading, limits, validation), ``translation`` (API requests into engine
requests), ``request_run`` (one running request), ``encoders`` (SSE chunks, PCM, audio files), ``transcriptions`` (the
speech-to-text endpoint's form, job and answers), ``limits``;
``serve_args`` holds the CLI's arguments.

Endpoints: ``POST /v1/chat/completions`` (text, audio, images and video in; text, or text + audio out),
``POST /v1/audio/speech``,
``POST /v1/audio/transcriptions`` (speech to text by the served model: ``transcriptions``), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus).

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
- A client that disconnects mid-stream has its request aborted in every stage; one that disconnects while still
  sending its body is counted as an abort too (``omnistage_requests{finish_reason="abort"}``; no traceback).
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
  ``web_search_options``, speech ``instructions``, speech ``speed`` != 1. Unknown voices (neither the
  model's nor mapped onto them: ``entrypoints.voices``, ``--voice-map``), audio formats and modalities are 400s
  too. Other unknown fields change nothing and are ignored (the SDK sends some).

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

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from omnistage.entrypoints import audio_format
from omnistage.entrypoints import speech_to_text as stt
from omnistage.entrypoints.body import read_body, run_translator
from omnistage.entrypoints.encoders import chat_completion, chat_stream, encode_audio, speech_pcm, speech_sse
from omnistage.entrypoints.errors import APIError, error_response, schema_error
from omnistage.entrypoints.limits import ServerLimits
from omnistage.entrypoints.metrics import CONTENT_TYPE, ServerMetrics
from omnistage.entrypoints.playground import router as playground_router
from omnistage.entrypoints.protocol import ModelCard, ModelList
from omnistage.entrypoints.realtime import realtime_router
from omnistage.entrypoints.request_run import CLIENT_CLOSED, RequestRun, check_finish, collect, unless_gone
from omnistage.entrypoints.transcriptions import (
    transcription_body,
    transcription_job,
    transcription_sse,
    usage,
)
from omnistage.entrypoints.translation import Translator
from omnistage.entrypoints.voices import VoiceMap
from omnistage.pipeline.client import EngineClient
from omnistage.pipeline.omni import AsyncOmni, EngineDeadError
from omnistage.runtime_env import freeze_loaded_objects

logger = logging.getLogger("omnistage.server")


class _GuardedRoute(APIRoute):
    """Turns an unexpected exception into a plain 500 response (logged with its traceback). Left to
    Starlette, the exception would be re-raised after the 500 was sent and uvicorn would then drop the
    keep-alive connection without ``Connection: close``, failing the client's next request on it."""

    def get_route_handler(self) -> Callable[[Request], Any]:
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                return await handler(request)
            except (APIError, StarletteHTTPException, RequestValidationError, ClientDisconnect):
                raise
            except Exception as exc:
                logger.exception("internal error while serving %s %s", request.method, request.url.path)
                raise APIError(500, f"internal error: {exc!r}", "server_error") from exc

        return guarded


def create_app(omni: EngineClient, served_model_name: str | None = None,
               metrics: ServerMetrics | None = None, limits: ServerLimits | None = None,
               voice_map: Mapping[str, str] | None = None) -> FastAPI:
    """The FastAPI app serving the engine client ``omni``. Pass ``metrics`` when its ``observe_step`` already
    listens to the engine's steps; otherwise a fresh ``ServerMetrics`` is created and subscribed.
    ``voice_map``: voice names mapped to the model's voices beyond the default (``entrypoints.voices``)."""
    name = served_model_name or omni.info.name
    limits = limits or ServerLimits()
    if metrics is None:
        metrics = ServerMetrics()
        omni.add_step_listener(metrics.observe_step)
    voices = VoiceMap(omni.info.voices, voice_map)
    tr = Translator(omni, name, limits, voices)
    max_body_bytes = limits.body_bytes(omni.info.max_model_len, media=bool(tr.input_kinds))
    rate = omni.info.sample_rate
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
    app.include_router(realtime_router(omni, name, metrics, pool, limits.realtime, voices,
                                       limits.max_transcript_tokens))  # WS /v1/realtime

    async def off_loop(fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    async def translate(fn: Callable[[bytearray], Any], raw: Request) -> Any:
        box = [await read_body(raw, max_body_bytes)]  # the pool thread takes the only reference
        result, error = await off_loop(run_translator, fn, box)
        if error is not None:
            raise error
        return result

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(schema_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        return error_response(APIError(exc.status_code, str(exc.detail), kind, headers=exc.headers))

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(_: Request, exc: ClientDisconnect) -> Response:
        # The client hung up while sending its body (before anything reached the engine): an ordinary abort.
        metrics.client_abort()
        return Response(status_code=CLIENT_CLOSED)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        return error_response(APIError(500, f"internal error: {exc!r}", "server_error"))

    @app.get("/health")
    async def health() -> Response:
        if omni.dead is not None:
            return error_response(APIError(503, f"engine stopped: {type(omni.dead).__name__}: {omni.dead}", "server_error",
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
        run = RequestRun(omni, job, rid, metrics)
        if not await unless_gone(run.start(), raw):
            return Response(status_code=CLIENT_CLOSED)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(chat_stream(run, name, include_usage), media_type="text/event-stream")
        events: list[tuple[str, Any]] = []
        if not await unless_gone(collect(run, events), raw):
            return Response(status_code=CLIENT_CLOSED)
        check_finish(run)
        audio = None
        if job.wants_audio:
            audio = await off_loop(encode_audio, [v for kind, v in events if kind == "audio"], fmt, rate)
        return chat_completion(run, name, events, audio)

    @app.post("/v1/audio/speech")
    async def speech(raw: Request) -> Response:
        rid = _request_id(raw, "speech")
        req, job, fmt = await translate(tr.speech, raw)
        run = RequestRun(omni, job, rid, metrics)
        if not await unless_gone(run.start(), raw):
            return Response(status_code=CLIENT_CLOSED)
        if req.stream_format == "sse":
            return StreamingResponse(speech_sse(run), media_type="text/event-stream")
        if fmt == "pcm16":
            return StreamingResponse(speech_pcm(run), media_type=audio_format.MEDIA_TYPES[fmt])
        events: list[tuple[str, Any]] = []
        if not await unless_gone(collect(run, events), raw):
            return Response(status_code=CLIENT_CLOSED)
        check_finish(run)
        audio = [v for kind, v in events if kind == "audio"]
        return Response(await off_loop(encode_audio, audio, fmt, rate), media_type=audio_format.MEDIA_TYPES[fmt])

    @app.post("/v1/audio/transcriptions")
    async def transcriptions(raw: Request) -> Response:
        rid = _request_id(raw, "transcribe")
        content_type = raw.headers.get("content-type", "")
        req, job = await translate(
            lambda body: transcription_job(tr, body, content_type, limits.max_transcript_tokens), raw)
        run = RequestRun(omni, job, rid, metrics)
        if not await unless_gone(run.start(), raw):
            return Response(status_code=CLIENT_CLOSED)
        audio_tokens = stt.audio_tokens(omni.tokenizer, job.prompt.token_ids)
        if req.stream:
            return StreamingResponse(transcription_sse(run, audio_tokens), media_type="text/event-stream")
        if not await unless_gone(collect(run, []), raw):
            return Response(status_code=CLIENT_CLOSED)
        check_finish(run)
        body = transcription_body(req, run.text, usage(run, audio_tokens))
        return PlainTextResponse(body) if isinstance(body, str) else JSONResponse(body)

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


DEFAULT_MODEL_NAME = "omnistage-tiny"


def serve(model: str | None = None, stage_config: str | None = None, host: str = "127.0.0.1", port: int = 8000,
          max_waiting: int | None = None, served_model_name: str | None = None, dtype: str = "float32",
          device: str = "cpu", log_level: str = "info", limits: ServerLimits | None = None,
          distributed_executor_backend: str | None = None, fast: bool = True,
          voice_map: Mapping[str, str] | None = None, quantization: str = "none",
          quantization_group_size: int | None = None, enable_prefix_caching: bool = True) -> None:
    """Start the engine and serve it until interrupted (``omnistage serve``)."""
    import uvicorn

    metrics = ServerMetrics()
    omni = AsyncOmni(model, stage_config=stage_config, dtype=dtype, device=device,
                     max_waiting_requests=max_waiting, on_step=metrics.observe_step,
                     distributed_executor_backend=distributed_executor_backend, fast=fast,
                     quantization=quantization, quantization_group_size=quantization_group_size,
                     enable_prefix_caching=enable_prefix_caching)
    freeze_loaded_objects()  # the engine lives as long as the server: collections need not walk it
    if model is None and served_model_name is None:
        served_model_name = DEFAULT_MODEL_NAME  # the built-in model's cache dir name carries a build hash
    try:
        app = create_app(omni, served_model_name, metrics, limits, voice_map)
        uvicorn.run(app, host=host, port=port, log_level=log_level)
    finally:
        omni.shutdown()
