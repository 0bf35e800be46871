"""User-facing APIs: offline ``Omni.generate`` and streaming ``AsyncOmni``.

Both drive one ``OmniEngine``. ``Omni`` submits every prompt at once and steps until all are done
(continuous batching does the rest). ``AsyncOmni`` runs the engine loop on a background thread; calls
from the event loop are queued to that thread (the engine is single-threaded by design) and each
request's deltas come back through its own asyncio queue.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from omnistage.core.sampling_params import SamplingParams
from omnistage.models.family import PreparedPrompt
from omnistage.pipeline.client import ModelInfo, RequestDelta
from omnistage.pipeline.engine import OmniEngine, Prompt
from omnistage.pipeline.engine_args import EngineArgs
from omnistage.pipeline.remote_stage import StageWorkerError

logger = logging.getLogger("omnistage.engine")


@dataclass
class OmniRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    codes: torch.Tensor | None = None  # [num_code_groups, frames]
    audio: torch.Tensor | None = None  # float32 mono
    sample_rate: int | None = None
    finish_reason: str | None = None
    error: str | None = None  # why the request failed (finish_reason "error")
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache


class _Collector:
    """Accumulates one request's deltas into its final output."""

    def __init__(self, out: OmniRequestOutput) -> None:
        self.out = out
        self.codes: list[torch.Tensor] = []
        self.audio: list[torch.Tensor] = []
        self.done = False

    def add(self, d: RequestDelta) -> None:
        self.out.token_ids.extend(d.new_token_ids)
        if d.cached_tokens is not None:
            self.out.num_cached_tokens = d.cached_tokens
        if d.codes is not None:
            self.codes.append(d.codes)
        if d.audio is not None:
            self.audio.append(d.audio)
        if d.finished:
            self.done = True
            self.out.finish_reason = d.finish_reason
            self.out.error = d.error

    def finish(self, engine: OmniEngine, wants_audio: bool) -> OmniRequestOutput:
        self.out.text = engine.tokenizer.decode(self.out.token_ids, skip_special_tokens=True)
        if wants_audio:
            q = engine.info.num_code_groups
            if self.codes or q is not None:
                self.out.codes = torch.cat(self.codes, dim=1) if self.codes else torch.zeros(q, 0, dtype=torch.long)
            self.out.audio = torch.cat(self.audio) if self.audio else torch.zeros(0)
            self.out.sample_rate = engine.info.sample_rate
        return self.out


def _resolve_model(model: str | Path | None) -> str:
    if model is not None:
        return str(model)
    from omnistage.checkpoints import default_model_dir

    return str(default_model_dir())


def engine_args(model: str | Path | None, stage_config: str | None, dtype: str, device: str, fast: bool,
                distributed_executor_backend: str | None, quantization: str = "none",
                quantization_group_size: int | None = None, enable_prefix_caching: bool = True) -> EngineArgs:
    """``Omni`` / ``AsyncOmni``'s arguments as EngineArgs (no model: the built-in one)."""
    return EngineArgs(_resolve_model(model), stage_config, dtype, device, fast,
                      distributed_executor_backend=distributed_executor_backend, quantization=quantization,
                      quantization_group_size=quantization_group_size, enable_prefix_caching=enable_prefix_caching)


