"""A generation stage (e.g. Code2Wav): generation scheduler + generation runner + the bridge of its incoming
edge, behind the stage protocol. One step = one batched model call over the oldest queued payload of up
to ``max_num_seqs`` requests."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from omnistage.core.generation_scheduler import GenerationScheduler
from omnistage.models.family import Bridge, StageRequest
from omnistage.pipeline.faults import FaultInjector
from omnistage.pipeline.stage import PendingEvents, StepEvents, culprit, logger
from omnistage.runner.generation_runner import GenerationRunner


class GenerationStage:
    def __init__(self, name: str, scheduler: GenerationScheduler, runner: GenerationRunner,
                 bridge: Bridge | None = None, faults: FaultInjector | None = None) -> None:
        self.name = name
        self.scheduler = scheduler
        self.runner = runner
        self.bridge = bridge
        self.faults = faults or FaultInjector()
        self._pending = PendingEvents()

    # ---- requests ----------------------------------------------------------------------------------
    def add_request(self, request: StageRequest) -> None:
        self.scheduler.add_request(request.req_id)
        try:
            self.runner.add_request(request.req_id)
            if self.bridge is not None:
                self.bridge.add_request(request.req_id, request.data)
        except BaseException:
            self.scheduler.abort(request.req_id)
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
        try:
            fn(*args)
        except Exception as exc:
            logger.exception("stage %r: input for request %r failed", self.name, req_id)
            self._end(req_id, error=str(exc))

    def abort(self, req_id: str) -> None:
        self.scheduler.abort(req_id)
        self._pending.finished.pop(req_id, None)
        self._pending.errors.pop(req_id, None)
        self._free(req_id)

    def _free(self, req_id: str) -> None:
        self.runner.free(req_id)
        if self.bridge is not None:
            self.bridge.drop(req_id)

    def _end(self, req_id: str, reason: str = "stop", error: str | None = None) -> None:
        """Leave the stage outside a step (stage-driven finish or failure), reported with the next step."""
        if self._alive(req_id):
            if error is None:
                self._pending.finished[req_id] = reason
            else:
                self._pending.errors[req_id] = error
        self.scheduler.abort(req_id)
        self._free(req_id)

    # ---- what the bridge of the incoming edge may do (GenerationStageInputs) ------------------------
    def add_payload(self, req_id: str, payload: Any, finished: bool) -> None:
        self.scheduler.add_input(req_id, payload, finished)

    def finish(self, req_id: str, reason: str) -> None:
        self._end(req_id, reason)

    # ---- one step ----------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending)

    def step(self) -> StepEvents:
        t0 = time.perf_counter()
        so = self.scheduler.schedule()
        events = self._pending.drain_into(StepEvents(self.name))
        if not so.is_empty:
            try:
                self.faults.check(self.name, so.req_ids)
                events.client_outputs = self.runner.execute(so)
            except Exception as exc:
                self.scheduler.cancel_step(so)
                req_id = culprit(exc, so.req_ids)
                if req_id is None:
                    raise
                logger.exception("stage %r: request %r failed in a step", self.name, req_id)
                self._end(req_id, error=str(exc))
                return self._pending.drain_into(events)
            events.num_tokens = len(so.req_ids)
        for req_id in self.scheduler.update_from_output(so):
            events.finished[req_id] = "stop"
            self._free(req_id)
        events.step_time = time.perf_counter() - t0
        return events

    def stats(self) -> dict[str, Any]:
        return {
            "running": 0,
            "waiting": self.scheduler.num_requests,
            "pending_chunks": self.scheduler.num_pending,
            "records": len(self.runner.records),
            "bridge_entries": len(self.bridge) if self.bridge is not None else 0,
        }
