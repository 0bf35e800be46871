"""The runner's persistent batch: which requests it holds, in which order, and their per-step row spans.

Requests keep their slot across steps; a removal moves the last request into the hole (as persistent
batches do to stay dense), so the order really changes when requests leave. Everything row-related is
recomputed each step from the current order and the scheduled token counts — nothing about rows is kept
from a previous step.
"""

from __future__ import annotations


class InputBatch:
    def __init__(self) -> None:
        self.req_ids: list[str] = []
        self._index: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.req_ids)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._index

    def add(self, req_id: str) -> None:
        if req_id in self._index:
            raise ValueError(f"request {req_id!r} is already in the batch")
        self._index[req_id] = len(self.req_ids)
        self.req_ids.append(req_id)

    def remove(self, req_id: str) -> None:
        i = self._index.pop(req_id, None)
        if i is None:
            return
        last = self.req_ids.pop()
        if last != req_id:
            self.req_ids[i] = last
            self._index[last] = i

    def scheduled_order(self, num_scheduled_tokens: dict[str, int]) -> list[str]:
        """This step's row order: scheduled requests join the batch (in scheduling order) if they are not
        members yet, then every scheduled member in batch order."""
        for req_id, n in num_scheduled_tokens.items():
            if n > 0 and req_id not in self._index:
                self.add(req_id)
        return [r for r in self.req_ids if num_scheduled_tokens.get(r, 0) > 0]


def request_token_spans(order: list[str], num_scheduled_tokens: dict[str, int]) -> dict[str, tuple[int, int]]:
    """``req_id -> [start, end)`` rows of this step's flattened token axis (real rows only)."""
    spans, start = {}, 0
    for req_id in order:
        n = num_scheduled_tokens[req_id]
        spans[req_id] = (start, start + n)
        start += n
    return spans


def pad_to_bucket(num_tokens: int, buckets: tuple[int, ...] | None) -> int:
    """Smallest bucket >= num_tokens (the execution size); the real count if no bucket fits or none given."""
    if not buckets:
        return num_tokens
    for b in sorted(buckets):
        if b >= num_tokens:
            return b
    return num_tokens
