"""A request as one stage's scheduler sees it: token history, progress and lifecycle status."""

from __future__ import annotations

import enum
import operator
import time
from collections.abc import Callable, Iterable

from omnistage.core.block_hash import BlockKey, ExtraKeyFn
from omnistage.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_INPUT = "waiting_for_input"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"  # failed while being served; only this request is affected

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}
_FINISHED = frozenset(_FINISH_REASONS)
_STATUS_FOR_REASON = {reason: status for status, reason in _FINISH_REASONS.items()}


def finished_status_for(reason: str) -> RequestStatus:
    """Map a finish reason ("stop" | "length" | "abort" | "error") to its terminal status."""
    try:
        return _STATUS_FOR_REASON[reason]
    except KeyError:
        raise ValueError(
            f"finish reason must be one of {sorted(_STATUS_FOR_REASON)}, got {reason!r}"
        ) from None


class Request:
    """Mutable per-request state owned by one stage's scheduler.

    Token lists must grow through `append_prompt_token_ids` / `append_output_token_ids` so the cached
    `all_token_ids` stays in step; it is rebuilt if someone appended to the lists directly.
    """

    def __init__(
        self,
        req_id: str,
        prompt_token_ids: Iterable[int] | None = None,
        sampling_params: SamplingParams | None = None,
        eos_token_ids: Iterable[int] | int | None = (),
        arrival_time: float | None = None,
        input_finished: bool = True,
    ) -> None:
        if not isinstance(req_id, str) or not req_id:
            raise ValueError(f"req_id must be a non-empty string, got {req_id!r}")
        self.req_id = req_id
        self.prompt_token_ids: list[int] = _token_list(prompt_token_ids or (), "prompt_token_ids")
        self.sampling_params = sampling_params if sampling_params is not None else SamplingParams()
        if eos_token_ids is None:
            eos_token_ids = ()
        elif isinstance(eos_token_ids, int):
            eos_token_ids = (eos_token_ids,)
        self.eos_token_ids: tuple[int, ...] = tuple(_token_list(eos_token_ids, "eos_token_ids"))
        self.arrival_time = time.monotonic() if arrival_time is None else float(arrival_time)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.input_finished = bool(input_finished)
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        # Prefix caching. ``extra_key``: what besides token ids decides a block's KV (None: token ids only);
        # ``hit_limit``: at most this many leading tokens may come from the cache (None: no limit beyond the
        # scheduler's). Both are set by the stage that owns the request.
        self.extra_key: ExtraKeyFn | None = None
        self.hit_limit: Callable[[], int | None] | None = None
        self.block_keys: list[BlockKey] = []  # keys of its full blocks, as far as they are known
        self.block_keys_stopped = False  # a block could not be keyed: no later block gets a key
        self.num_registered_blocks = 0  # leading blocks of its current table that are in the cache
        self.num_cached_tokens = 0  # prompt tokens served from the cache at its first admission

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + output. A shared list: read it, do not mutate it."""
        self._sync_all()
        return self._all_token_ids

    def _sync_all(self) -> None:
        # Cheap length check; rebuild only if the public lists were appended to directly.
        if len(self._all_token_ids) != self.num_tokens:
            self._all_token_ids = self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_prompt_token_ids(self, token_ids: Iterable[int]) -> None:
        if self.output_token_ids:
            raise ValueError(f"request {self.req_id}: prompt tokens cannot grow after output tokens exist")
        new = _token_list(token_ids, "prompt_token_ids")
        self._sync_all()
        self.prompt_token_ids.extend(new)
        self._all_token_ids.extend(new)

    def append_output_token_ids(self, token_ids: Iterable[int]) -> None:
        new = _token_list(token_ids, "output_token_ids")
        self._sync_all()
        self.output_token_ids.extend(new)
        self._all_token_ids.extend(new)

    def __repr__(self) -> str:
        return (
            f"Request({self.req_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens}, "
            f"input_finished={self.input_finished})"
        )


def _token_list(token_ids: Iterable[int], name: str) -> list[int]:
    out: list[int] = []
    for tok in token_ids:
        # operator.index takes numpy/torch integer scalars and rejects floats; bools are refused explicitly.
        try:
            value = operator.index(tok)
        except TypeError:
            raise ValueError(f"{name} must hold non-negative ints, got {tok!r}") from None
        if isinstance(tok, bool) or value < 0:
            raise ValueError(f"{name} must hold non-negative ints, got {tok!r}")
        out.append(value)
    return out
