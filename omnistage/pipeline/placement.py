"""Where each stage worker runs: its torch device, its CPU threads, the environment its process starts with
(``CUDA_VISIBLE_DEVICES`` and the OpenMP thread count, set before torch is imported) and, under Ray, the
resources of its placement-group bundle.

A stage's ``devices`` (YAML): ``cpu``; ``cuda`` (the worker sees every GPU and uses the first); ``cuda:N``
(the worker sees only GPU N); ``N,M`` (the worker sees GPUs N and M and runs on the first). Unset: the
engine's device. Its ``threads``: torch threads; unset, the host's cores left after the stages that set
theirs are split evenly between the others (at least one each). Under Ray, Ray picks the GPUs: ``devices``
says how many the stage needs (``cuda`` / ``cuda:N``: one; a list: its length).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from omnistage.config import PipelineConfig, StageConfig


@dataclass(frozen=True)
class Placement:
    device: str  # torch device inside the worker
    threads: int
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))  # set at process start
    num_gpus: int = 0  # for a Ray bundle
    resources: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))  # Ray custom resources


def host_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _device(stage: StageConfig, default_device: str) -> tuple[str, dict[str, str], int]:
    """(device in the worker, environment, GPUs the stage needs)."""
    spec = stage.devices
    if spec is None:
        return default_device, {}, int(default_device.startswith("cuda"))
    if spec == "cpu":
        return "cpu", {"CUDA_VISIBLE_DEVICES": ""}, 0
    if spec == "cuda":
        return "cuda", {}, 1
    ids = spec.removeprefix("cuda:")
    return "cuda:0", {"CUDA_VISIBLE_DEVICES": ids}, len(ids.split(","))


def plan(pipeline: PipelineConfig, default_device: str, cores: int | None = None) -> dict[str, Placement]:
    """Placement of every stage of the pipeline, by stage name."""
    cores = host_cores() if cores is None else cores
    fixed = sum(s.threads for s in pipeline.stages if s.threads is not None)
    unset = [s for s in pipeline.stages if s.threads is None]
    share = max(1, (cores - fixed) // len(unset)) if unset else 0
    out = {}
    for stage in pipeline.stages:
        device, env, gpus = _device(stage, default_device)
        threads = stage.threads if stage.threads is not None else share
        env = {**env, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        out[stage.name] = Placement(device, threads, MappingProxyType(env), gpus, stage.resources)
    return out