class Omni:
    """Offline generation. ``distributed_executor_backend="mp"`` (or ``"ray"``) runs every stage in its own
    worker; ``shutdown()`` (or leaving a ``with`` block, or the interpreter exiting) stops them."""

    def __init__(self, model: str | Path | None = None, stage_config: str | None = None, dtype: str = "float32",
                 device: str = "cpu", pipeline=None, fast: bool = True,
                 distributed_executor_backend: str | None = None, quantization: str = "none",
                 quantization_group_size: int | None = None, enable_prefix_caching: bool = True) -> None:
        self.engine = OmniEngine(engine_args(model, stage_config, dtype, device, fast, distributed_executor_backend,
                                              quantization, quantization_group_size, enable_prefix_caching), pipeline)

    @property
    def info(self) -> ModelInfo:
        return self.engine.info

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> Omni:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        modalities: Sequence[str] = ("text",),
        sampling_params: SamplingParams | Mapping[str, SamplingParams] | None = None,
        speaker: str | None = None,
        use_tqdm: bool = False,
        use_audio_in_video: bool = False,
    ) -> list[OmniRequestOutput]:
        """``use_audio_in_video``: videos of these prompts bring their audio track (interleaved by time)."""
        if isinstance(prompts, (str, PreparedPrompt)) or (prompts and isinstance(prompts[0], Mapping)):
            prompts = [prompts]
        engine = self.engine
        collectors: dict[str, _Collector] = {}
        # Validate every prompt before submitting any, so one bad prompt does not leave others running.
        rendered = [engine.render_prompt(p, use_audio_in_video=use_audio_in_video) for p in prompts]
        for prepared in rendered:
            rid = engine.add_request(prepared, modalities, sampling_params, speaker)
            collectors[rid] = _Collector(OmniRequestOutput(rid, list(prepared.token_ids)))
        progress = _Progress(len(collectors), enabled=use_tqdm)
        try:
            while not all(c.done for c in collectors.values()):
                for d in engine.step():
                    c = collectors.get(d.req_id)
                    if c is not None:
                        was_done = c.done
                        c.add(d)
                        if c.done and not was_done:
                            progress.update()
        except StageWorkerError:
            engine.shutdown()  # a worker is gone: the engine cannot serve; stop the others now
            raise
        finally:
            progress.close()
        wants_audio = "audio" in modalities
        return [c.finish(engine, wants_audio) for c in collectors.values()]


class _Progress:
    """A one-line progress display for long offline batches (stderr; off unless asked for)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled, self.start = total, 0, enabled, time.monotonic()
        self._draw()

    def _draw(self) -> None:
        if self.enabled:
            rate = self.done / max(time.monotonic() - self.start, 1e-9)
            sys.stderr.write(f"\rrequests {self.done}/{self.total} ({rate:.2f} req/s)")
            sys.stderr.flush()

    def update(self) -> None:
        self.done += 1
        self._draw()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an error; no request can run."""


