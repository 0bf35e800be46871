"""A generation stage (e.g. Code2Wav): generation scheduler + generation runner + the bridge of its incoming
edge, behind the stage protocol. One step = one batched model call over the oldest queued payload of up
to ``max_num_seqs`` requests."""

from __future__ import annotations

import time
from typing import Any

from omnistage.core.generation_scheduler import GenerationScheduler
from omnistage.models.family import Bridge, StageRequest
from omnistage.pipeline.faults import FaultInjector
from omnistage.pipeline.stage import BridgedStage, StepEvents, culprit, logger
from omnistage.runner.generation_runner import GenerationRunner


class GenerationStage(BridgedStage):
    def __init__(self, name: str, scheduler: GenerationScheduler, runner: GenerationRunner,
                 bridge: Bridge | None = None, faults: FaultInjector | None = None) -> None:
        super().__init__(name, scheduler, runner, bridge, faults or FaultInjector())

    # ---- requests ----------------------------------------------------------------------------------
    def _register(self, request: StageRequest) -> None:
        self.scheduler.add_request(request.req_id)

    def _create_record(self, request: StageRequest) -> None:
        self.runner.add_request(request.req_id)

    def _unregister(self, req_id: str) -> None:
        self.scheduler.abort(req_id)

    def _fail(self, req_id: str, message: str) -> None:
        self._end(req_id, error=message)

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
        t0 = time.monotonic()
        so = self.scheduler.schedule()
        events = self._pending.drain_into(StepEvents(self.name, started=t0))
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
        events.step_time = time.monotonic() - t0
        return events

    def stats(self) -> dict[str, Any]:
        return {
            "running": 0,
            "waiting": self.scheduler.num_requests,
            "pending_chunks": self.scheduler.num_pending,
            "records": len(self.runner.records),
            "bridge_entries": self._bridge_entries(),
            **self._memory_stats(),
        }
