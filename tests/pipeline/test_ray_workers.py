"""Backend ``ray`` on a real two-node Ray cluster on this machine (``ray start --head`` and a second node joined
with ``ray start --address``, each offering its own resource): the stage workers run as Ray actors on both
nodes, give exactly the in-process outputs; an actor that dies, or a whole node whose raylet is killed, fails
the engine within seconds, naming the stage, instead of hanging it."""

from __future__ import annotations

import os
import time

import pytest
from ray_cluster import TwoNodeCluster, loopback_driver, wait_for
from test_pipeline_parity import PROMPTS, assert_all_free, run
from test_stage_workers import STAGGERED, assert_same_runs, build, overrides

from omnistage.core.sampling_params import SamplingParams
from omnistage.models.registry import load_pipeline_config
from omnistage.pipeline.engine import OmniEngine
from omnistage.pipeline.engine_args import EngineArgs
from omnistage.pipeline.remote_stage import StageWorkerError

if os.environ.get("CI") == "true":
    import ray  # .ci/run installs the ray extra: under CI this test runs, never skips
else:
    ray = pytest.importorskip("ray")

# The Thinker on the head ("node_a"), the Talker and Code2Wav on the second node ("node_b").
PLACEMENT = {"thinker": {"node_a": 1}, "talker": {"node_b": 1}, "code2wav": {"node_b": 1}}
LONG = {"thinker": SamplingParams(temperature=0.0, max_tokens=20, min_tokens=20),
        "talker": SamplingParams(temperature=0.0, max_tokens=60, repetition_penalty=1.0)}


@pytest.fixture(scope="module")
def cluster():
    nodes = TwoNodeCluster()
    try:
        nodes.start(head_cpus=2, node_b_cpus=2)
        with loopback_driver():
            ray.init(address=nodes.address, log_to_driver=False)
            wait_for(lambda: len([n for n in ray.nodes() if n["Alive"]]) == 2, 30, "both nodes joining")
            yield nodes
    finally:
        if ray.is_initialized():
            ray.shutdown()
        nodes.stop()


def two_node_engine(ckpt) -> OmniEngine:
    config = overrides("ray")
    for stage, resources in PLACEMENT.items():
        config["stages"][stage]["resources"] = resources
    return OmniEngine(EngineArgs(str(ckpt)), load_pipeline_config("qwen3_omni", config))


@pytest.fixture(scope="module")
def ray_engine(tiny_ckpt, cluster):
    engine = two_node_engine(tiny_ckpt)
    yield engine
    engine.shutdown()


def _start_speaking(engine) -> None:
    """One long request, stepped until codec frames flow (every stage busy with it)."""
    engine.add_request(PROMPTS[1], ["text", "audio"], LONG, speaker="ethan")
    deadline = time.monotonic() + 60
    while not any(d.codes is not None for d in engine.step()):
        assert time.monotonic() < deadline


def test_ray_actors_on_two_nodes_give_the_in_process_outputs(tiny_ckpt, cluster, ray_engine):
    assert all(a.startswith("tcp://127.0.0.1:") for a in ray_engine.workers.addresses)
    assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}
    pids = ray_engine.workers.pids()
    head, node_b = ({p.pid for p in n.processes()} for n in (cluster.head, cluster.node_b))
    assert pids["thinker"] in head and {pids["talker"], pids["code2wav"]} <= node_b
    assert ray.available_resources().get("node_a", 0) == 0  # the Thinker's bundle holds the node's resource
    got = run(ray_engine, STAGGERED)
    assert_all_free(ray_engine)
    assert_same_runs(got, run(build(tiny_ckpt, "inproc"), STAGGERED), audio_tol=1e-5)


def test_a_killed_actor_fails_the_engine_without_hanging(ray_engine):
    _start_speaking(ray_engine)
    ray.kill(ray_engine.workers.handles["talker"].actor)
    killed = time.monotonic()
    with pytest.raises(StageWorkerError, match="stage 'talker' worker .*Ray actor"):
        while time.monotonic() - killed < 30:
            ray_engine.step()
    assert time.monotonic() - killed < 5
    t0 = time.monotonic()
    ray_engine.shutdown()
    assert time.monotonic() - t0 < 15
    while ray.available_resources().get("node_a", 0) != 1:  # the placement group is removed (asynchronously)
        assert time.monotonic() - t0 < 30
        time.sleep(0.1)


def test_a_lost_node_fails_its_stages_within_seconds(tiny_ckpt, cluster, ray_engine):
    # After the previous test (its engine is shut down): a fresh engine on the same two nodes.
    wait_for(lambda: ray.available_resources().get("node_b", 0) == 2, 30, "node_b's bundles returning")
    engine = two_node_engine(tiny_ckpt)
    try:
        _start_speaking(engine)
        cluster.kill_node_b()  # as if the second machine went away: its raylet, then its workers
        killed = time.monotonic()
        with pytest.raises(StageWorkerError, match="stage '(talker|code2wav)' worker .*Ray actor"):
            while time.monotonic() - killed < 60:
                engine.step()
        assert time.monotonic() - killed < 15
    finally:
        t0 = time.monotonic()
        engine.shutdown()
    assert time.monotonic() - t0 < 15
