"""The one protocol every stage implements (AR and generation alike), and what a step reports.

Everything that crosses it is plain data — request ids, ``StageRequest``s, payload dicts of tensors,
``StepEvents`` — never a reference to another stage's scheduler, runner or buffers, so a stage can live in
another process. Pausing, per-request state and freeing are each stage's own business.

A stage in a worker process (``RemoteStage``) steps on its own: there ``has_work`` means "a step's events
have arrived" and ``step`` hands over the oldest of them, so the orchestrator routes the worker's steps one
per call, in the order they ran; ``add_request`` cannot fail there (a rejection arrives as an error event).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from omnistage.models.family import StageRequest
from omnistage.runner.memory_use import pool_bytes, weight_bytes_by_component

logger = logging.getLogger("omnistage.stage")


@dataclass
class StepEvents:
    """What one stage step produced, per request."""

    stage: str
    client_outputs: dict[str, dict[str, Any]] = field(default_factory=dict)  # e.g. token_ids, codes, audio
    stage_outputs: dict[str, dict[str, Any]] = field(default_factory=dict)  # payloads for downstream stages
    finished: dict[str, str] = field(default_factory=dict)  # req_id -> finish reason (stop / length)
    errors: dict[str, str] = field(default_factory=dict)  # req_id -> why serving it failed
    step_time: float = 0.0
    num_tokens: int = 0
    started: float = 0.0  # time.monotonic() when the step began (the stage's host clock)


class Stage(Protocol):
    name: str

    def add_request(self, request: StageRequest) -> None:
        """Register a request (validated here: a ValueError leaves the stage unchanged)."""

    def add_input(self, req_id: str, source: str, payload: Mapping[str, Any]) -> None:
        """Upstream stage ``source`` produced ``payload`` for the request (ignored once it left this stage)."""

    def end_input(self, req_id: str, source: str) -> None:
        """Upstream stage ``source`` will send nothing more for the request."""

    def abort(self, req_id: str) -> None:
        """Cancel the request here and free everything it holds; no event is reported for it."""

    def has_work(self) -> bool: ...

    def step(self) -> StepEvents: ...

    def stats(self) -> dict[str, Any]:
        """Counts of what the stage holds (a stage holding nothing reports zeros)."""


class PendingEvents:
    """Finishes and failures decided outside a step (stage-driven finish, a bridge that failed on a
    request's input), reported with the next step's events."""

    def __init__(self) -> None:
        self.finished: dict[str, str] = {}
        self.errors: dict[str, str] = {}

    def __bool__(self) -> bool:
        return bool(self.finished or self.errors)

    def drain_into(self, events: StepEvents) -> StepEvents:
        events.finished.update(self.finished)
        events.errors.update(self.errors)
        self.finished, self.errors = {}, {}
        return events


class BridgedStage:
    """What AR and generation stages share: upstream input goes through the stage's bridge, a failure while
    handling one request's input fails that request, and a request leaves through one freeing path.

    Subclasses provide ``_register`` / ``_unregister`` (their scheduler's add and abort), ``_fail`` and
    optionally ``_after_input`` (e.g. resume a paused request) and ``_release`` (model-held state).
    """

    def __init__(self, name: str, scheduler: Any, runner: Any, bridge: Any, faults: Any) -> None:
        self.name = name
        self.scheduler = scheduler
        self.runner = runner
        self.bridge = bridge
        self.faults = faults
        self._pending = PendingEvents()
        self._memory: dict[str, Any] | None = None

    def add_request(self, request: StageRequest) -> None:
        self._register(request)
        try:
            self._create_record(request)
            if self.bridge is not None:
                self.bridge.add_request(request.req_id, request.data)
        except BaseException:
            self._unregister(request.req_id)
            self._free(request.req_id)
            raise

    def _alive(self, req_id: str) -> bool:
        return req_id in self.runner.records

    def add_input(self, req_id: str, source: str, payload: Mapping[str, Any]) -> None:
        if self._alive(req_id):
            self._guarded(req_id, self.bridge.on_input, req_id, payload, self)

    def end_input(self, req_id: str, source: str) -> None:
        if self._alive(req_id):
            self._guarded(req_id, self.bridge.on_end, req_id, self)

    def _guarded(self, req_id: str, fn, *args: Any) -> None:
        """Run a bridge call for one request: its failure fails that request only."""
        try:
            fn(*args)
        except Exception as exc:
            logger.exception("stage %r: input for request %r failed", self.name, req_id)
            self._fail(req_id, str(exc))
            return
        if self._alive(req_id):
            self._after_input(req_id)

    def abort(self, req_id: str) -> None:
        self._unregister(req_id)
        self._pending.finished.pop(req_id, None)
        self._pending.errors.pop(req_id, None)
        self._free(req_id)

    def _free(self, req_id: str) -> None:
        """The one place a request's state in this stage is dropped (finish, abort, failure)."""
        self.runner.free(req_id)
        if self.bridge is not None:
            self.bridge.drop(req_id)
        self._release(req_id)

    # ---- per kind -----------------------------------------------------------------------------------
    def _register(self, request: StageRequest) -> None:
        raise NotImplementedError

    def _create_record(self, request: StageRequest) -> None:
        raise NotImplementedError

    def _unregister(self, req_id: str) -> None:
        raise NotImplementedError

    def _fail(self, req_id: str, message: str) -> None:
        raise NotImplementedError

    def _after_input(self, req_id: str) -> None:
        pass

    def _release(self, req_id: str) -> None:
        pass

    def _bridge_entries(self) -> int:
        return len(self.bridge) if self.bridge is not None else 0

    def _memory_stats(self) -> dict[str, Any]:
        """Bytes the stage holds: weights per component and its KV pool (both fixed once loaded: measured
        on the first query)."""
        if self._memory is None:
            self._memory = {"weight_bytes": weight_bytes_by_component(self.runner.model),
                            "kv_cache_bytes": pool_bytes(getattr(self.runner, "kv_caches", None))}
        return self._memory

    def _model_stats(self) -> dict[str, Any]:
        """What the stage model says it holds (its optional ``resource_stats()``)."""
        fn = getattr(self.runner.model, "resource_stats", None)
        return dict(fn()) if fn is not None else {}


def culprit(exc: BaseException, scheduled: list[str]) -> str | None:
    """The one request a step failure belongs to, if it can be told: the request a ``RequestError``
    names, or the only request of the step. None: the failure belongs to the whole batch."""
    req_id = getattr(exc, "req_id", None)
    if isinstance(req_id, str) and req_id in scheduled:
        return req_id
    return scheduled[0] if len(scheduled) == 1 else None
