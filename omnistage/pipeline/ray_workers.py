"""Backend ``ray``: each stage worker is a Ray actor running the same worker body as the ``mp`` backend,
talking the same protocol over ``tcp://`` to the API process. Ray only places and watches the workers.

Placement: one placement group per engine with one bundle per stage (``threads`` CPUs, the GPUs its
``devices`` ask for, and its custom ``resources``, e.g. ``{"thinker_node": 1}`` to pin it to the node
started with that resource). Ray chooses the GPUs and sets ``CUDA_VISIBLE_DEVICES`` itself. Watch: an
actor whose ``serve`` call has ended (it died, was killed, or lost its node) is a dead worker, which fails
the engine like a dead process. The actors belong to the API process's Ray job: if that process dies, Ray
removes them.

The API process connects to a running cluster (``RAY_ADDRESS`` or ``ray start --head``'s default), or starts
a local one when there is none; every node needs the same Python environment and checkpoint path.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from omnistage.config import PipelineConfig
from omnistage.pipeline.placement import Placement
from omnistage.pipeline.remote_stage import StageWorkerError


class StageActor:
    def serve(self, commands: str, events: str) -> int:
        from omnistage.pipeline.worker import Worker

        return Worker(commands, events, parent=None).run()


class RayHandle:
    def __init__(self, actor: Any, ref: Any) -> None:
        self.actor, self.ref = actor, ref
        self.pid: int | None = None  # reported in the worker's Ready

    def exit_reason(self) -> str | None:
        if not ray.is_initialized():
            return "is gone (Ray was shut down)"
        done, _ = ray.wait([self.ref], timeout=0)
        if not done:
            return None
        try:
            return f"exited with code {ray.get(self.ref)}"
        except ray.exceptions.RayActorError as exc:
            return f"(Ray actor) died: {str(exc).splitlines()[0]}"
        except Exception as exc:
            return f"(Ray actor) failed: {exc!r}"

    def join(self, timeout: float) -> bool:
        if not ray.is_initialized():
            return True
        done, _ = ray.wait([self.ref], timeout=max(0.0, timeout))
        return bool(done)

    def terminate(self) -> None:
        if ray.is_initialized():
            ray.kill(self.actor, no_restart=True)

    kill = terminate


class RayLauncher:
    def __init__(self, pipeline: PipelineConfig, placements: Mapping[str, Placement], timeout: float) -> None:
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=True)
        self.host = ray.util.get_node_ip_address()
        bundles = []
        for name in pipeline.order:
            p = placements[name]
            bundle = {"CPU": float(p.threads), **{k: float(v) for k, v in p.resources.items()}}
            if p.num_gpus:
                bundle["GPU"] = float(p.num_gpus)
            bundles.append(bundle)
        self.bundles = bundles
        self.pg = placement_group(bundles, strategy="PACK")
        if not self.pg.wait(timeout_seconds=timeout):
            remove_placement_group(self.pg)
            raise StageWorkerError(f"Ray could not place the stage workers within {timeout} s; bundles (one per "
                                   f"stage {list(pipeline.order)}): {bundles}; cluster: {ray.cluster_resources()}")
        self.actor_cls = ray.remote(StageActor)

    def address(self, tag: str) -> str:
        return f"tcp://{self.host}"  # bound to a random port; workers on other nodes connect to it

    def start(self, index: int, name: str, commands: str, events: str, placement: Placement) -> RayHandle:
        env = {k: v for k, v in placement.env.items() if k != "CUDA_VISIBLE_DEVICES"}  # Ray assigns GPUs
        bundle = self.bundles[index]
        actor = self.actor_cls.options(
            name=None,
            num_cpus=bundle["CPU"],
            num_gpus=bundle.get("GPU", 0),
            resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=index),
            runtime_env={"env_vars": env},
            max_restarts=0,
        ).remote()
        return RayHandle(actor, actor.serve.remote(commands, events))

    def close(self) -> None:
        if ray.is_initialized():
            remove_placement_group(self.pg)  # also ends every actor still in it
