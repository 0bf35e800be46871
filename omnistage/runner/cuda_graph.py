"""Capture/replay of one decode step over static buffers, and the flat form of a model output it keeps.

A captured step is a function of static buffers only: it reads the persistent inputs, runs the model and
returns a flat list of output tensors (the main hidden states, then the auxiliary leaves). After every
replay the same tensor objects hold that replay's values; `rebuild_output` puts them back into an
`OmniOutput` with the structure recorded at capture.

Two implementations share one interface: `CudaStepGraph` (torch.cuda.CUDAGraph) and `EagerStepGraph`, a
CPU stand-in that re-runs the function and copies into its own static outputs, so that the contract
(static outputs overwritten by each replay, structure fixed at capture) is exercised without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from omnistage.runner.aux_tree import AuxOutputError, AuxSpec, flatten_aux, unflatten_aux, validate_aux
from omnistage.runner.outputs import OmniOutput

StepFn = Callable[[], list[torch.Tensor]]


class GraphCaptureError(RuntimeError):
    """A step could not be captured or replayed as a graph."""


def flatten_output(
    output: OmniOutput, num_rows: int, expected: AuxSpec | None = None
) -> tuple[list[torch.Tensor], AuxSpec]:
    """``[hidden, *aux leaves]`` plus the aux spec; enforces the full-graph contract on ``num_rows`` rows.

    The aux tree is ``{"multimodal_outputs": ..., "intermediate": ...}``; ``expected`` (the spec seen at
    capture) makes a changed structure an error.
    """
    if not isinstance(output, OmniOutput):
        raise AuxOutputError(f"forward must return an OmniOutput, got {type(output).__name__}")
    hidden = output.hidden_states
    if not isinstance(hidden, torch.Tensor) or hidden.dim() == 0 or hidden.shape[0] != num_rows:
        got = list(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
        raise AuxOutputError(f"hidden_states must be a tensor with {num_rows} rows, got {got}")
    aux = {"multimodal_outputs": output.multimodal_outputs, "intermediate": output.intermediate}
    spec = validate_aux(aux, num_rows, expected)
    leaves, _ = flatten_aux(aux)
    return [hidden, *leaves], spec


def rebuild_output(leaves: list[torch.Tensor], spec: AuxSpec) -> OmniOutput:
    """The `OmniOutput` around the given leaf objects (no copies)."""
    if not leaves:
        raise AuxOutputError("no leaves to rebuild an output from")
    tree = unflatten_aux(leaves[1:], spec)
    return OmniOutput(
        hidden_states=leaves[0],
        multimodal_outputs=dict(tree["multimodal_outputs"]),
        intermediate=dict(tree["intermediate"]),
    )


class StepGraph(Protocol):
    def capture(self, fn: StepFn) -> list[torch.Tensor]:
        """Record ``fn``; returns its static outputs, holding the values of a run on the current inputs."""

    def replay(self) -> list[torch.Tensor]:
        """Run again on the current static inputs; returns the same tensor objects, refreshed."""


class EagerStepGraph:
    """CPU stand-in for a CUDA graph: replay re-runs the function and refreshes the static outputs."""

    def __init__(self) -> None:
        self._fn: StepFn | None = None
        self._outputs: list[torch.Tensor] = []

    def capture(self, fn: StepFn) -> list[torch.Tensor]:
        if self._fn is not None:
            raise GraphCaptureError("graph already captured")
        outs = fn()
        # Own storage, like a graph's output pool: later runs write into these, never into fresh tensors.
        self._outputs = [o.detach().clone() for o in outs]
        self._fn = fn
        return self._outputs

    def replay(self) -> list[torch.Tensor]:
        if self._fn is None:
            raise GraphCaptureError("replay before capture")
        outs = self._fn()
        if len(outs) != len(self._outputs):
            raise GraphCaptureError(f"replay produced {len(outs)} outputs, captured {len(self._outputs)}")
        for i, (static, new) in enumerate(zip(self._outputs, outs)):
            if static.shape != new.shape or static.dtype != new.dtype:
                raise GraphCaptureError(
                    f"replay output {i} is {new.dtype} {list(new.shape)}, captured {static.dtype} {list(static.shape)}"
                )
            static.copy_(new)
        return self._outputs


class CudaStepGraph:
    """A torch.cuda.CUDAGraph of one step; buckets of a runner share one memory pool."""

    def __init__(self, device: torch.device, pool: object | None = None, warmup_runs: int = 2) -> None:
        if device.type != "cuda":
            raise ValueError(f"CudaStepGraph needs a CUDA device, got {device}")
        self.device = device
        self.pool = pool
        self.warmup_runs = warmup_runs
        self._graph: torch.cuda.CUDAGraph | None = None
        self._outputs: list[torch.Tensor] = []

    def capture(self, fn: StepFn) -> list[torch.Tensor]:
        if self._graph is not None:
            raise GraphCaptureError("graph already captured")
        current = torch.cuda.current_stream(self.device)
        # Warm-up on a side stream (lazy init, allocator warm-up) as capture requires; the runs are real
        # runs on the current inputs, so they must be idempotent (a decode step rewrites the same K/V).
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(self.warmup_runs):
                fn()
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                outs = list(fn())
        except AuxOutputError:
            raise
        except Exception as exc:  # e.g. a host sync (.item(), .tolist()) inside the captured forward
            raise GraphCaptureError(f"CUDA graph capture failed: {exc}") from exc
        self._graph, self._outputs = graph, outs
        # Capture only records: run it once so the outputs hold this step's values.
        graph.replay()
        return self._outputs

    def replay(self) -> list[torch.Tensor]:
        if self._graph is None:
            raise GraphCaptureError("replay before capture")
        self._graph.replay()
        return self._outputs


def make_step_graph(device: torch.device, pool: object | None = None) -> StepGraph:
    """A CUDA graph on a CUDA device, the eager stand-in anywhere else."""
    if device.type == "cuda":
        return CudaStepGraph(device, pool)
    return EagerStepGraph()
