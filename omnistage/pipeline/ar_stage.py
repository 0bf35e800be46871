"""An autoregressive stage (e.g. Thinker, Talker): AR scheduler + AR runner + the bridge of its incoming
edge, behind the stage protocol.

Freeing happens in one place (``_free``) for every way a request leaves: finished, aborted, failed, or
finished by the stage itself (e.g. nothing to speak). A request whose next step has no input yet (the
model's ``input_ready`` says no) is paused keeping its KV, and resumed when its bridge delivers more.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from omnistage.core.request import Request
from omnistage.core.scheduler import ARScheduler
from omnistage.models.family import Bridge, StageRequest
from omnistage.pipeline.faults import FaultInjector
from omnistage.pipeline.stage import BridgedStage, StepEvents, culprit, logger
from omnistage.runner.ar_runner import ARRunner


class ARStage(BridgedStage):
    def __init__(self, name: str, scheduler: ARScheduler, runner: ARRunner, bridge: Bridge | None = None,
                 faults: FaultInjector | None = None) -> None:
        super().__init__(name, scheduler, runner, bridge, faults or FaultInjector())
        self.model = runner.model
        self._input_ready = getattr(self.model, "input_ready", None)
        self._emits_token_ids = getattr(self.model, "emits_token_ids", True)

    # ---- requests ----------------------------------------------------------------------------------
    def _register(self, request: StageRequest) -> None:
        waits = request.prompt_token_ids is None
        req = Request(request.req_id, list(request.prompt_token_ids or ()), request.sampling_params,
                      eos_token_ids=request.eos_token_ids)
        self._attach_prefix_keys(req)
        self.scheduler.add_request(req, wait_for_input=waits)

    def _attach_prefix_keys(self, req: Request) -> None:
        """The model's view of what decides a block's KV, read from the request's record when asked (the
        scheduler asks only while the record exists)."""
        extra = getattr(self.model, "block_extra_key", None)
        limit = getattr(self.model, "cache_hit_limit", None)
        state, req_id = self.runner.state, req.req_id
        if extra is not None:
            req.extra_key = lambda start, end: extra(state(req_id), req, start, end)
        if limit is not None:
            req.hit_limit = lambda: limit(state(req_id), req)

    def _create_record(self, request: StageRequest) -> None:
        self.runner.add_request(self.scheduler.get_request(request.req_id), request.data)

    def _unregister(self, req_id: str) -> None:
        self.scheduler.abort_requests(req_id)

    def _release(self, req_id: str) -> None:
        release = getattr(self.model, "free", None)
        if release is not None:
            release(req_id)

    def _after_input(self, req_id: str) -> None:
        if self.scheduler.is_paused(req_id) and self._ready(req_id):
            self.scheduler.resume(req_id)

    def _fail(self, req_id: str, message: str) -> None:
        if self.scheduler.finish_request(req_id, "error"):
            self._pending.errors[req_id] = message
        self._free(req_id)

    def _ready(self, req_id: str) -> bool:
        if self._input_ready is None:
            return True
        return bool(self._input_ready(self.runner.state(req_id), self.runner.records[req_id].request))

    # ---- what the bridge of the incoming edge may do (ARStageInputs) --------------------------------
    def append_tokens(self, req_id: str, token_ids: Sequence[int], finished: bool) -> None:
        self.scheduler.add_input(req_id, token_ids, finished)

    def update_state(self, req_id: str, update: Mapping[str, Any]) -> None:
        self.runner.update_state(req_id, update)

    def state(self, req_id: str) -> Mapping[str, Any]:
        return self.runner.state(req_id)

    def finish(self, req_id: str, reason: str) -> None:
        """A stage-driven finish (e.g. the upstream answer left nothing to speak)."""
        if self.scheduler.finish_request(req_id, reason):
            self._pending.finished[req_id] = reason
        self._free(req_id)

    # ---- one step ----------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.scheduler.has_unfinished() or self.scheduler.has_finished_to_report() or self._pending)

    def step(self) -> StepEvents:
        t0 = time.monotonic()
        so = self.scheduler.schedule()
        events = self._pending.drain_into(StepEvents(self.name, started=t0))
        if so.is_empty:
            return events
        scheduled = so.scheduled_req_ids
        try:
            self.faults.check(self.name, scheduled)
            self.runner.execute_model(so)
            result = self.runner.sample_tokens()
        except Exception as exc:
            self.runner.cancel_step()
            self.scheduler.cancel_step(so)
            req_id = culprit(exc, scheduled)
            if req_id is None:
                raise
            logger.exception("stage %r: request %r failed in a step", self.name, req_id)
            self._fail(req_id, str(exc))
            return self._pending.drain_into(events)
        updates = self.scheduler.update_from_output(so, result.sampled)
        for u in updates:
            if self._emits_token_ids:
                tokens = list(u.new_token_ids)
                if u.finished and u.finish_reason == "stop" and tokens:
                    tokens = tokens[:-1]  # the EOS / stop token that ended the answer is not part of it
                events.client_outputs[u.req_id] = {"token_ids": tokens}
                req = self.scheduler.get_request(u.req_id)
                if req is not None and req.num_output_tokens == len(u.new_token_ids):
                    # With the first answer tokens: how much of the prompt came from the prefix cache (usage).
                    events.client_outputs[u.req_id]["cached_tokens"] = req.num_cached_tokens
            if u.finished:
                events.finished[u.req_id] = u.finish_reason or "stop"
                self._free(u.req_id)
            elif self._input_ready is not None and not self._ready(u.req_id):
                self.scheduler.pause_for_input(u.req_id)  # keeps its KV until the bridge delivers more
        for req_id, out in result.client_outputs.items():
            events.client_outputs.setdefault(req_id, {}).update(out)
        events.stage_outputs = result.stage_outputs
        events.num_tokens = so.total_num_scheduled_tokens
        events.step_time = time.monotonic() - t0
        return events

    def stats(self) -> dict[str, Any]:
        kv = self.scheduler.kv_stats()
        return {
            "running": self.scheduler.num_running,
            "waiting": self.scheduler.num_waiting,
            "kv_usage": kv.usage,
            "kv_free_blocks": kv.num_free_blocks,
            "kv_blocks": kv.num_blocks,
            "prefix_cache_queries": kv.prefix_queries,
            "prefix_cache_hits": kv.prefix_hits,
            "prefix_cached_blocks": kv.num_cached_blocks,
            "prefix_cache_evictions": kv.evictions,
            "records": len(self.runner.records),
            "batch_size": len(self.runner.batch),
            "bridge_entries": self._bridge_entries(),
            **self._memory_stats(),
            **self._model_stats(),
        }
