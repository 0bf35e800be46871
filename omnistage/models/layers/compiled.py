"""Compile a pure tensor function lazily on first use, with the eager function as the fallback.

Small-batch decoding on CPU spends much of its time dispatching small ops one by one; ``torch.compile``
turns a loop of them into a few fused kernels. Compiling takes tens of seconds, so it happens on the first
call (which a model may make with dummy inputs when it loads, never at import), and can be turned off:
``OMNISTAGE_COMPILE=0`` in the environment, or ``enabled=False``. If compiling fails (no C++ compiler, an unsupported op), the failure is logged once and
the eager function serves every later call: the results are the same function's.
"""

from __future__ import annotations

import functools
import logging
import os
import time
import types
from collections.abc import Callable
from typing import Any, TypeVar

import torch

ENV_VAR = "OMNISTAGE_COMPILE"
# The symbolic batch dimension's range: 1 would be specialised (a second graph), so callers pad to 2.
MIN_DYNAMIC_BATCH = 2
MAX_DYNAMIC_BATCH = 1 << 16

log = logging.getLogger(__name__)

# Read while a graph is traced (dynamo guards on it): whether ``eager_in_graphs`` functions stay opaque eager ops
# (exact) or are traced into inductor's own kernels. Each ``LazyCompiled`` call sets it to its own ``exact``.
_exact_numerics = True


def compile_enabled_by_env() -> bool:
    """False when ``OMNISTAGE_COMPILE`` is 0 / false / no / off."""
    return os.environ.get(ENV_VAR, "1").strip().lower() not in ("0", "false", "no", "off")


class LazyCompiled:
    """``self(*args)`` runs ``fn(*args)``: through the graph compiled on the first call, or eagerly (``eager``,
    default ``fn``) when compiling is disabled or has failed.

    ``dynamic_batch``: dim 0 of every tensor argument is one symbolic size (>= ``MIN_DYNAMIC_BATCH``), so
    one graph serves every batch; ``dynamic_shapes``: every size is symbolic; otherwise the graph is
    specialised to the first call's shapes and torch recompiles for new ones.

    ``exact``: the graph gives the eager function's bits (``eager_in_graphs`` ops stay eager); False lets inductor
    fuse them too (faster; last bits may differ: the ``fast`` option).
    """

    def __init__(self, fn: Callable[..., Any], name: str, enabled: bool | None = None,
                 dynamic_batch: bool = False, eager: Callable[..., Any] | None = None, exact: bool = True,
                 dynamic_shapes: bool = False) -> None:
        self.fn = fn
        # What runs when not compiled: ``fn`` itself unless an eager equivalent is given (same results).
        self.eager = eager or fn
        self.name = name
        self.enabled = compile_enabled_by_env() if enabled is None else enabled
        self.dynamic_batch = dynamic_batch
        self.dynamic_shapes = dynamic_shapes  # every size symbolic (elementwise kernels over any shape)
        self.exact = exact
        self.compile_seconds: float | None = None  # wall time of the first (compiling) call
        self.failure: str | None = None
        self._graph: Callable[..., Any] | None = None

    @property
    def active(self) -> bool:
        return self.enabled and self.failure is None

    def __call__(self, *args: Any) -> Any:
        if not self.active:
            return self.eager(*args)
        if self.dynamic_batch:
            for a in args:
                if isinstance(a, torch.Tensor):
                    torch._dynamo.mark_dynamic(a, 0, min=MIN_DYNAMIC_BATCH, max=MAX_DYNAMIC_BATCH)
        if self._graph is not None:
            return self._run(self._graph, args)
        dynamic = True if self.dynamic_shapes else None if self.dynamic_batch else False
        graph = torch.compile(_with_own_code(self.fn), dynamic=dynamic, fullgraph=True)
        start = time.perf_counter()
        try:
            # Another instance's graph of the same code (another model in this process) must not turn this one's
            # constants (e.g. an attention scale) symbolic: only the marked batch dimension is dynamic.
            with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
                out = self._run(graph, args)
        except Exception as exc:  # noqa: BLE001 - any compile failure falls back to the same eager function
            self.failure = f"{type(exc).__name__}: {exc}"
            log.warning("compiling %s failed, running it eagerly from now on: %s", self.name, self.failure)
            return self.eager(*args)
        self.compile_seconds = time.perf_counter() - start
        log.info("compiled %s in %.1f s", self.name, self.compile_seconds)
        self._graph = graph
        return out

    def _run(self, graph: Callable[..., Any], args: tuple) -> Any:
        global _exact_numerics
        before, _exact_numerics = _exact_numerics, self.exact
        try:
            return graph(*args)
        finally:
            _exact_numerics = before


def _with_own_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a function or bound method) running a copy of its code object. Dynamo keeps compiled graphs per code
    object and stops compiling one after ``recompile_limit`` (8) graphs: every model instance in a process (each
    guarding on its own module) would add one to the same method's count, so the ninth model built in one process
    ran eagerly, and the dead models' graphs stayed. A code object of the instance's own holds only its graphs, and
    goes with it."""
    func = getattr(fn, "__func__", fn)
    if not isinstance(func, types.FunctionType):
        return fn
    copy = types.FunctionType(func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__,
                              func.__closure__)
    copy.__kwdefaults__, copy.__qualname__ = func.__kwdefaults__, func.__qualname__
    return types.MethodType(copy, fn.__self__) if isinstance(fn, types.MethodType) else copy


F = TypeVar("F", bound=Callable[..., Any])


def eager_in_graphs(name: str) -> Callable[[F], F]:
    """Decorate a pure tensor function (type-annotated, returns a new tensor) so that inside a
    ``torch.compile`` graph it runs as one opaque op (``omnistage::<name>``) with its eager body; outside a
    graph it is a plain call.

    Inductor generates its own kernels for reductions (sums, means, softmax) and transcendental functions
    (exp, cos), and their last bits differ from eager torch's (measured: RMSNorm ~1e-6, SiLU on a vector
    tail ~5e-7, rotary cos/sin). Keeping those few ops eager makes a compiled path give the eager path's bits,
    so the parity the eager path has with the reference carries over. A graph compiled with ``exact=False``
    traces the body instead (inductor fuses it).
    """

    def wrap(fn: F) -> F:
        op = torch.library.custom_op(f"omnistage::{name}", mutates_args=())(fn)
        op.register_fake(fn)  # the eager body runs on fake tensors too: shapes and dtypes come out right

        @functools.wraps(fn)
        def call(*args: Any) -> Any:
            return op(*args) if torch.compiler.is_compiling() and _exact_numerics else fn(*args)

        return call  # type: ignore[return-value]

    return wrap
