"""Stages in their own worker processes (``distributed_executor_backend: mp``) give exactly what the
in-process engine gives, free everything on abort, and fail clearly when a worker cannot start.

The schedules and helpers are those of ``test_pipeline_parity`` (staggered three prompts, greedy) plus a
seeded temperature > 0 run; Code2Wav gets small chunks so audio crosses the process boundary many times.
Both engines run their stages with one thread, so even float rounding is the same.
"""

from __future__ import annotations

import os
import time

import numpy as np
import psutil
import pytest
import torch
from test_pipeline_parity import PROMPTS, assert_all_free, run

from omnistage.config import StageConfig
from omnistage.core.sampling_params import SamplingParams
from omnistage.models.registry import load_pipeline_config
from omnistage.pipeline.engine import OmniEngine
from omnistage.pipeline.engine_args import EngineArgs
from omnistage.pipeline.remote_stage import RemoteStage, StageWorkerError

CHUNKS = {"first_chunk_frames": 4, "chunk_frames": 4}
STAGGERED = {0: [1], 2: [0], 5: [2]}


def overrides(backend: str) -> dict:
    return {"distributed_executor_backend": backend, "stages": {
        "thinker": {"threads": 1, "devices": "cpu"}, "talker": {"threads": 1}, "code2wav": {"threads": 1, "bridge_args": CHUNKS}}}


def build(ckpt, backend: str) -> OmniEngine:
    return OmniEngine(EngineArgs(str(ckpt)), load_pipeline_config("qwen3_omni", overrides(backend)))


def worker_processes() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True)
            if "omnistage.pipeline.worker" in " ".join(p.cmdline())]


def abstract_sockets(prefix: str) -> list[str]:
    with open("/proc/net/unix") as f:
        return [line.split()[-1] for line in f if prefix in line]


@pytest.fixture(scope="module")
def engines(tiny_ckpt):
    """(mp engine, in-process engine), same config."""
    mp = build(tiny_ckpt, "mp")
    yield mp, build(tiny_ckpt, "inproc")
    prefix = mp.workers.res.launcher.prefix
    pids = set(mp.workers.pids().values())
    mp.shutdown()
    assert not [p for p in worker_processes() if p.pid in pids]
    assert not abstract_sockets(prefix)


def seeded(i: int) -> dict[str, SamplingParams]:
    n = (5, 8, 6)[i]
    return {"thinker": SamplingParams(temperature=0.8, top_k=20, seed=10 + i, max_tokens=n, min_tokens=n),
            "talker": SamplingParams(temperature=0.9, top_k=50, seed=20 + i, max_tokens=24)}


def assert_same_runs(got: dict, want: dict, audio_tol: float) -> None:
    assert sorted(got) == sorted(want)
    for i in want:
        assert got[i]["tokens"] == want[i]["tokens"], i
        assert got[i]["finish"] == want[i]["finish"], i
        assert got[i]["codes"] is not None and torch.equal(got[i]["codes"], want[i]["codes"]), i
        assert got[i]["audio"].shape == want[i]["audio"].shape and got[i]["audio"].numel() > 0, i
        assert (got[i]["audio"] - want[i]["audio"]).abs().max().item() <= audio_tol, i


def test_stages_run_in_their_own_processes_and_the_api_process_holds_no_model(engines):
    mp, _ = engines
    pids = mp.workers.pids()
    assert sorted(pids) == ["code2wav", "talker", "thinker"]
    assert len(set(pids.values())) == 3 and os.getpid() not in pids.values()
    assert all(isinstance(s, RemoteStage) for s in mp.orchestrator.stages.values())
    assert all(a.startswith("ipc://@") for a in mp.workers.addresses)  # abstract: no socket files
    assert {p.pid for p in worker_processes()} >= set(pids.values())
    # Placement holds in each worker: its torch threads, and the environment it started with.
    for name, stage in mp.workers.stages.items():
        assert (stage.ready.device, stage.ready.threads) == ("cpu", 1), name
        env = psutil.Process(pids[name]).environ()
        assert env["OMP_NUM_THREADS"] == "1", name
        assert env.get("CUDA_VISIBLE_DEVICES") == ("" if name == "thinker" else os.environ.get("CUDA_VISIBLE_DEVICES"))


@pytest.fixture(scope="module")
def greedy(engines):
    mp, inproc = engines
    got = run(mp, STAGGERED)
    assert_all_free(mp)
    return got, run(inproc, STAGGERED)


def test_staggered_greedy_requests_equal_the_in_process_engine(greedy):
    assert_same_runs(*greedy, audio_tol=1e-5)


def test_seeded_sampling_equals_the_in_process_engine(engines, greedy):
    mp, inproc = engines
    got = run(mp, STAGGERED, params=seeded)
    assert_same_runs(got, run(inproc, STAGGERED, params=seeded), audio_tol=1e-5)
    assert any(not torch.equal(got[i]["codes"], greedy[0][i]["codes"]) for i in got)  # sampling really sampled
    assert_all_free(mp)


