"""A run's events as the API's responses: SSE chat chunks (text, base64 pcm16 audio, usage, in-band errors),
speech as raw pcm or ``speech.audio.delta`` events, whole audio files (WAV / FLAC / pcm16, ``audio_format``) and
the non-streamed chat completion."""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import torch

from omnistage.entrypoints import audio_format
from omnistage.entrypoints.errors import submit_error
from omnistage.entrypoints.protocol import (
    AssistantMessage,
    AudioOutput,
    ChatCompletionResponse,
    Choice,
    ChunkDelta,
)
from omnistage.entrypoints.request_run import RequestRun

AUDIO_EXPIRY_S = 3600


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")




async def chat_stream(run: RequestRun, model: str, include_usage: bool) -> AsyncIterator[str]:
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
        return sse(body)

    yield chunk(ChunkDelta(role="assistant", content=""))
    try:
        async for kind, value in run.events():
            if kind == "text":
                yield chunk(ChunkDelta(content=value))
            else:
                data = b64(audio_format.pcm16_bytes(audio_format.to_int16(value)))
                yield chunk(ChunkDelta(audio={"id": audio_id, "data": data, "transcript": ""}))
    except Exception as exc:  # mid-stream failure: the status line is gone, report in-band
        yield sse(submit_error(exc).body())
        yield "data: [DONE]\n\n"
        return
    if run.finish_reason == "error":
        yield sse(run.failure().body())
        yield "data: [DONE]\n\n"
        return
    if run.job.wants_audio:
        yield chunk(ChunkDelta(audio={"id": audio_id, "data": "", "transcript": run.text,
                                      "expires_at": int(time.time()) + AUDIO_EXPIRY_S}))
    yield chunk(ChunkDelta(), run.finish_reason)
    if include_usage:
        yield sse({"id": run.request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [], "usage": run.usage().model_dump(exclude_none=True)})
    yield "data: [DONE]\n\n"


async def speech_pcm(run: RequestRun) -> AsyncIterator[bytes]:
    async for kind, value in run.events():
        if kind == "audio":
            yield audio_format.pcm16_bytes(audio_format.to_int16(value))


async def run_sse(run: RequestRun, event: Callable[[str, Any], dict[str, Any] | None],
                  done: Callable[[], dict[str, Any]]) -> AsyncIterator[str]:
    """A run's events as SSE: ``event`` maps each (kind, value) to an event (None: not sent), ``done()`` gives
    the last one; a failure ends the stream with OpenAI's error body instead."""
    try:
        async for kind, value in run.events():
            body = event(kind, value)
            if body is not None:
                yield sse(body)
    except Exception as exc:
        yield sse(submit_error(exc).body())
        return
    if run.finish_reason == "error":
        yield sse(run.failure().body())
        return
    yield sse(done())


def speech_sse(run: RequestRun) -> AsyncIterator[str]:
    def event(kind: str, value: Any) -> dict[str, Any] | None:
        if kind != "audio":
            return None
        return {"type": "speech.audio.delta", "audio": b64(audio_format.pcm16_bytes(audio_format.to_int16(value)))}

    def done() -> dict[str, Any]:
        n_in, n_out = run.job.num_prompt_tokens, run.num_tokens
        return {"type": "speech.audio.done",
                "usage": {"input_tokens": n_in, "output_tokens": n_out, "total_tokens": n_in + n_out}}

    return run_sse(run, event, done)


def encode_audio(chunks: list[torch.Tensor], fmt: str, sample_rate: int) -> bytes:
    """A whole answer's audio chunks as one file (or pcm16) in ``fmt``; no chunks: an empty but valid file."""
    wave = torch.cat(chunks) if chunks else torch.zeros(0)
    return audio_format.encode(wave, fmt, sample_rate)


def chat_completion(run: RequestRun, model: str, events: list[tuple[str, Any]], audio: bytes | None
                    ) -> ChatCompletionResponse:
    """The non-streamed answer: the text events joined, and ``audio`` (the encoded file, for an answer that
    speaks) with the text as its transcript."""
    text = "".join(value for kind, value in events if kind == "text")
    audio_out = None
    if audio is not None:
        audio_out = AudioOutput(id=f"audio_{uuid.uuid4().hex}", expires_at=int(time.time()) + AUDIO_EXPIRY_S,
                                data=b64(audio), transcript=text)
    return ChatCompletionResponse(
        id=run.request_id, model=model, usage=run.usage(),
        choices=[Choice(message=AssistantMessage(content=text, audio=audio_out), finish_reason=run.finish_reason)],
    )
