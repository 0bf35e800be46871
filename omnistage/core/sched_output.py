"""What an AR scheduler hands the runner for one step: ``{req_id: num_tokens}`` plus what the runner needs
to place those tokens (context length, block table, phase) and the requests that left.

The scheduler and the runner of a stage always live in the same process, so the output carries whole block
tables rather than deltas: the runner keeps no copy of scheduler state between steps.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Phase(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass
class SchedulerOutput:
    # Insertion order = scheduling order (decodes, then running prefills, then new admissions).
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # Per scheduled request: tokens already in its KV cache (the first scheduled position) and its whole
    # block table (a copy).
    num_computed_tokens: dict[str, int] = field(default_factory=dict)
    block_tables: dict[str, list[int]] = field(default_factory=dict)
    phases: dict[str, Phase] = field(default_factory=dict)
    sample_req_ids: set[str] = field(default_factory=set)
    # Admitted this step (first time, or again after preemption: recomputed from position 0), or admitted by
    # a step that was cancelled before it ran (told again).
    new_req_ids: set[str] = field(default_factory=set)
    # Preempted since the previous step that ran: they leave the batch and lose their KV, but live on.
    preempted_req_ids: set[str] = field(default_factory=set)
    # Finished or aborted since the previous schedule() (never a preempted one).
    finished_req_ids: set[str] = field(default_factory=set)
    # Admitted this step with a prefix-cache hit: how many leading tokens came from the cache (their KV is
    # in the first blocks of the table; the model never saw those rows for this request).
    num_cached_tokens: dict[str, int] = field(default_factory=dict)
    step_id: int = 0

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0

    @property
    def scheduled_req_ids(self) -> list[str]:
        return list(self.num_scheduled_tokens)
