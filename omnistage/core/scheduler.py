"""Token/KV scheduler for autoregressive stages (Thinker, Talker).

Continuous batching with chunked prefill, recompute-style preemption, requests that are registered
before their input exists (WAITING_FOR_INPUT), stage-driven pauses and prefix caching (an admitted request
takes the longest run of cached full blocks its tokens and extra keys match, never its last schedulable
token, and prefills the rest; its blocks are registered in the cache as they fill). One step is
schedule() -> runner -> update_from_output(); the scheduler refuses to run two steps interleaved.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from omnistage.core.block_hash import extend_block_keys
from omnistage.core.kv_cache import KVCacheManager, KVCacheStats
from omnistage.core.request import Request, RequestStatus, finished_status_for
from omnistage.core.sched_output import Phase, SchedulerOutput
from omnistage.core.scheduler_config import SchedulerConfig
from omnistage.core.validation import check_positive_int


@dataclass(frozen=True)
class RequestUpdate:
    req_id: str
    new_token_ids: list[int]  # includes a stop/eos token that ended the request
    finished: bool
    finish_reason: str | None


class ARScheduler:
    def __init__(self, config: SchedulerConfig, num_blocks: int | None = None) -> None:
        """``num_blocks``: the KV pool size (``config.resolve_num_blocks`` for a byte budget); defaults to
        ``config.num_blocks``."""
        self.config = config
        num_blocks = config.num_blocks if num_blocks is None else num_blocks
        if num_blocks is None:
            raise ValueError("the KV pool size is unknown: pass num_blocks or set config.num_blocks")
        check_positive_int(num_blocks, "num_blocks")
        if num_blocks < config.blocks_per_seq:
            raise ValueError(
                f"{num_blocks} KV blocks of {config.block_size} tokens cannot hold one request of max_model_len "
                f"{config.max_model_len}"
            )
        self.num_blocks = num_blocks
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self._requests: dict[str, Request] = {}  # every unfinished request
        self._waiting: deque[Request] = deque()  # not admitted, schedulable (+ finished ones until purged)
        self._running: dict[str, Request] = {}  # admitted (hold KV blocks), in admission order
        self._idle: dict[str, Request] = {}  # not admitted, nothing to compute until input arrives
        self._paused: set[str] = set()  # admitted but paused by the stage (pause_for_input)
        self._preempted: set[str] = set()  # preempted and not yet re-admitted
        self._finished: dict[str, Request] = {}  # finished since the last schedule(); reported next
        self._step = 0
        self._pending_step: int | None = None  # non-empty output not yet given to update_from_output
        # What a cancelled step's output told the runner, which never saw it: its admissions (req_id -> tokens
        # from the cache; the model re-makes what cached rows would have produced, e.g. the Talker's rows, in
        # the step that admits) and its preemptions. Told again by the next output that schedules them.
        self._untold_admissions: dict[str, int] = {}
        self._untold_preemptions: set[str] = set()

    # ----------------------------------------------------------------- registration and input
    def add_request(self, request: Request, wait_for_input: bool = False) -> None:
        req_id = request.req_id
        if req_id in self._requests or req_id in self._finished:
            raise ValueError(f"request {req_id!r} is already registered")
        if request.output_token_ids or request.num_computed_tokens or request.is_finished:
            raise ValueError(f"request {req_id!r} must be fresh (no output, nothing computed, not finished)")
        if request.num_prompt_tokens > self.config.max_model_len:
            raise ValueError(
                f"request {req_id!r}: prompt of {request.num_prompt_tokens} tokens is longer than "
                f"max_model_len ({self.config.max_model_len})"
            )
        if wait_for_input:
            request.input_finished = False
        elif request.input_finished and request.num_prompt_tokens == 0:
            raise ValueError(f"request {req_id!r} has an empty prompt and no more input is expected")
        self._requests[req_id] = request
        self._enqueue_or_idle(request)

    def add_input(self, req_id: str, token_ids: Sequence[int], finished: bool) -> bool:
        """Append a prompt chunk. Returns False (ignored) for an unknown or already finished request."""
        request = self._requests.get(req_id)
        if request is None:
            return False
        token_ids = list(token_ids)
        if request.input_finished:
            raise ValueError(f"request {req_id!r}: input was already marked finished")
        if request.num_tokens + len(token_ids) > self.config.max_model_len:
            raise ValueError(
                f"request {req_id!r}: input would grow to {request.num_tokens + len(token_ids)} tokens, "
                f"longer than max_model_len ({self.config.max_model_len})"
            )
        if finished and request.num_tokens + len(token_ids) == 0:
            raise ValueError(f"request {req_id!r}: input finished without any token; abort it instead")
        request.append_prompt_token_ids(token_ids)
        if finished:
            request.input_finished = True
        if req_id in self._idle and self._num_schedulable(request) > 0:
            del self._idle[req_id]
            request.status = RequestStatus.WAITING
            self._waiting.append(request)
        elif req_id in self._running and req_id not in self._paused and self._num_schedulable(request) > 0:
            request.status = RequestStatus.RUNNING
        return True

    def pause_for_input(self, req_id: str) -> None:
        """Park an admitted request (keeps its KV blocks) until resume(); others keep running."""
        if req_id not in self._running:
            raise ValueError(f"request {req_id!r} is not running; only running requests can be paused")
        self._paused.add(req_id)
        self._running[req_id].status = RequestStatus.WAITING_FOR_INPUT

    def resume(self, req_id: str) -> None:
        """Undo pause_for_input; a no-op for requests that are not paused (e.g. finished meanwhile)."""
        if req_id not in self._paused:
            return
        self._paused.discard(req_id)
        request = self._running[req_id]
        has_work = self._num_schedulable(request) > 0
        request.status = RequestStatus.RUNNING if has_work else RequestStatus.WAITING_FOR_INPUT

    def is_paused(self, req_id: str) -> bool:
        return req_id in self._paused

    # ----------------------------------------------------------------- finishing
    def abort_requests(self, req_ids: Iterable[str] | str) -> None:
        if isinstance(req_ids, str):
            req_ids = [req_ids]
        for req_id in req_ids:
            request = self._requests.get(req_id)
            if request is not None:
                self._finish(request, RequestStatus.FINISHED_ABORTED)

    def finish_request(self, req_id: str, reason: str) -> bool:
        """Stage-driven finish ("stop" | "length" | "abort"). False if the request is unknown/finished."""
        status = finished_status_for(reason)
        request = self._requests.get(req_id)
        if request is None:
            return False
        self._finish(request, status)
        return True

    def _finish(self, request: Request, status: RequestStatus) -> None:
        req_id = request.req_id
        request.status = status
        request.finish_reason = status.finish_reason
        # Admitted requests give their blocks back at once; queued ones are purged by the next schedule().
        self._running.pop(req_id, None)
        self._idle.pop(req_id, None)
        self._paused.discard(req_id)
        self._preempted.discard(req_id)
        self.kv.free(req_id)
        del self._requests[req_id]
        self._finished[req_id] = request

    # ----------------------------------------------------------------- scheduling
    def schedule(self) -> SchedulerOutput:
        if self._pending_step is not None:
            raise RuntimeError(
                f"schedule() called again before update_from_output() for step {self._pending_step}"
            )
        self._step += 1
        cfg = self.config
        finished_ids = set(self._finished)
        self._finished.clear()
        if any(r.is_finished for r in self._waiting):
            self._waiting = deque(r for r in self._waiting if not r.is_finished)

        budget = cfg.max_num_batched_tokens
        scheduled: dict[str, int] = {}
        preempted_now: list[Request] = []

        # Running requests: one token for each decode first, then continue partial prefills.
        decodes: list[Request] = []
        prefills: list[Request] = []
        for request in self._running.values():
            if request.req_id in self._paused:
                continue
            n = self._num_schedulable(request)
            if n == 0:
                if request.input_finished:
                    raise RuntimeError(
                        f"request {request.req_id!r} has nothing to compute but was not sampled"
                    )
                request.status = RequestStatus.WAITING_FOR_INPUT  # starved: waits for the next chunk
                continue
            request.status = RequestStatus.RUNNING
            is_decode = n == 1 and request.num_computed_tokens >= request.num_prompt_tokens
            (decodes if is_decode else prefills).append(request)

        for request in decodes + prefills:
            if budget == 0:
                break
            if request.status is RequestStatus.PREEMPTED:
                continue  # chosen as a victim earlier in this loop
            n = self._num_schedulable(request)
            if n > budget and not cfg.enable_chunked_prefill:
                continue
            n = min(n, budget)
            while True:
                new_blocks = self.kv.allocate_slots(request.req_id, request.num_computed_tokens + n)
                if new_blocks is not None:
                    break
                victim = self._pick_victim()
                budget += scheduled.pop(victim.req_id, 0)
                self._preempt(victim)
                preempted_now.append(victim)
                if victim is request:
                    break
            if new_blocks is None:
                continue
            scheduled[request.req_id] = n
            budget -= n

        # Admit waiting requests FCFS (preempted ones sit at the front). Never after a preemption in
        # this step: the freed blocks are for the running requests, and a request must not be both
        # dropped and re-added in one output.
        new_ids: set[str] = set()
        cached_now: dict[str, int] = {}
        if not preempted_now:
            # Digests of full blocks that requests scheduled in this step compute (not registered yet). A waiting
            # request whose next uncached block is among them waits a step and then takes it from the cache
            # instead of computing the same rows alongside (16 requests arriving at once with one system prompt).
            in_flight = self._blocks_in_flight(scheduled) if self._waiting else None
            i = 0
            while i < len(self._waiting) and budget > 0 and len(self._running) < cfg.max_num_seqs:
                request = self._waiting[i]
                n = self._num_schedulable(request)
                if n == 0:
                    del self._waiting[i]
                    request.status = RequestStatus.WAITING_FOR_INPUT
                    self._idle[request.req_id] = request
                    continue
                cached, limit = self._cached_prefix(request, n)
                hits = len(cached)
                if (in_flight is not None and hits < min(limit, len(request.block_keys))
                        and request.block_keys[hits].digest in in_flight):
                    i += 1
                    continue
                num_cached = hits * cfg.block_size
                n -= num_cached
                if n > budget and not cfg.enable_chunked_prefill:
                    break
                n = min(n, budget)
                if self.kv.allocate_slots(request.req_id, num_cached + n, cached) is None:
                    break
                del self._waiting[i]
                self.kv.note_query(self._num_schedulable(request))  # before num_computed_tokens moves
                request.num_computed_tokens = num_cached
                request.num_registered_blocks = hits
                if request.num_preemptions == 0:
                    request.num_cached_tokens = num_cached
                if num_cached:
                    cached_now[request.req_id] = num_cached
                request.status = RequestStatus.RUNNING
                self._running[request.req_id] = request
                self._preempted.discard(request.req_id)
                scheduled[request.req_id] = n
                budget -= n
                new_ids.add(request.req_id)
                if in_flight is not None:
                    in_flight.update(key.digest for key in request.block_keys[hits:])

        for req_id, num_cached in list(self._untold_admissions.items()):
            # Told when the request is next scheduled; preempted or finished before that, its re-admission (if
            # any) is told on its own.
            request = self._running.get(req_id)
            if request is None or request.num_computed_tokens != num_cached:
                del self._untold_admissions[req_id]
            elif req_id in scheduled:
                new_ids.add(req_id)
                if num_cached:
                    cached_now[req_id] = num_cached
                del self._untold_admissions[req_id]
        preempted_ids = {r.req_id for r in preempted_now}
        if self._untold_preemptions:
            # One re-admitted in this step is only told as admitted: never both dropped and re-added.
            preempted_ids |= (self._untold_preemptions & self._requests.keys()) - new_ids
            self._untold_preemptions.clear()
        out = SchedulerOutput(
            new_req_ids=new_ids,
            finished_req_ids=finished_ids,
            preempted_req_ids=preempted_ids,
            num_cached_tokens=cached_now,
            step_id=self._step,
        )
        for req_id, n in scheduled.items():
            request = self._running[req_id]
            start = request.num_computed_tokens
            end = start + n
            is_last = end == request.num_tokens
            # Decode = exactly the last known token, which is an output token. A one-token rest of a
            # prompt (or of a recompute) is still a prefill.
            is_decode = n == 1 and is_last and start >= request.num_prompt_tokens
            out.phases[req_id] = Phase.DECODE if is_decode else Phase.PREFILL
            if is_last and request.input_finished:
                out.sample_req_ids.add(req_id)
            out.num_scheduled_tokens[req_id] = n
            out.num_computed_tokens[req_id] = start
            out.block_tables[req_id] = self.kv.block_ids(req_id)
        out.total_num_scheduled_tokens = sum(scheduled.values())
        if not out.is_empty:
            self._pending_step = out.step_id
        return out

    def _num_schedulable(self, request: Request) -> int:
        # While more input may come, hold the last known token back: it is the one whose logits get
        # sampled, so it must be computed in the step where the input is known to be complete.
        known = request.num_tokens if request.input_finished else request.num_tokens - 1
        return max(0, known - request.num_computed_tokens)

    def _blocks_in_flight(self, scheduled: Mapping[str, int]) -> set[bytes] | None:
        """Digests of the keyed, unregistered blocks of the requests scheduled so far (None: caching is off).
        Asked only while requests wait for admission."""
        if not self.kv.enable_prefix_caching:
            return None
        digests: set[bytes] = set()
        for req_id in scheduled:
            request = self._running[req_id]
            digests.update(key.digest for key in request.block_keys[request.num_registered_blocks:])
        return digests

    def _cached_prefix(self, request: Request, num_schedulable: int) -> tuple[list[int], int]:
        """(cached blocks, the most blocks it may take) for a request admitted from position 0: at most
        ``num_schedulable - 1`` tokens (the last one is computed so that it can be sampled) and at most the
        request's own ``hit_limit``."""
        if not self.kv.enable_prefix_caching or request.num_computed_tokens:
            return [], 0
        limit = num_schedulable - 1
        if request.hit_limit is not None:
            own = request.hit_limit()
            if own is not None:
                limit = min(limit, own)
        num_blocks = max(0, limit) // self.config.block_size
        self._extend_keys(request, num_blocks * self.config.block_size)
        return self.kv.cached_prefix(request.block_keys[:num_blocks]), num_blocks

    def _extend_keys(self, request: Request, num_tokens: int) -> None:
        if request.block_keys_stopped:
            return
        if not extend_block_keys(
            request.block_keys, request.all_token_ids, self.config.block_size, num_tokens, request.extra_key
        ):
            request.block_keys_stopped = True

    def _register_computed_blocks(self, request: Request) -> None:
        """Put the request's newly completed blocks in the prefix cache."""
        full = request.num_computed_tokens // self.config.block_size
        if full <= request.num_registered_blocks:
            return
        self._extend_keys(request, full * self.config.block_size)
        upto = min(full, len(request.block_keys))
        first = request.num_registered_blocks
        if upto > first:
            self.kv.register_blocks(request.req_id, first, request.block_keys[first:upto])
            request.num_registered_blocks = upto

    def _pick_victim(self) -> Request:
        candidates = [r for r in self._running.values() if r.req_id not in self._paused]
        # The most recently arrived loses; admission order breaks ties.
        order = {req_id: i for i, req_id in enumerate(self._running)}
        return max(candidates, key=lambda r: (r.arrival_time, order[r.req_id]))

    def _preempt(self, request: Request) -> None:
        del self._running[request.req_id]
        self.kv.free(request.req_id)
        request.num_computed_tokens = 0
        request.num_registered_blocks = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self._preempted.add(request.req_id)
        self._waiting.appendleft(request)

    def _enqueue_or_idle(self, request: Request) -> None:
        if self._num_schedulable(request) > 0:
            request.status = RequestStatus.WAITING
            self._waiting.append(request)
        else:
            request.status = RequestStatus.WAITING_FOR_INPUT
            self._idle[request.req_id] = request

    # ----------------------------------------------------------------- results
    def update_from_output(
        self, sched_out: SchedulerOutput, sampled: Mapping[str, Sequence[int]]
    ) -> list[RequestUpdate]:
        if sched_out.is_empty:
            return []
        if self._pending_step != sched_out.step_id:
            raise RuntimeError(
                f"update_from_output() got step {sched_out.step_id}, expected step {self._pending_step}"
            )
        # Validate everything before mutating anything.
        for req_id, tokens in sampled.items():
            if len(tokens) and req_id not in sched_out.sample_req_ids:
                raise ValueError(f"sampled tokens for {req_id!r}, which was not scheduled for sampling")
        alive = [r for r in sched_out.num_scheduled_tokens if r in self._running]
        missing = [r for r in alive if r in sched_out.sample_req_ids and not len(sampled.get(r, ()))]
        if missing:
            raise ValueError(f"no sampled tokens for requests scheduled for sampling: {missing}")
        self._pending_step = None

        updates: list[RequestUpdate] = []
        for req_id in alive:
            request = self._running[req_id]
            request.num_computed_tokens += sched_out.num_scheduled_tokens[req_id]
            if self.kv.enable_prefix_caching:
                self._register_computed_blocks(request)
            if req_id not in sched_out.sample_req_ids:
                continue
            accepted: list[int] = []
            stop_status: RequestStatus | None = None
            for token in sampled[req_id]:
                request.append_output_token_ids([token])
                accepted.append(request.output_token_ids[-1])
                stop_status = self._check_stop(request)
                if stop_status is not None:
                    break  # tokens after a stop are dropped
            if stop_status is not None:
                self._finish(request, stop_status)
            updates.append(
                RequestUpdate(
                    req_id=req_id,
                    new_token_ids=accepted,
                    finished=stop_status is not None,
                    finish_reason=request.finish_reason,
                )
            )
        return updates

    def cancel_step(self, sched_out: SchedulerOutput) -> None:
        """Forget a scheduled step that did not run (it failed before any result): nothing advances, so the
        same tokens are scheduled again next step. Admissions, block allocations and preemptions made by
        schedule() stay (they are consistent on their own); what the output told the runner about them
        (admissions with their cache hits, preemptions) is told again by the next output that schedules them."""
        if self._pending_step != sched_out.step_id:
            raise RuntimeError(f"cancel_step() got step {sched_out.step_id}, expected step {self._pending_step}")
        self._pending_step = None
        for req_id in sched_out.new_req_ids:
            self._untold_admissions[req_id] = sched_out.num_computed_tokens[req_id]
        self._untold_preemptions |= sched_out.preempted_req_ids

    def _check_stop(self, request: Request) -> RequestStatus | None:
        params = request.sampling_params
        token = request.output_token_ids[-1]
        # A stop token ends the request only once min_tokens tokens precede it.
        if request.num_output_tokens > params.min_tokens:
            if not params.ignore_eos and token in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # ----------------------------------------------------------------- queries
    def get_request(self, req_id: str) -> Request | None:
        """Unfinished requests, plus finished ones until the next schedule() has reported them."""
        request = self._requests.get(req_id)
        return request if request is not None else self._finished.get(req_id)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def has_finished_to_report(self) -> bool:
        """True while finished requests wait to be reported in a schedule() output's finished_req_ids."""
        return bool(self._finished)

    @property
    def num_running(self) -> int:
        return sum(1 for r in self._running.values() if r.status is RequestStatus.RUNNING)

    @property
    def num_waiting(self) -> int:
        return len(self._requests) - self.num_running


    def kv_stats(self) -> KVCacheStats:
        return self.kv.stats()

    def check_invariants(self) -> None:
        """Consistency of queues, statuses and KV ownership (used by tests; cheap enough for debugging)."""
        waiting_ids = [r.req_id for r in self._waiting if not r.is_finished]
        groups = [waiting_ids, list(self._running), list(self._idle)]
        seen = [req_id for group in groups for req_id in group]
        assert len(seen) == len(set(seen)), "a request is in two queues"
        assert set(seen) == set(self._requests), "queues and the request table disagree"
        assert self._paused <= set(self._running), "a paused request is not admitted"
        for req_id in waiting_ids:
            status = self._requests[req_id].status
            assert status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), (req_id, status)
            assert not self.kv.has_request(req_id), f"queued request {req_id} holds blocks"
        for req_id in self._idle:
            assert self._requests[req_id].status is RequestStatus.WAITING_FOR_INPUT
            assert not self.kv.has_request(req_id)
        for req_id, request in self._running.items():
            assert request.status in (RequestStatus.RUNNING, RequestStatus.WAITING_FOR_INPUT), request
            covered = len(self.kv.block_ids(req_id)) * self.config.block_size
            assert covered >= request.num_computed_tokens, f"{req_id}: blocks do not cover computed tokens"
        assert len(self._running) <= self.config.max_num_seqs
        self.kv.check_invariants()
