"""The server over stage worker processes (``--distributed-executor-backend mp``): a client that goes away
frees every worker; remote stages feed the step metrics; a worker killed mid-request, or a stage that fails
as a whole inside a step, ends every request in flight with an error within seconds, turns ``/health`` and
new requests into 503, and shutdown leaves no process and no socket behind; a server killed with SIGKILL
takes its workers with it."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
import yaml
from server_thread import ServerThread

from omnistage.entrypoints.metrics import ServerMetrics
from omnistage.entrypoints.server import create_app
from omnistage.models.qwen3_omni.family import Qwen3OmniFamily
from omnistage.models.registry import load_pipeline_config
from omnistage.pipeline.faults import ENV_VAR
from omnistage.pipeline.omni import AsyncOmni

MODEL = "tiny-omni"
LONG = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me everything."}], "stream": True,
        "modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "pcm16"}, "temperature": 0,
        # Thousands of steps from its end in every stage, however fast: the tests act on it mid-answer.
        "max_tokens": 2000, "min_tokens": 2000, "ignore_eos": True,
        "talker": {"temperature": 0, "max_tokens": 2000, "min_tokens": 2000, "repetition_penalty": 1.0}}
SMALL_CHUNKS = {"stages": {"code2wav": {"bridge_args": {"first_chunk_frames": 4, "chunk_frames": 4}}}}


def worker_processes(parent: psutil.Process | None = None) -> list[psutil.Process]:
    parent = parent or psutil.Process()
    return [p for p in parent.children(recursive=True) if "omnistage.pipeline.worker" in " ".join(p.cmdline())]


def abstract_sockets(prefix: str) -> list[str]:
    with open("/proc/net/unix") as f:
        return [line.split()[-1] for line in f if prefix in line]


def idle(stats: dict) -> bool:
    return stats["requests"] == 0 and all(
        s["records"] == 0 and s["bridge_entries"] == 0 and s["running"] == 0 and s["waiting"] == 0
        and s.get("kv_free_blocks") == s.get("kv_blocks") and s.get("pending_chunks", 0) == 0
        for name, s in stats.items() if name != "requests")


def sse_events(resp: httpx.Response):
    for line in resp.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def assert_stopped_cleanly(omni: AsyncOmni, pids: set[int], prefix: str) -> None:
    t0 = time.monotonic()
    omni.shutdown()
    assert time.monotonic() - t0 < 15
    assert not [p for p in worker_processes() if p.pid in pids]
    assert not [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    assert not abstract_sockets(prefix)


def assert_dead_server(url: str, body: dict) -> None:
    health = httpx.get(url + "/health")
    assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
    new = httpx.post(url + "/v1/chat/completions", json={**body, "stream": False}, timeout=30)
    assert new.status_code == 503 and new.json()["error"]["code"] == "engine_dead"


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    metrics = ServerMetrics()
    omni = AsyncOmni(tiny_ckpt, pipeline=load_pipeline_config("qwen3_omni", SMALL_CHUNKS), on_step=metrics.observe_step,
                     distributed_executor_backend="mp")
    with ServerThread(create_app(omni, MODEL, metrics)) as srv:
        yield srv, omni
    omni.shutdown()


def test_client_disconnect_frees_every_worker_and_remote_steps_reach_the_metrics(server):
    srv, omni = server
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=LONG, timeout=60) as resp:
        events = sse_events(resp)
        audio = 0
        for ev in events:
            audio += bool(ev["choices"][0]["delta"].get("audio", {}).get("data"))
            if audio >= 2:
                break  # Code2Wav has spoken twice: every stage holds the request
        assert asyncio.run(omni.resource_stats())["requests"] == 1
    deadline = time.monotonic() + 20
    while not idle(stats := asyncio.run(omni.resource_stats())) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert idle(stats), stats
    text = httpx.get(srv.url + "/metrics").text
    assert re.search(r'omnistage_requests_total\{finish_reason="abort"\} 1\.0', text)
    for stage in ("thinker", "talker", "code2wav"):
        count = re.search(rf'omnistage_stage_step_seconds_count\{{stage="{stage}"\}} ([0-9.]+)', text)
        assert count and float(count.group(1)) > 0, stage
        assert re.search(rf'omnistage_request_records\{{stage="{stage}"\}} 0\.0', text)
        # Each worker process reports its own resident memory and what its stage holds.
        rss = re.search(rf'omnistage_process_resident_bytes\{{process="{stage}"\}} ([0-9.e+]+)', text)
        assert rss and float(rss.group(1)) > 10e6, stage
        assert re.search(rf'omnistage_stage_weight_bytes\{{component="{stage}\.[a-z0-9_.]+",stage="{stage}"\}} [1-9]', text)


def test_a_worker_killed_mid_request_fails_it_within_seconds_and_the_server_reports_503(server):
    srv, omni = server
    pids = omni.engine.workers.pids()
    prefix = omni.engine.workers.res.launcher.prefix
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=LONG, timeout=60) as resp:
        events = sse_events(resp)
        for ev in events:
            if ev["choices"][0]["delta"].get("audio", {}).get("data"):
                break
        os.kill(pids["talker"], signal.SIGKILL)
        killed = time.monotonic()
        last = list(events)[-1]
    assert time.monotonic() - killed < 5
    err = last["error"]
    assert err["code"] == "request_failed" and "stage 'talker' worker" in err["message"]
    assert "SIGKILL" in err["message"]
    assert_dead_server(srv.url, LONG)
    assert_stopped_cleanly(omni, set(pids.values()), prefix)


def test_a_stage_failing_inside_a_step_with_two_requests_fails_both_and_stops_cleanly(tiny_ckpt):
    mp = pytest.MonkeyPatch()
    mp.setenv(ENV_VAR, "thinker:crash-*:crash")
    pipeline = load_pipeline_config("qwen3_omni")
    thinker_only = pipeline.__class__(family="qwen3_omni", stages=(pipeline.stage("thinker"),))
    omni = AsyncOmni(tiny_ckpt, pipeline=thinker_only, distributed_executor_backend="mp")
    mp.undo()
    pids, prefix = set(omni.engine.workers.pids().values()), omni.engine.workers.res.launcher.prefix
    text_only = {**LONG, "modalities": ["text"], "max_tokens": 4000}
    text_only.pop("audio")
    with ServerThread(create_app(omni, MODEL)) as srv, ThreadPoolExecutor(1) as pool:
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=text_only, timeout=60,
                          headers={"X-Request-Id": "long-1"}) as resp:
            events = sse_events(resp)
            next(events), next(events)  # the long answer is being written: the next Thinker step holds both
            crash = pool.submit(httpx.post, srv.url + "/v1/chat/completions", timeout=60,
                                json={**text_only, "stream": False}, headers={"X-Request-Id": "crash-1"})
            t0 = time.monotonic()
            last = list(events)[-1]
            failed = crash.result()
        assert time.monotonic() - t0 < 5
        for err in (last["error"], failed.json()["error"]):
            assert "stage 'thinker' failed: RuntimeError: injected crash in stage 'thinker' (batch of 2)" in err["message"]
        assert failed.status_code == 500
        assert_dead_server(srv.url, text_only)
    assert_stopped_cleanly(omni, pids, prefix)


def test_workers_exit_on_their_own_when_the_server_is_killed(tiny_ckpt, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Two of the three stages (fewer processes to start; each worker watches its parent the same way).
    preset = yaml.safe_load(Qwen3OmniFamily.preset_text())
    preset["stages"] = preset["stages"][:2]
    preset["stages"][0]["final_output"], preset["stages"][1]["final_output"] = "text", None
    config = tmp_path / "two_stages.yaml"
    config.write_text(yaml.safe_dump(preset))
    cmd = [sys.executable, "-m", "omnistage.entrypoints.cli", "serve", "--model", str(tiny_ckpt), "--port", str(port),
           "--stage-config", str(config), "--distributed-executor-backend", "mp", "--served-model-name", MODEL]
    log = open(tmp_path / "serve.log", "w")
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.2)
        workers = worker_processes(psutil.Process(server.pid))
        assert len(workers) == 2
        server.send_signal(signal.SIGKILL)
        server.wait()
        gone, alive = psutil.wait_procs(workers, timeout=5)
        assert not alive, [p.cmdline() for p in alive]
        assert not abstract_sockets(f"omnistage-{server.pid}-")
    finally:
        if server.poll() is None:
            server.kill()
        log.close()