def test_a_lone_request_gives_the_same_audio_bit_for_bit(engines):
    mp, inproc = engines
    assert_same_runs(run(mp, {0: [1]}), run(inproc, {0: [1]}), audio_tol=0.0)


def test_media_prompts_cross_the_process_boundary(engines):
    """An audio + image prompt answered in speech: the Thinker's media (encoder inputs, 3-D positions) and the
    Talker's media spans travel to their workers, and the answer equals the in-process one."""
    rng = np.random.default_rng(0)
    messages = [{"role": "user", "content": [
        {"type": "audio", "audio": (rng.standard_normal(16000) * 0.1).astype(np.float32)},
        {"type": "image", "image": rng.integers(0, 256, (64, 96, 3), dtype=np.uint8)},
        {"type": "text", "text": "What is this?"}]}]
    params = {"thinker": SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6),
              "talker": SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.0)}

    def answer(engine):
        engine.add_request(messages, ["text", "audio"], params, speaker="ethan")
        tokens, codes = [], []
        while engine.has_work():
            for d in engine.step():
                tokens += d.new_token_ids
                codes += [d.codes] if d.codes is not None else []
        return tokens, torch.cat(codes, 1)

    mp, inproc = engines
    (tokens, codes), (want_tokens, want_codes) = answer(mp), answer(inproc)
    assert len(tokens) == 6 and tokens == want_tokens
    assert codes.shape[1] > 0 and torch.equal(codes, want_codes)
    assert_all_free(mp)


@pytest.mark.parametrize("point", ["before_talker", "during_talker", "during_code2wav"])
def test_abort_at_each_point_leaves_every_worker_holding_nothing(engines, point):
    mp, _ = engines
    p = {"thinker": SamplingParams(temperature=0.0, max_tokens=20, min_tokens=20),
         "talker": SamplingParams(temperature=0.0, max_tokens=60, repetition_penalty=1.0)}
    rid = mp.add_request(PROMPTS[1], ["text", "audio"], p, speaker="ethan")
    seen = {"tokens": 0, "codes": 0, "audio": 0}
    deltas = []
    deadline = time.monotonic() + 60
    while point != "before_talker":
        for d in mp.step():
            deltas.append(d)
            seen["tokens"] += len(d.new_token_ids)
            seen["codes"] += d.codes is not None
            seen["audio"] += d.audio is not None
            assert not d.finished, "the request ended before the abort point"
        if (point == "during_talker" and seen["codes"]) or (point == "during_code2wav" and seen["audio"]):
            break
        assert time.monotonic() < deadline
    assert mp.abort(rid)
    while mp.has_work():
        deltas += mp.step()
    assert deltas[-1].finished and deltas[-1].finish_reason == "abort"
    assert [d for d in deltas if d.finished] == [deltas[-1]]
    assert_all_free(mp)


def test_a_stage_that_cannot_start_is_named_with_its_traceback_and_nothing_is_left_running(tiny_ckpt):
    pipeline = load_pipeline_config("qwen3_omni")
    thinker = StageConfig.from_dict({**pipeline.stage("thinker").to_dict(), "scheduler": {"kv_cache_bytes": 1}})
    only = pipeline.__class__(family="qwen3_omni", stages=(thinker,), distributed_executor_backend="mp")
    before = {p.pid for p in worker_processes()}
    with pytest.raises(StageWorkerError, match="(?s)stage 'thinker' failed to start: ConfigError: .*"
                                               "worker traceback.*build_stage"):
        OmniEngine(EngineArgs(str(tiny_ckpt)), only)
    assert {p.pid for p in worker_processes()} <= before
    # A worker that is not ready in time is stopped, and the error names it.
    t0 = time.monotonic()
    with pytest.raises(StageWorkerError, match=r"stage\(s\) \['thinker'\] did not become ready"):
        OmniEngine(EngineArgs(str(tiny_ckpt), distributed_executor_backend="mp", worker_startup_timeout=0.2),
                   pipeline.__class__(family="qwen3_omni", stages=(pipeline.stage("thinker"),)))
    assert time.monotonic() - t0 < 10
    assert {p.pid for p in worker_processes()} <= before


def test_stage_workers_serve_repeated_prompts_from_their_prefix_caches(engines):
    """Caching is on by default in stage workers too: the prompts above ran several times, so the Thinker's and
    the Talker's workers both report hits (their stats cross the process boundary), and all blocks are free."""
    mp, _ = engines
    stats = mp.resource_stats()
    for stage in ("thinker", "talker"):
        s = stats[stage]
        assert 0 < s["prefix_cache_hits"] <= s["prefix_cache_queries"] and s["prefix_cached_blocks"] > 0, (stage, s)
    assert_all_free(mp)
