"""Wall-clock timers a benchmark attaches from outside to a built engine (or a transformers model).

Nothing in omnistage knows about them: ``attach`` wraps one bound method of one instance (or one function
of a module) and records calls, total seconds and, optionally, a work estimate per call (flops, bytes; see
roofline.py); ``detach`` puts the originals back. Without attached timers there is no cost at all.
Components of one ``StageTimers`` must not nest (each call is charged in full to its own component); use a
second ``StageTimers`` for an enclosing level (e.g. whole stage steps around their model calls).
"""

from __future__ import annotations

import functools
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# work(args, kwargs, result) -> (flops, bytes): what one call did, for the roofline bound.
WorkFn = Callable[[tuple, dict, Any], tuple[float, float]]


@dataclass
class Component:
    seconds: float = 0.0
    calls: int = 0
    flops: float = 0.0
    bytes: float = 0.0


@dataclass
class StageTimers:
    components: dict[str, Component] = field(default_factory=dict)
    _undo: list[Callable[[], None]] = field(default_factory=list)

    def reset(self) -> None:
        for name in self.components:
            self.components[name] = Component()

    def snapshot(self) -> dict[str, Component]:
        return {name: Component(**vars(c)) for name, c in self.components.items()}

    def _wrap(self, fn: Callable, name: str, work: WorkFn | None) -> Callable:
        self.components.setdefault(name, Component())

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            c = self.components[name]
            c.seconds += time.perf_counter() - start
            c.calls += 1
            if work is not None:
                f, b = work(args, kwargs, out)
                c.flops += f
                c.bytes += b
            return out

        return timed

    def attach(self, owner: Any, attr: str, name: str, work: WorkFn | None = None) -> None:
        """Time ``owner.<attr>`` (an instance's method, or a module's function) under ``name``."""
        original = getattr(owner, attr)  # AttributeError names a hook point that moved
        had_own = isinstance(owner, types.ModuleType) or attr in getattr(owner, "__dict__", {})
        setattr(owner, attr, self._wrap(original, name, work))

        def undo() -> None:
            if had_own:
                setattr(owner, attr, original)
            else:  # an instance that used its class's method: drop the shadowing attribute
                delattr(owner, attr)

        self._undo.append(undo)

    def detach(self) -> None:
        while self._undo:
            self._undo.pop()()

    def total(self) -> float:
        return sum(c.seconds for c in self.components.values())
