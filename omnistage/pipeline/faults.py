"""Fault injection for tests: make a chosen stage fail on chosen requests, on the real engine.

``OMNISTAGE_FAULTS="stage:pattern[:kind],..."`` (read when the engine is built; works in stage worker
processes too, which inherit the environment). ``pattern`` is a glob on request ids (servers accept a
client's ``X-Request-Id`` header as the id). ``kind``:
- ``request`` (default): the stage raises a ``RequestError`` for a matching request at the start of a
  step it is scheduled in: that request fails alone, the others are scheduled again.
- ``crash``: the stage raises a plain error when a matching request is scheduled. In a batch of several
  requests that failure cannot be attributed, so the engine (or the stage worker) dies; alone in its step,
  the request fails by itself.
- ``slow``: the stage sleeps ``SLOW_STEP_S`` in each step that schedules a matching request, so a client can act
  while the answer is still streaming however fast the model is (the browser test's stop button).
"""

from __future__ import annotations

import fnmatch
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass

from omnistage.core.errors import RequestError

ENV_VAR = "OMNISTAGE_FAULTS"
KINDS = ("request", "crash", "slow")
SLOW_STEP_S = 0.05


@dataclass(frozen=True)
class Fault:
    stage: str
    pattern: str
    kind: str = "request"

    def __post_init__(self) -> None:
        if not self.stage or not self.pattern:
            raise ValueError(f"a fault needs a stage and a request-id pattern, got {self!r}")
        if self.kind not in KINDS:
            raise ValueError(f"fault kind must be one of {KINDS}, got {self.kind!r}")


def parse_faults(spec: str | None) -> tuple[Fault, ...]:
    faults = []
    for item in (spec or "").split(","):
        item = item.strip()
        if item:
            parts = item.split(":")
            if len(parts) not in (2, 3):
                raise ValueError(f"{ENV_VAR}: expected 'stage:pattern[:kind]', got {item!r}")
            faults.append(Fault(*parts))
    return tuple(faults)


class FaultInjector:
    def __init__(self, faults: Iterable[Fault] = ()) -> None:
        self.faults = tuple(faults)

    @classmethod
    def from_env(cls) -> FaultInjector:
        return cls(parse_faults(os.environ.get(ENV_VAR)))

    def check(self, stage: str, req_ids: Iterable[str]) -> None:
        """Raise the configured failure if a request of this step matches."""
        if not self.faults:
            return
        req_ids = list(req_ids)
        slow = False
        for fault in self.faults:
            if fault.stage != stage:
                continue
            for req_id in req_ids:
                if fnmatch.fnmatchcase(req_id, fault.pattern):
                    if fault.kind == "slow":
                        slow = True
                    elif fault.kind == "request":
                        raise RequestError(req_id, f"injected fault in stage {stage!r}")
                    else:
                        raise RuntimeError(f"injected crash in stage {stage!r} (batch of {len(req_ids)})")
        if slow:
            time.sleep(SLOW_STEP_S)
