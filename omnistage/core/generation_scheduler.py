"""Scheduler for generation stages (Code2Wav): no KV cache, no sampling.

Each request owns a FIFO of input payloads (e.g. codec-frame chunks). A step takes the oldest pending
payload of up to max_num_seqs requests, round-robin so a chatty request cannot starve the others.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from omnistage.core.validation import check_positive_int


@dataclass
class GenerationSchedulerOutput:
    req_ids: list[str] = field(default_factory=list)  # batch order
    payloads: dict[str, object] = field(default_factory=dict)
    # Finished or aborted since the previous schedule() (informational: the stage frees on its own path).
    finished_req_ids: set[str] = field(default_factory=set)

    @property
    def is_empty(self) -> bool:
        return not self.req_ids


@dataclass
class _GenState:
    payloads: deque[object] = field(default_factory=deque)
    input_finished: bool = False
    in_flight: bool = False  # a payload was handed out and its update has not come back


class GenerationScheduler:
    def __init__(self, max_num_seqs: int) -> None:
        check_positive_int(max_num_seqs, "max_num_seqs")
        self.max_num_seqs = max_num_seqs
        # Service order: arrival order at first, then each served request moves to the back.
        self._states: OrderedDict[str, _GenState] = OrderedDict()
        self._finished: set[str] = set()

    def add_request(self, req_id: str) -> None:
        """Register a request before its input exists."""
        if req_id in self._states or req_id in self._finished:
            raise ValueError(f"request {req_id!r} is already registered")
        self._states[req_id] = _GenState()

    def add_input(self, req_id: str, payload: object, finished: bool) -> bool:
        """Queue a payload (None = no payload, e.g. a bare end-of-input). False if the request is unknown."""
        state = self._states.get(req_id)
        if state is None:
            return False  # aborted or finished meanwhile: late upstream data is dropped
        if state.input_finished:
            raise ValueError(f"request {req_id!r}: input was already marked finished")
        if payload is not None:
            state.payloads.append(payload)
        if finished:
            state.input_finished = True
        return True

    def abort(self, req_id: str) -> None:
        """Drop the request and its queued payloads; reported in the next finished_req_ids."""
        if self._states.pop(req_id, None) is not None:
            self._finished.add(req_id)

    def schedule(self) -> GenerationSchedulerOutput:
        out = GenerationSchedulerOutput(finished_req_ids=set(self._finished))
        self._finished.clear()
        for req_id, state in self._states.items():
            if len(out.req_ids) == self.max_num_seqs:
                break
            if state.in_flight or not state.payloads:
                continue
            out.req_ids.append(req_id)
            out.payloads[req_id] = state.payloads.popleft()
            state.in_flight = True
        for req_id in out.req_ids:
            self._states.move_to_end(req_id)
        return out

    def cancel_step(self, out: GenerationSchedulerOutput) -> None:
        """Put back the payloads of a step that did not run, at the front of their queues (same order next
        time)."""
        for req_id in out.req_ids:
            state = self._states.get(req_id)
            if state is not None:
                state.payloads.appendleft(out.payloads[req_id])
                state.in_flight = False

    def update_from_output(self, out: GenerationSchedulerOutput) -> list[str]:
        """Close the step; returns requests that are now finished (input finished, nothing pending).

        Also finishes requests that were never scheduled because their input ended with no payload, so
        call it after every schedule(), empty or not.
        """
        for req_id in out.req_ids:
            state = self._states.get(req_id)
            if state is not None:
                state.in_flight = False
        done = [
            req_id
            for req_id, state in self._states.items()
            if state.input_finished and not state.payloads and not state.in_flight
        ]
        for req_id in done:
            del self._states[req_id]
            self._finished.add(req_id)
        return done

    def has_work(self) -> bool:
        """A payload to run, a request whose input ended (to be finished), or finishes to report."""
        return bool(self._finished) or any(
            st.payloads or (st.input_finished and not st.in_flight) for st in self._states.values()
        )

    def has_unfinished(self) -> bool:
        return bool(self._states)

    def has_finished_to_report(self) -> bool:
        return bool(self._finished)

    @property
    def num_pending(self) -> int:
        """Queued payloads over all requests."""
        return sum(len(state.payloads) for state in self._states.values())

    @property
    def num_requests(self) -> int:
        return len(self._states)