class AsyncOmni:
    """Streaming API and the in-process engine client: ``async for delta in omni.generate(...)``;
    ``await omni.abort(request_id)``."""

    def __init__(self, model: str | Path | None = None, stage_config: str | None = None, dtype: str = "float32",
                 device: str = "cpu", pipeline=None, max_waiting_requests: int | None = None,
                 on_step: Callable[[Any], None] | None = None, fast: bool = True,
                 distributed_executor_backend: str | None = None, quantization: str = "none",
                 quantization_group_size: int | None = None, enable_prefix_caching: bool = True) -> None:
        # on_step(StepEvents) runs on the engine thread after every stage step (metrics hook).
        self.engine = OmniEngine(engine_args(model, stage_config, dtype, device, fast, distributed_executor_backend,
                                              quantization, quantization_group_size, enable_prefix_caching),
                                 pipeline, on_step)
        self.info = self.engine.info
        self.max_waiting_requests = max_waiting_requests
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.dead: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="omnistage-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def render_prompt(self, prompt: Prompt, **options: Any) -> PreparedPrompt:
        """Render and validate a prompt (tokenizer and media processing only: safe to call from any thread);
        ``options`` go to the family's prompt rendering (e.g. ``use_audio_in_video=True``)."""
        return self.engine.render_prompt(prompt, **options)

    def add_step_listener(self, fn: Callable[[Any], None]) -> None:
        self.engine.orchestrator.listeners.append(fn)

    # ---- engine thread -----------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._run_commands()
                if self.engine.has_work():
                    for d in self.engine.step():
                        self._publish(d)
                else:
                    self.engine.wait(0.05)  # also watches stage workers while idle
        except BaseException as exc:  # the engine is dead: tell every waiting client
            logger.exception("the engine loop stopped; every request in flight fails")
            self.dead = exc
            for req_id in list(self._streams):
                self._publish(RequestDelta(req_id, finished=True, finish_reason="error",
                                           error=f"engine stopped: {_describe(exc)}"))
            self._fail_commands(exc)
            self.engine.shutdown()  # stop the stage workers still running (bounded)

    def _run_commands(self) -> None:
        while True:
            try:
                fn, fut_loop, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                result = fn()
            except StageWorkerError as exc:  # the engine itself is gone, not just this call
                fut_loop.call_soon_threadsafe(_set_exception, fut, EngineDeadError(f"engine stopped: {_describe(exc)}"))
                raise
            except Exception as exc:
                fut_loop.call_soon_threadsafe(_set_exception, fut, exc)
            else:
                fut_loop.call_soon_threadsafe(_set_result, fut, result)

    def _fail_commands(self, exc: BaseException) -> None:
        while True:
            try:
                _, fut_loop, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            fut_loop.call_soon_threadsafe(_set_exception, fut, EngineDeadError(f"engine stopped: {_describe(exc)}"))

    def _publish(self, d: RequestDelta) -> None:
        entry = self._streams.get(d.req_id)
        if entry is None:
            return
        loop, q = entry
        if d.finished:
            self._streams.pop(d.req_id, None)
        loop.call_soon_threadsafe(q.put_nowait, d)

    async def _call(self, fn) -> Any:
        if self.dead is not None:
            raise EngineDeadError(f"engine stopped: {_describe(self.dead)}")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._commands.put((fn, loop, fut))
        if self.dead is not None:  # died meanwhile: nobody will run it
            self._fail_commands(self.dead)
        self.engine.wake()
        return await fut

    # ---- public API --------------------------------------------------------------------------------
    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    async def generate(
        self,
        prompt: Prompt,
        modalities: Sequence[str] = ("text",),
        sampling_params: SamplingParams | Mapping[str, SamplingParams] | None = None,
        speaker: str | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestDelta]:
        """Yield this request's deltas; the last one has ``finished=True``. Closing the iterator early
        (e.g. the client went away) aborts the request in every stage."""
        rid = request_id or f"req-{uuid.uuid4().hex}"
        q: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        accepted = False

        def submit() -> str:
            nonlocal accepted
            waiting = self.engine.num_waiting()
            if self.max_waiting_requests is not None and waiting >= self.max_waiting_requests:
                raise QueueFullError(f"{waiting} requests are already waiting")
            if rid in self._streams:
                raise ValueError(f"request id {rid!r} is already in flight")
            self._streams[rid] = (loop, q)
            try:
                out = self.engine.add_request(prompt, modalities, sampling_params, speaker, rid)
            except BaseException:
                self._streams.pop(rid, None)
                raise
            accepted = True
            return out

        try:
            await self._call(submit)
        except asyncio.CancelledError:
            # Given up while the submission was queued: it still runs on the engine thread; the abort runs
            # after it there (commands run in order) and only if it was accepted (not another request's id).
            if self.dead is None:
                await self._call(lambda: accepted and self._abort_now(rid))
            raise
        finished = False
        try:
            while True:
                d = await q.get()
                yield d
                if d.finished:
                    finished = True
                    if d.finish_reason == "error" and self.dead is not None:
                        raise EngineDeadError(f"engine stopped: {_describe(self.dead)}")
                    return
        finally:
            if not finished:
                await self.abort(rid)

    def _abort_now(self, request_id: str) -> bool:
        """Abort on the engine thread."""
        self._streams.pop(request_id, None)
        return self.engine.abort(request_id)

    async def abort(self, request_id: str) -> bool:
        if self.dead is not None:
            return False
        return await self._call(lambda: self._abort_now(request_id))

    async def resource_stats(self) -> dict[str, Any]:
        return await self._call(self.engine.resource_stats)

    def shutdown(self) -> None:
        """Stop the engine loop, then the stage workers (bounded)."""
        self._stop.set()
        self.engine.wake()
        self._thread.join(timeout=10)
        self.engine.shutdown()


class QueueFullError(RuntimeError):
    """Too many requests are waiting; retry later."""


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
