"""The runner's one record per request: created when the stage admits the request, kept across preemption,
freed exactly once when the request finishes or is aborted (DESIGN §1.2-1.3).

A record holds the request (the scheduler's object, read-only here), its random stream and the model's
per-request state (``model_state``: e.g. the Talker's prefill rows and last hidden state). Block tables and
computed-token counts are not copied here: every step's scheduler output carries them.

Model state is merged with ``merge_nested`` (nested update that keeps siblings and never mutates the
caller's objects) and handed to models as read-only views, so a model returns updates instead of mutating.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from omnistage.core.request import Request


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


def frozen_view(d: Mapping[str, Any]) -> Mapping[str, Any]:
    """A read-only view of a (nested) state dict."""
    return MappingProxyType({k: frozen_view(v) if isinstance(v, Mapping) else v for k, v in d.items()})


@dataclass
class RequestState:
    req_id: str
    request: Request
    generator: torch.Generator | None
    model_state: dict[str, Any] = field(default_factory=dict)

    def merge(self, update: Mapping[str, Any] | None) -> None:
        if update:
            self.model_state = merge_nested(self.model_state, update)

    def view(self) -> Mapping[str, Any]:
        return frozen_view(self.model_state)
