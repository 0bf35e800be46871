"""Backend ``ray`` on a local single-node cluster: the stage workers run as Ray actors placed by one
placement group (custom resources stand for two nodes), give exactly the in-process outputs, and an actor
that dies fails the engine at once instead of hanging it."""

from __future__ import annotations

import time

import pytest
from test_pipeline_parity import PROMPTS, assert_all_free, run
from test_stage_workers import STAGGERED, assert_same_runs, build, overrides

from omnistage.core.sampling_params import SamplingParams
from omnistage.models.registry import load_pipeline_config
from omnistage.pipeline.engine import OmniEngine
from omnistage.pipeline.engine_args import EngineArgs
from omnistage.pipeline.remote_stage import StageWorkerError

ray = pytest.importorskip("ray")
NODES = {"node_a": 1, "node_b": 2}  # one "node" for the Thinker, one for the Talker and Code2Wav


@pytest.fixture(scope="module")
def ray_engine(tiny_ckpt):
    # A fresh local cluster even where one runs already (``ray start``, RAY_ADDRESS): ours has these resources.
    ray.init(address="local", num_cpus=3, resources=NODES, include_dashboard=False, log_to_driver=False)
    config = overrides("ray")
    config["stages"]["thinker"]["resources"] = {"node_a": 1}
    config["stages"]["talker"]["resources"] = {"node_b": 1}
    config["stages"]["code2wav"]["resources"] = {"node_b": 1}
    engine = OmniEngine(EngineArgs(str(tiny_ckpt)), load_pipeline_config("qwen3_omni", config))
    yield engine
    engine.shutdown()
    ray.shutdown()


def test_ray_actors_give_the_in_process_outputs(tiny_ckpt, ray_engine):
    assert all(a.startswith("tcp://") for a in ray_engine.workers.addresses)
    assert ray.available_resources().get("node_a", 0) == 0  # the Thinker's bundle holds the "node"
    got = run(ray_engine, STAGGERED)
    assert_all_free(ray_engine)
    assert_same_runs(got, run(build(tiny_ckpt, "inproc"), STAGGERED), audio_tol=1e-5)


def test_a_killed_actor_fails_the_engine_without_hanging(ray_engine):
    p = {"thinker": SamplingParams(temperature=0.0, max_tokens=20, min_tokens=20),
         "talker": SamplingParams(temperature=0.0, max_tokens=60, repetition_penalty=1.0)}
    ray_engine.add_request(PROMPTS[1], ["text", "audio"], p, speaker="ethan")
    deadline = time.monotonic() + 60
    while not any(d.codes is not None for d in ray_engine.step()):
        assert time.monotonic() < deadline
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
