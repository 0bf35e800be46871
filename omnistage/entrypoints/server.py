"""OpenAI-compatible HTTP server over ``AsyncOmni``.

Endpoints: ``POST /v1/chat/completions`` (text, or text + audio), ``POST /v1/audio/speech``,
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus).

Choices worth knowing as a client:
- ``model`` must be the served model name; anything else is 404 ``model_not_found`` (as OpenAI does).
- Sampling: ``temperature``, ``top_p``, ``seed``, ``max_tokens``/``max_completion_tokens`` (and the
  extensions ``top_k``, ``repetition_penalty``) apply to the Thinker; unset fields keep the stage
  defaults from the pipeline config. The Talker keeps its stage defaults, except that ``temperature: 0``
  makes the Talker greedy too (a request that asks for determinism gets it end to end) and ``seed``
  seeds it. The extension object ``talker: {temperature, top_p, top_k, repetition_penalty, seed,
  max_tokens}`` (``extra_body`` in the openai SDK) overrides Talker sampling field by field.
- ``stop``: stop strings are matched on the decoded text in the server; the text before the stop string
  is returned and the request is finished with ``finish_reason="stop"``. A stop string that is exactly
  one token is also given to the Thinker as a stop token id, so the Thinker ends there by itself and the
  speech covers the returned text. A multi-token stop string ends the request by aborting it in every
  stage, so audio produced after that point is cut.
- Audio: non-streamed chat returns ``message.audio.data`` in ``audio.format`` (wav, pcm16, flac);
  streamed chat sends base64 pcm16 (24 kHz mono little-endian) chunks in ``delta.audio.data`` whatever
  ``audio.format`` says (as OpenAI requires pcm16 for streaming); the text streams in ``delta.content``
  and the full transcript comes in the last audio delta.
- Speech: Qwen3-Omni speaks its *own answer*; there is no TTS-only mode, so ``input`` is sent as the
  user message and the spoken answer is returned. ``response_format`` wav / pcm / flac; ``speed`` other
  than 1.0 is rejected. ``stream_format="audio"`` streams raw pcm chunk by chunk; wav and flac are sent
  in one piece once complete (their headers carry exact sizes). ``stream_format="sse"`` sends
  ``speech.audio.delta`` events with base64 pcm and needs ``response_format="pcm"``.
- Errors use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``; schema and JSON errors
  are 400 (not FastAPI's 422); a full waiting queue is 429 with ``Retry-After``; a dead engine is 503.
- A client that disconnects mid-stream has its request aborted in every stage.
- ``X-Request-Id`` (1-128 characters of ``[A-Za-z0-9-_.:]``) becomes the engine's request id (and the
  response ``id``); without it the server makes one. A request the engine fails while serving it (and only
  that request) gets a 500 ``request_failed`` with the reason, in-band for streams.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from omnistage.core.sampling_params import SamplingParams
from omnistage.entrypoints import audio_format
from omnistage.entrypoints.detokenizer import IncrementalDetokenizer, StopStringMatcher
from omnistage.entrypoints.metrics import CONTENT_TYPE, RequestTimer, ServerMetrics
from omnistage.entrypoints.protocol import (
    AssistantMessage,
    AudioOutput,
    ChatCompletionRequest,
    ChatCompletionResponse,
    Choice,
    ChunkDelta,
    ModelCard,
    ModelList,
    SpeechRequest,
    StageSamplingParams,
    Usage,
)
from omnistage.models.family import PreparedPrompt
from omnistage.pipeline.client import EngineClient
from omnistage.pipeline.omni import AsyncOmni, EngineDeadError, QueueFullError

RETRY_AFTER_S = 1
AUDIO_EXPIRY_S = 3600
_STAGE_FIELDS = ("temperature", "top_p", "top_k", "repetition_penalty", "seed", "max_tokens")


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
    """Turns API requests into engine inputs, validating everything that can be checked up front."""

    def __init__(self, omni: EngineClient, served_model_name: str) -> None:
        self.omni = omni
        self.info = omni.info
        self.served_model_name = served_model_name

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

    def prompt(self, messages: list[dict[str, str]], param: str) -> list[int]:
        if not messages:
            raise APIError(400, "messages must not be empty", param=param)
        try:
            prepared = self.omni.render_prompt(messages)
        except ValueError as exc:
            limit = self.info.max_model_len - 1
            if "at most" in str(exc):
                raise APIError(400, f"This model's maximum context length is {limit} tokens; {exc}", param=param,
                               code="context_length_exceeded") from exc
            raise APIError(400, str(exc), param=param) from exc
        return prepared

    def params(self, thinker: dict[str, Any], talker: StageSamplingParams | None, greedy: bool,
               seed: int | None) -> dict[str, SamplingParams]:
        base = self.info.stage_sampling  # by stage name
        text = self.info.text_stage
        out: dict[str, SamplingParams] = {}
        try:
            out[text] = base[text].replace(**{k: v for k, v in thinker.items() if v is not None})
            # Every other sampling stage (the Talker) follows the request's determinism: temperature 0 makes
            # it greedy too, seed seeds it; the `talker` extension object overrides it field by field.
            for name, defaults in base.items():
                if name == text:
                    continue
                t: dict[str, Any] = {}
                if greedy:
                    t["temperature"] = 0.0
                if seed is not None:
                    t["seed"] = seed
                if talker is not None:
                    t.update({k: getattr(talker, k) for k in _STAGE_FIELDS if getattr(talker, k) is not None})
                out[name] = defaults.replace(**t)
        except ValueError as exc:
            raise APIError(400, f"invalid sampling parameters: {exc}") from exc
        return out

    def chat(self, req: ChatCompletionRequest) -> tuple[_Job, str]:
        self.check_model(req.model)
        if req.n != 1:
            raise APIError(400, "only n=1 is supported", param="n")
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
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in req.messages]
        prompt = self.prompt(messages, "messages")
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        stop_ids = self.single_token_stops(stops)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        thinker = {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
                   "repetition_penalty": req.repetition_penalty, "seed": req.seed, "max_tokens": max_tokens}
        if stop_ids:
            thinker["stop_token_ids"] = tuple(sorted(stop_ids))
        params = self.params(thinker, req.talker, req.temperature == 0, req.seed)
        return _Job(prompt, ("text", "audio") if "audio" in modalities else ("text",), params, speaker,
                    stops, frozenset(stop_ids)), fmt

    def single_token_stops(self, stops: list[str]) -> set[int]:
        out = set()
        for s in stops:
            ids = self.omni.tokenizer.encode(s, add_special_tokens=False)
            if len(ids) == 1:
                out.add(int(ids[0]))
        return out

    def speech(self, req: SpeechRequest) -> tuple[_Job, str]:
        self.check_model(req.model)
        if req.speed != 1.0:
            raise APIError(400, "speed is not supported (only 1.0): the model cannot change its speaking rate",
                           param="speed", code="unsupported_parameter")
        if not req.input.strip():
            raise APIError(400, "input must not be empty", param="input")
        try:
            fmt = audio_format.normalize_format(req.response_format)
        except ValueError as exc:
            raise APIError(400, str(exc), param="response_format") from exc
        if req.stream_format == "sse" and fmt != "pcm16":
            raise APIError(400, "stream_format 'sse' sends pcm chunks; use response_format 'pcm'",
                           param="response_format")
        speaker = self.voice(req.voice, "voice")
        prompt = self.prompt([{"role": "user", "content": req.input}], "input")
        thinker = {"temperature": req.temperature, "seed": req.seed, "max_tokens": req.max_tokens}
        params = self.params(thinker, req.talker, req.temperature == 0, req.seed)
        return _Job(prompt, ("text", "audio"), params, speaker), fmt


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
        self._agen = self.omni.generate(self.job.prompt, self.job.modalities, self.job.params,
                                        self.job.speaker, self.request_id)
        try:
            self._first = await self._agen.__anext__()
        except StopAsyncIteration as exc:
            raise APIError(500, "engine returned no output", "server_error") from exc
        except Exception as exc:
            raise _submit_error(exc) from exc
        self.timer = RequestTimer(self.metrics, self.job.num_prompt_tokens)

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
def create_app(omni: EngineClient, served_model_name: str | None = None,
               metrics: ServerMetrics | None = None) -> FastAPI:
    """The FastAPI app serving the engine client ``omni``. Pass ``metrics`` when its ``observe_step`` already
    listens to the engine's steps; otherwise a fresh ``ServerMetrics`` is created and subscribed."""
    name = served_model_name or omni.info.name
    if metrics is None:
        metrics = ServerMetrics()
        omni.add_step_listener(metrics.observe_step)
    tr = _Translator(omni, name)
    app = FastAPI(title="omnistage", version="0.1.0")
    app.state.omni, app.state.metrics, app.state.served_model_name = omni, metrics, name

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        msg = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
                        for e in errors[:5])
        code = "invalid_json" if first.get("type") == "json_invalid" else "invalid_request"
        return _error_response(APIError(400, msg or "invalid request", param=".".join(loc) or None, code=code))

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
            return _error_response(APIError(503, f"engine stopped: {omni.dead!r}", "server_error",
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
    async def chat(req: ChatCompletionRequest, raw: Request) -> Any:
        job, fmt = tr.chat(req)
        rid = _request_id(raw, "chatcmpl")
        run = _Run(omni, job, rid, metrics)
        await run.start()
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(_chat_stream(run, name, include_usage), media_type="text/event-stream")
        texts, audio = [], []
        events = await _collect_unless_gone(run, raw)
        if events is None:
            return Response(status_code=CLIENT_CLOSED)
        for kind, value in events:
            (texts if kind == "text" else audio).append(value)
        _check_finish(run)
        text = "".join(texts)
        audio_out = None
        if job.wants_audio:
            wave = torch.cat(audio) if audio else torch.zeros(0)
            audio_out = AudioOutput(id=f"audio_{uuid.uuid4().hex}", expires_at=int(time.time()) + AUDIO_EXPIRY_S,
                                    data=_b64(audio_format.encode(wave, fmt, omni.info.sample_rate)),
                                    transcript=text)
        return ChatCompletionResponse(
            id=rid, model=name, usage=run.usage(),
            choices=[Choice(message=AssistantMessage(content=text, audio=audio_out), finish_reason=run.finish_reason)],
        )

    @app.post("/v1/audio/speech")
    async def speech(req: SpeechRequest, raw: Request) -> Response:
        job, fmt = tr.speech(req)
        run = _Run(omni, job, _request_id(raw, "speech"), metrics)
        await run.start()
        if req.stream_format == "sse":
            return StreamingResponse(_speech_sse(run), media_type="text/event-stream")
        if fmt == "pcm16":
            return StreamingResponse(_speech_pcm(run), media_type=audio_format.MEDIA_TYPES[fmt])
        events = await _collect_unless_gone(run, raw)
        if events is None:
            return Response(status_code=CLIENT_CLOSED)
        audio = [v for kind, v in events if kind == "audio"]
        _check_finish(run)
        wave = torch.cat(audio) if audio else torch.zeros(0)
        return Response(audio_format.encode(wave, fmt, omni.info.sample_rate),
                        media_type=audio_format.MEDIA_TYPES[fmt])

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


async def _collect_unless_gone(run: _Run, raw: Request) -> list[tuple[str, Any]] | None:
    """All events of a non-streamed request, or None if the client disconnected first — then the request
    is aborted in every stage (cancelling the consumer closes the engine stream)."""
    items: list[tuple[str, Any]] = []

    async def consume() -> None:
        async for item in run.events():
            items.append(item)

    task = asyncio.create_task(consume())
    while not task.done():
        await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if not task.done() and await raw.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return None
    task.result()
    return items


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
          device: str = "cpu", log_level: str = "info") -> None:
    """Start the engine and serve it until interrupted (``omnistage serve``)."""
    import uvicorn

    metrics = ServerMetrics()
    omni = AsyncOmni(model, stage_config=stage_config, dtype=dtype, device=device,
                     max_waiting_requests=max_waiting, on_step=metrics.observe_step)
    if model is None and served_model_name is None:
        served_model_name = DEFAULT_MODEL_NAME  # the built-in model's cache dir name carries a build hash
    try:
        app = create_app(omni, served_model_name, metrics)
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


def serve_from_args(args: argparse.Namespace) -> int:
    serve(args.model, args.stage_config, args.host, args.port, args.max_waiting, args.served_model_name,
          args.dtype, args.device)
    return 0
