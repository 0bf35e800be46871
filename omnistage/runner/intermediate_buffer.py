"""Per-request model state across steps, keyed by ``req_id`` (DESIGN §1.2-1.3).

The buffer answers "whose history is this?". A step gathers entries in the current batch order and hands
them to the model; the model's updates are merged back by ``req_id``. Merging is a nested update that keeps
sibling fields and never mutates the caller's objects: stored dicts are rebuilt on the way in, so a dict
the caller still holds cannot change the buffer behind its back (and vice versa).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any


def merge_nested(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """Return a new dict: ``base`` with ``update`` merged in; nested mappings merge key by key."""
    out = dict(base)
    for key, value in update.items():
        old = out.get(key)
        if isinstance(value, Mapping) and isinstance(old, Mapping):
            out[key] = merge_nested(old, value)
        elif isinstance(value, Mapping):
            out[key] = merge_nested({}, value)
        else:
            out[key] = value
    return out


def _freeze(d: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType({k: _freeze(v) if isinstance(v, Mapping) else v for k, v in d.items()})


class IntermediateBuffer:
    def __init__(self) -> None:
        self._entries: dict[str, dict[str, Any]] = {}

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def req_ids(self) -> list[str]:
        return list(self._entries)

    def merge(self, req_id: str, update: Mapping[str, Any]) -> None:
        self._entries[req_id] = merge_nested(self._entries.get(req_id, {}), update)

    def get(self, req_id: str) -> Mapping[str, Any]:
        """Read-only view of one request's state (empty if it has none)."""
        return _freeze(self._entries.get(req_id, {}))

    def gather(self, req_ids: Iterable[str]) -> list[Mapping[str, Any]]:
        """Entries in the given (batch) order; read-only so a model must return updates, not mutate."""
        return [self.get(r) for r in req_ids]

    def scatter(self, req_ids: Iterable[str], updates: Iterable[Mapping[str, Any] | None]) -> None:
        """Merge per-row updates back by req_id (``None`` = nothing to store for that request)."""
        for req_id, update in zip(req_ids, updates, strict=True):
            if update:
                self.merge(req_id, update)

    def pop(self, req_id: str) -> None:
        self._entries.pop(req_id, None)
