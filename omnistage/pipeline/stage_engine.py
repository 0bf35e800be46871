"""One stage as a small engine: scheduler + runner, stepped by the orchestrator.

A step returns ``StageEvents``: per-request client outputs, per-request inter-stage outputs and the
requests that finished. Freeing is done here, in one place, for both ways a request ends (finish and
abort): scheduler (KV blocks), runner (batch slot + intermediate buffer).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from omnistage.core.generation_scheduler import GenerationScheduler, GenerationSchedulerOutput
from omnistage.core.request import Request
from omnistage.core.scheduler import ARScheduler
from omnistage.runner.ar_runner import ARModelRunner
from omnistage.runner.generation_runner import GenerationRunner


@dataclass
class StageEvents:
    stage: str
    client_outputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    stage_outputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    finished: dict[str, str] = field(default_factory=dict)  # req_id -> finish reason
    step_time: float = 0.0
    num_tokens: int = 0


class ARStageEngine:
    def __init__(self, name: str, scheduler: ARScheduler, runner: ARModelRunner) -> None:
        self.name = name
        self.scheduler = scheduler
        self.runner = runner
        self._stage_finished: dict[str, str] = {}  # finished by the stage itself, reported next step

    def add_request(self, request: Request, wait_for_input: bool = False) -> None:
        self.scheduler.add_request(request, wait_for_input=wait_for_input)

    def abort(self, req_id: str) -> None:
        self.scheduler.abort_requests([req_id])
        self.runner.free(req_id)

    def has_work(self) -> bool:
        return bool(
            self.scheduler.has_unfinished() or self.scheduler.has_finished_to_report() or self._stage_finished
        )

    def step(self) -> StageEvents:
        t0 = time.perf_counter()
        so = self.scheduler.schedule()
        events = StageEvents(self.name, finished=self._stage_finished)
        self._stage_finished = {}
        if so.is_empty:
            for req_id in so.finished_req_ids:
                req = self.scheduler.get_request(req_id)
                if req is None or req.is_finished:
                    self.runner.free(req_id)
            return events
        self.runner.execute_model(so)
        result = self.runner.sample_tokens()
        updates = self.scheduler.update_from_output(so, result.sampled)
        events.client_outputs = result.client_outputs
        events.stage_outputs = result.stage_outputs
        for u in updates:
            if u.finished:
                events.finished[u.req_id] = u.finish_reason or "stop"
                self.runner.free(u.req_id)
        events.num_tokens = so.total_num_scheduled_tokens
        events.step_time = time.perf_counter() - t0
        return events

    def finish(self, req_id: str, reason: str) -> None:
        """A stage-driven finish (e.g. nothing left to speak): frees like any other finish."""
        if self.scheduler.finish_request(req_id, reason):
            self._stage_finished[req_id] = reason
        self.runner.free(req_id)

    def stats(self) -> dict[str, Any]:
        kv = self.scheduler.kv_stats()
        return {
            "running": self.scheduler.num_running,
            "waiting": self.scheduler.num_waiting,
            "kv_usage": kv.usage,
            "kv_free_blocks": kv.num_free_blocks,
            "kv_blocks": kv.num_blocks,
            "buffer_entries": len(self.runner.buffer),
            "batch_size": len(self.runner.batch),
        }


class GenerationStageEngine:
    def __init__(self, name: str, scheduler: GenerationScheduler, runner: GenerationRunner) -> None:
        self.name = name
        self.scheduler = scheduler
        self.runner = runner

    def add_request(self, req_id: str) -> None:
        self.scheduler.add_request(req_id)

    def add_input(self, req_id: str, payload: object, finished: bool) -> bool:
        return self.scheduler.add_input(req_id, payload, finished)

    def abort(self, req_id: str) -> None:
        self.scheduler.abort(req_id)

    def has_work(self) -> bool:
        return self.scheduler.num_pending > 0 or self.scheduler.has_finished_to_report()

    def step(self) -> StageEvents:
        t0 = time.perf_counter()
        so = self.scheduler.schedule()
        events = StageEvents(self.name)
        if not so.is_empty:
            events.client_outputs = self.runner.execute(so)
            events.num_tokens = len(so.req_ids)
        for req_id in self.scheduler.update_from_output(so):
            events.finished[req_id] = "stop"
        events.step_time = time.perf_counter() - t0
        return events

    def poll_finished(self) -> dict[str, str]:
        """Requests whose input ended with nothing left to run (no step needed to finish them)."""
        return {r: "stop" for r in self.scheduler.update_from_output(GenerationSchedulerOutput())}

    def stats(self) -> dict[str, Any]:
        return {
            "running": 0,
            "waiting": self.scheduler.num_requests,
            "pending_chunks": self.scheduler.num_pending,
        }
