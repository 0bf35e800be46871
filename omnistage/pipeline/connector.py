"""In-process connector: inter-stage payloads queued per (edge, request) until the receiver consumes them.

A payload is dropped once consumed or when its request is aborted, so ``num_pending`` returning to zero
is the observable proof that nothing leaked between stages.
"""

from __future__ import annotations

from collections import defaultdict, deque
from typing import Any


class InProcConnector:
    def __init__(self) -> None:
        # (src, dst) -> req_id -> payloads in arrival order
        self._queues: dict[tuple[str, str], dict[str, deque[Any]]] = defaultdict(dict)

    def put(self, src: str, dst: str, req_id: str, payload: Any) -> None:
        self._queues[(src, dst)].setdefault(req_id, deque()).append(payload)

    def take_all(self, dst: str) -> list[tuple[str, str, Any]]:
        """Consume every payload addressed to ``dst``: (src, req_id, payload) in per-request order."""
        out = []
        for (src, d), by_req in self._queues.items():
            if d != dst:
                continue
            for req_id, q in by_req.items():
                out.extend((src, req_id, p) for p in q)
            by_req.clear()
        return out

    def drop(self, req_id: str) -> None:
        for by_req in self._queues.values():
            by_req.pop(req_id, None)

    @property
    def num_pending(self) -> int:
        return sum(len(q) for by_req in self._queues.values() for q in by_req.values())
