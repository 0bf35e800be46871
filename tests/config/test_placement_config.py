"""Stage placement in the config (devices, threads, Ray resources, the executor backend) and what the
placement plan makes of it."""

from __future__ import annotations

import pytest

from omnistage.config import ConfigError, StageConfig
from omnistage.models.registry import load_pipeline_config
from omnistage.pipeline.engine_args import EngineArgs
from omnistage.pipeline.placement import plan


def stage(**kw) -> StageConfig:
    return StageConfig.from_dict({"name": "s", "execution": "ar", "model_part": "thinker", **kw})


@pytest.mark.parametrize("devices", ["cpu", "cuda", "cuda:1", "0", "0,1", "2,3,7"])
def test_device_specs_accepted(devices):
    assert stage(devices=devices).devices == devices


@pytest.mark.parametrize("devices", ["gpu", "cuda:", "cuda:x", "0,", ",1", "0, 1", "", 1, ["0"]])
def test_bad_device_specs_name_the_stage_and_field(devices):
    with pytest.raises(ConfigError, match="stage 's'.*devices"):
        stage(devices=devices)


@pytest.mark.parametrize("threads", [0, -1, 1.5, True, "2"])
def test_bad_thread_counts(threads):
    with pytest.raises(ConfigError, match="threads.*positive int"):
        stage(threads=threads)


@pytest.mark.parametrize("resources", [{"node": 0}, {"node": -1}, {"": 1}, {"node": True}, {"node": float("inf")},
                                       ["node"]])
def test_bad_ray_resources(resources):
    with pytest.raises(ConfigError, match="resources"):
        stage(resources=resources)


def test_every_preset_stage_survives_to_dict_and_back():
    p = load_pipeline_config("qwen3_omni", {"stages": {"talker": {"devices": "cuda:1", "threads": 3,
                                                                  "resources": {"node_b": 1}}}})
    for s in p.stages:
        assert StageConfig.from_dict(s.to_dict()) == s
    assert p.stage("talker").resources == {"node_b": 1}


def test_backend_from_yaml_and_engine_args():
    assert load_pipeline_config("qwen3_omni").distributed_executor_backend == "inproc"
    assert load_pipeline_config("qwen3_omni", {"distributed_executor_backend": "mp"}).distributed_executor_backend == "mp"
    with pytest.raises(ConfigError, match="distributed_executor_backend"):
        load_pipeline_config("qwen3_omni", {"distributed_executor_backend": "threads"})
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        EngineArgs(".", distributed_executor_backend="mpi")
    with pytest.raises(ValueError, match="worker_startup_timeout"):
        EngineArgs(".", worker_startup_timeout=0)


def test_placement_splits_cores_and_sets_the_worker_environment():
    p = load_pipeline_config("qwen3_omni", {"stages": {"thinker": {"devices": "cuda:1", "threads": 4},
                                                       "talker": {"devices": "2,3"},
                                                       "code2wav": {"devices": "cpu"}}})
    got = plan(p, "cpu", cores=10)
    t, k, c = got["thinker"], got["talker"], got["code2wav"]
    assert (t.device, t.threads, t.env["CUDA_VISIBLE_DEVICES"], t.num_gpus) == ("cuda:0", 4, "1", 1)
    assert (k.device, k.threads, k.env["CUDA_VISIBLE_DEVICES"], k.num_gpus) == ("cuda:0", 3, "2,3", 2)
    assert (c.device, c.threads, c.env["CUDA_VISIBLE_DEVICES"], c.num_gpus) == ("cpu", 3, "", 0)
    assert t.env["OMP_NUM_THREADS"] == "4" and k.env["OMP_NUM_THREADS"] == "3"
    # Unset devices: the engine's device, GPUs left as they are; never fewer than one thread.
    default = plan(load_pipeline_config("qwen3_omni"), "cuda", cores=2)
    assert {n: (x.device, x.threads, "CUDA_VISIBLE_DEVICES" in x.env, x.num_gpus) for n, x in default.items()} == {
        n: ("cuda", 1, False, 1) for n in ("thinker", "talker", "code2wav")}
