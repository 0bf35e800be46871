"""A failure inside the real engine belongs to the request that caused it: injected into one request of
each stage (``OMNISTAGE_FAULTS``, requests named by ``X-Request-Id``), among concurrent ones, that request
gets a 500 naming the reason, the others get exactly their solo answers, every stage ends empty and the
server stays healthy."""

from __future__ import annotations

import base64
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from server_thread import ServerThread

from omnistage.entrypoints.server import create_app
from omnistage.pipeline.faults import ENV_VAR
from omnistage.pipeline.omni import AsyncOmni

MODEL = "tiny-omni"
STAGES = ("thinker", "talker", "code2wav")
PROMPTS = ["Hi", "Tell me a short story about the sea.", "What is the weather like?"]


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    mp = pytest.MonkeyPatch()
    mp.setenv(ENV_VAR, ",".join(f"{s}:fail-{s}-*" for s in STAGES))
    omni = AsyncOmni(tiny_ckpt)
    mp.undo()
    with ServerThread(create_app(omni, MODEL)) as srv:
        yield srv, omni
    omni.shutdown()


def chat(url: str, prompt: str, request_id: str) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "modalities": ["text", "audio"],
            "audio": {"voice": "ethan", "format": "pcm16"}, "temperature": 0, "max_tokens": 8,
            "talker": {"max_tokens": 30, "repetition_penalty": 1.0}}
    return httpx.post(url + "/v1/chat/completions", json=body, headers={"X-Request-Id": request_id}, timeout=120)


def answer(resp: httpx.Response) -> tuple[str, bytes]:
    assert resp.status_code == 200, resp.text
    msg = resp.json()["choices"][0]["message"]
    return msg["content"], base64.b64decode(msg["audio"]["data"])


@pytest.mark.parametrize("stage", STAGES)
def test_injected_failure_fails_one_request_and_the_others_get_their_solo_answers(server, stage):
    srv, omni = server
    solo = {p: answer(chat(srv.url, p, f"solo-{stage}-{i}")) for i, p in enumerate(PROMPTS[:2])}
    with ThreadPoolExecutor(3) as pool:
        futures = {p: pool.submit(chat, srv.url, p, f"ok-{stage}-{i}") for i, p in enumerate(PROMPTS[:2])}
        failing = pool.submit(chat, srv.url, PROMPTS[2], f"fail-{stage}-1")
        got = {p: f.result() for p, f in futures.items()}
        bad = failing.result()
    assert bad.status_code == 500
    err = bad.json()["error"]
    assert err["code"] == "request_failed" and f"injected fault in stage '{stage}'" in err["message"]
    for p in PROMPTS[:2]:
        text, audio = answer(got[p])
        assert text == solo[p][0]
        a, b = np.frombuffer(audio, "<i2").astype(np.int32), np.frombuffer(solo[p][1], "<i2").astype(np.int32)
        assert a.shape == b.shape and a.size > 0 and np.abs(a - b).max() <= 4  # 1e-4 of full scale
    assert httpx.get(srv.url + "/health").status_code == 200
    stats = httpx.get(srv.url + "/metrics").text
    for s in STAGES:
        assert f'omnistage_request_records{{stage="{s}"}} 0.0' in stats
        assert f'omnistage_bridge_entries{{stage="{s}"}} 0.0' in stats
    assert "omnistage_requests_in_flight 0.0" in stats


def test_a_bad_request_id_is_a_400(server):
    srv, _ = server
    r = chat(srv.url, "Hi", "no spaces allowed")
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Id"
