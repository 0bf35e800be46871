"""Walks the configured stage graph: registers each request in the stages its modalities need, routes
every stage's per-request outputs (to the client, to downstream stages), ends streams in order, aborts and
fails requests across every stage. It knows no stage names and no model family.

A request visits the stages that produce the final outputs it asked for (e.g. "text" only, or "text" and
"audio") and every stage those depend on; all of them run at once, each downstream stage taking its
upstream's outputs as they stream (a payload and then, in order, the end of the stream).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from omnistage.config import PipelineConfig
from omnistage.models.family import StageRequest
from omnistage.pipeline.client import RequestDelta
from omnistage.pipeline.stage import Stage, StepEvents


@dataclass
class _Tracked:
    req_id: str
    stages: tuple[str, ...]  # visited, topological order
    pending: set[str]  # visited stages the request has not left yet
    arrival: float = field(default_factory=time.monotonic)
    finish_reason: str | None = None


class Orchestrator:
    def __init__(
        self,
        pipeline: PipelineConfig,
        stages: Mapping[str, Stage],
        sink: Callable[[RequestDelta], None],
        on_step: Callable[[StepEvents], None] | None = None,
    ) -> None:
        missing = set(pipeline.order) - set(stages)
        if missing:
            raise ValueError(f"no stage built for {sorted(missing)}")
        self.pipeline = pipeline
        self.stages = dict(stages)
        self.order = pipeline.order
        self.downstream = {name: pipeline.downstream(name) for name in self.order}
        self.sink = sink
        self.listeners: list[Callable[[StepEvents], None]] = [on_step] if on_step is not None else []
        self.requests: dict[str, _Tracked] = {}

    @property
    def output_modalities(self) -> tuple[str, ...]:
        return tuple(s.final_output for s in self.pipeline.final_stages)

    def stages_for(self, modalities: Sequence[str]) -> tuple[str, ...]:
        """The stages a request with these output modalities visits (topological order)."""
        finals = []
        for m in modalities:
            stage = self.pipeline.final_stage(m)
            if stage is None:
                raise ValueError(f"this pipeline has no stage producing {m!r}; it produces {list(self.output_modalities)}")
            finals.append(stage.name)
        return self.pipeline.upstream_closure(tuple(finals))

    # ---- requests ----------------------------------------------------------------------------------
    def add_request(self, req_id: str, stage_requests: Mapping[str, StageRequest]) -> None:
        """Register one request in every stage named in ``stage_requests``; all or nothing."""
        if req_id in self.requests:
            raise ValueError(f"request id {req_id!r} is already in flight")
        visited = tuple(n for n in self.order if n in stage_requests)
        unknown = set(stage_requests) - set(visited)
        if unknown or not visited:
            raise ValueError(f"stage requests for unknown stages {sorted(unknown)}" if unknown else "no stage to run")
        added: list[str] = []
        try:
            for name in visited:
                self.stages[name].add_request(stage_requests[name])
                added.append(name)
        except BaseException:
            for name in added:
                self.stages[name].abort(req_id)
            raise
        self.requests[req_id] = _Tracked(req_id, visited, set(visited))

    def abort(self, req_id: str) -> bool:
        """Cancel a request in every stage and free all it holds. False if it is not in flight."""
        tracked = self.requests.pop(req_id, None)
        if tracked is None:
            return False
        for name in tracked.pending:
            self.stages[name].abort(req_id)
        self.sink(RequestDelta(req_id, finished=True, finish_reason="abort"))
        return True

    def _fail(self, req_id: str, message: str) -> None:
        tracked = self.requests.pop(req_id, None)
        if tracked is None:
            return
        for name in tracked.pending:
            self.stages[name].abort(req_id)
        self.sink(RequestDelta(req_id, finished=True, finish_reason="error", error=message))

    def has_work(self) -> bool:
        return bool(self.requests) or any(s.has_work() for s in self.stages.values())

    # ---- one engine step ---------------------------------------------------------------------------
    def step(self) -> None:
        """Step every stage that has work, upstream first, and route what each produced."""
        for name in self.order:
            stage = self.stages[name]
            if stage.has_work():
                events = stage.step()
                for listener in self.listeners:
                    listener(events)
                self._route(name, events)

    def _route(self, name: str, ev: StepEvents) -> None:
        for req_id, out in ev.client_outputs.items():
            if req_id in self.requests:
                self.sink(RequestDelta(req_id, new_token_ids=list(out.get("token_ids", ())),
                                       audio=out.get("audio"), codes=out.get("codes"),
                                       cached_tokens=out.get("cached_tokens")))
        for req_id, payload in ev.stage_outputs.items():
            tracked = self.requests.get(req_id)
            if tracked is not None:
                for down in self.downstream[name]:
                    # A downstream stage that already finished (e.g. stopped speaking) needs no more input.
                    if down in tracked.pending:
                        self.stages[down].add_input(req_id, name, payload)
        for req_id, reason in ev.finished.items():
            tracked = self.requests.get(req_id)
            if tracked is None or name not in tracked.pending:
                continue
            tracked.pending.discard(name)
            if name == tracked.stages[0]:
                tracked.finish_reason = reason  # the answer's own reason (e.g. its text hit the limit)
            for down in self.downstream[name]:
                if down in tracked.pending:
                    self.stages[down].end_input(req_id, name)
            if not tracked.pending:
                del self.requests[req_id]
                self.sink(RequestDelta(req_id, finished=True, finish_reason=tracked.finish_reason or reason))
        for req_id, message in ev.errors.items():
            self._fail(req_id, f"stage {name!r}: {message}")

    # ---- observability -----------------------------------------------------------------------------
    def resource_stats(self) -> dict[str, object]:
        stats: dict[str, object] = {name: self.stages[name].stats() for name in self.order}
        stats["requests"] = len(self.requests)
        return stats
