"""What an AR scheduler hands the runner for one step."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from omnistage.core.request import Request


class Phase(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass
class NewRequestData:
    """A request the runner has no state for: first schedule, or re-schedule after preemption."""

    request: Request
    block_ids: list[int]  # the whole block table
    num_computed_tokens: int
    resumed_from_preemption: bool = False  # added: True when this is a recompute after preemption


@dataclass
class CachedRequestData:
    """A request the runner already holds; only the delta since its last schedule."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    # Preempted requests come back through new_reqs, so with this scheduler this is always False.
    resumed_from_preemption: bool = False


@dataclass
class SchedulerOutput:
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    # Insertion order = scheduling order (decodes, then running prefills, then new admissions).
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    phases: dict[str, Phase] = field(default_factory=dict)
    sample_req_ids: set[str] = field(default_factory=set)
    # Finished, aborted or preempted since the previous schedule(); may name requests the runner never
    # saw (aborted while queued) so per-request buffers filled before scheduling can be dropped too.
    finished_req_ids: set[str] = field(default_factory=set)
    # Added: the subset of finished_req_ids that was preempted, not finished: drop its batch/KV state
    # but keep long-lived per-request data (e.g. the intermediate buffer); it returns in new_reqs.
    preempted_req_ids: set[str] = field(default_factory=set)
    # Added: id of this step, so update_from_output can refuse a stale output.
    step_id: int = 0

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0

    @property
    def scheduled_req_ids(self) -> list[str]:
        return list(self.num_scheduled_tokens)
