"""One running request: ``RequestRun`` drives an engine client's stream and turns its deltas into
("text" | "audio", value) events (stop strings, usage, latency metrics); ``unless_gone`` awaits work while
watching the client, so a client that leaves is aborted in every stage."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Coroutine
from typing import Any

from fastapi import Request

from omnistage.entrypoints.detokenizer import IncrementalDetokenizer, StopStringMatcher
from omnistage.entrypoints.errors import APIError, submit_error
from omnistage.entrypoints.metrics import RequestTimer, ServerMetrics
from omnistage.entrypoints.protocol import Usage
from omnistage.entrypoints.translation import EngineJob
from omnistage.pipeline.client import EngineClient

CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it, but logs say what happened
DISCONNECT_POLL_S = 0.25


async def collect(run: RequestRun, into: list[tuple[str, Any]]) -> None:
    async for item in run.events():
        into.append(item)


async def unless_gone(work: Coroutine[Any, Any, Any], raw: Request) -> bool:
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




class RequestRun:
    """Drives one ``AsyncOmni.generate`` call and turns deltas into ("text" | "audio", value) events.

    ``start()`` submits and waits for the first delta, so submit errors become HTTP errors before any
    response bytes are sent. Leaving ``events()`` early (stop string, client gone) closes the engine
    stream, which aborts the request in every stage.
    """

    def __init__(self, omni: EngineClient, job: EngineJob, request_id: str, metrics: ServerMetrics) -> None:
        self.omni, self.job, self.request_id = omni, job, request_id
        self.detok = IncrementalDetokenizer(omni.tokenizer)
        self.stopper = StopStringMatcher(job.stops)
        self.metrics = metrics
        self.timer: RequestTimer | None = None
        self.finish_reason: str | None = None
        self.num_tokens = 0
        self.num_frames = 0
        self.cached_tokens = 0  # prompt tokens the engine served from its prefix cache
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
            raise submit_error(exc) from exc
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
                if d.cached_tokens is not None:
                    self.cached_tokens = d.cached_tokens
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
        return Usage(prompt_tokens=n, completion_tokens=self.num_tokens, total_tokens=n + self.num_tokens,
                     prompt_tokens_details={"cached_tokens": self.cached_tokens}, completion_tokens_details=details)




def check_finish(run: RequestRun) -> None:
    if run.finish_reason == "error":
        raise run.failure()
