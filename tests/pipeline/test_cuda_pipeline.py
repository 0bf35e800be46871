"""The whole pipeline on a CUDA device (skipped without one): eager and CUDA-graph runners against the CPU run,
which the parity tests tie to transformers.

Float32 with TF32 off, so the GPU's matmuls and convolutions differ from the CPU's only in summation order:
greedy tokens and codec codes must be identical, waveforms within 1e-4. Concurrency with staggered arrivals and
an abort, resources freed afterwards, and the graph runner must actually replay captured graphs.
"""

from __future__ import annotations

import pytest
import torch
from test_pipeline_parity import PROMPTS, assert_all_free, make_engine, run

from omnistage.models.registry import load_pipeline_config
from omnistage.pipeline.engine import OmniEngine
from omnistage.pipeline.engine_args import EngineArgs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture(scope="module")
def cpu_run(tiny_ckpt):
    return run(make_engine(tiny_ckpt), {0: [1], 2: [0], 5: [2]})


def cuda_engine(ckpt, runner: str) -> OmniEngine:
    return OmniEngine(EngineArgs(str(ckpt), device="cuda"), load_pipeline_config("qwen3_omni", {"runner": runner}))


def assert_same(got, expect, ids):
    for i in ids:
        assert got[i]["tokens"] == expect[i]["tokens"], i
        assert torch.equal(got[i]["codes"].cpu(), expect[i]["codes"].cpu()), i
        a, b = got[i]["audio"].cpu(), expect[i]["audio"].cpu()
        assert a.shape == b.shape, i
        assert (a - b).abs().max().item() <= 1e-4, i


@pytest.mark.parametrize("runner", ["eager", "cuda_graph"])
def test_cuda_engine_matches_the_cpu_run(tiny_ckpt, cpu_run, runner):
    eng = cuda_engine(tiny_ckpt, runner)
    got = run(eng, {0: [1], 2: [0], 5: [2]})
    assert_same(got, cpu_run, range(len(PROMPTS)))
    for i in range(len(PROMPTS)):
        assert got[i]["audio"].device.type == "cpu"  # outputs reach the caller on the host
    if runner == "cuda_graph":
        for stage in ("thinker", "talker"):
            assert eng.orchestrator.stages[stage].runner.stats.replays > 0, stage
    assert_all_free(eng)


def test_cuda_graph_runner_survives_an_abort_and_frees_everything(tiny_ckpt, cpu_run):
    eng = cuda_engine(tiny_ckpt, "cuda_graph")
    got = run(eng, {0: [0, 1, 2]}, aborts={4: [1]})
    assert_same(got, cpu_run, [0, 2])
    assert got[1]["finish"] == "abort"
    assert_all_free(eng)
    assert eng.orchestrator.stages["talker"].runner.stats.replays > 0


def test_stage_workers_on_mixed_devices_match_the_cpu_run(tiny_ckpt, cpu_run):
    """Thinker and Talker workers on the GPU, Code2Wav on the CPU: the hand-offs cross processes and devices
    (the API process has no device) and every output equals the in-process CPU run."""
    stages = {"thinker": {"devices": "0", "threads": 1}, "talker": {"devices": "cuda", "threads": 1},
              "code2wav": {"devices": "cpu", "threads": 1}}
    eng = OmniEngine(EngineArgs(str(tiny_ckpt), device="cuda"),
                     load_pipeline_config("qwen3_omni", {"distributed_executor_backend": "mp", "stages": stages}))
    try:
        got = run(eng, {0: [1], 2: [0], 5: [2]})
        assert_same(got, cpu_run, range(len(PROMPTS)))
    finally:
        eng.shutdown()
