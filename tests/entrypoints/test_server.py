"""The real server (AsyncOmni on the tiny checkpoint, uvicorn on 127.0.0.1) against the official openai
client: every answer must equal the offline ``Omni.generate`` result for the same greedy request."""

from __future__ import annotations

import asyncio
import base64
import io
import re
import threading
import time
import wave

import httpx
import numpy as np
import openai
import pytest
from server_thread import ServerThread
from test_audio_format import decode_flac

from omnistage.core.sampling_params import SamplingParams
from omnistage.entrypoints.audio_format import to_int16
from omnistage.entrypoints.metrics import ServerMetrics
from omnistage.entrypoints.server import create_app
from omnistage.pipeline.omni import AsyncOmni, Omni

MODEL = "tiny-omni"
TALKER_FRAMES = 30  # > the 25-frame first chunk: audio arrives in two chunks
# (prompt, thinker max tokens)
CASES = [("Hi", 8), ("Tell me a short story about the sea.", 10), ("What is the weather like?", 40)]
TALKER_EXTRA = {"talker": {"temperature": 0, "max_tokens": TALKER_FRAMES, "repetition_penalty": 1.0}}
MAX_INT16_DIFF = 4  # 1e-4 of full scale, in int16 steps
# A request that cannot end early: thousands of steps in every stage (min_tokens = max_tokens, no EOS).
LONG = {"max_tokens": 2000, "min_tokens": 2000, "ignore_eos": True,
        "talker": {"temperature": 0, "repetition_penalty": 1.0, "max_tokens": 2000, "min_tokens": 2000}}


def _params(max_tokens: int) -> dict[str, SamplingParams]:
    return {"thinker": SamplingParams(temperature=0.0, max_tokens=max_tokens),
            "talker": SamplingParams(temperature=0.0, max_tokens=TALKER_FRAMES, repetition_penalty=1.0)}


@pytest.fixture(scope="module")
def references(tiny_ckpt):
    """Each case run alone, offline."""
    omni = Omni(tiny_ckpt)
    out = {}
    for prompt, n in CASES:
        (res,) = omni.generate(prompt, ["text", "audio"], _params(n), speaker="ethan")
        assert res.audio.numel() > 0
        out[prompt] = res
    return out


@pytest.fixture(scope="module")
def gate():
    """Clear it and the engine thread stops after its next stage step until it is set again: a test can
    hold a request unfinished for as long as it needs, whatever the machine's speed."""
    ev = threading.Event()
    ev.set()
    yield ev
    ev.set()


@pytest.fixture(scope="module")
def engine(tiny_ckpt, gate):
    metrics = ServerMetrics()

    def on_step(events) -> None:
        gate.wait(60)
        metrics.observe_step(events)

    omni = AsyncOmni(tiny_ckpt, on_step=on_step)
    yield omni, metrics
    omni.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    omni, metrics = engine
    with ServerThread(create_app(omni, MODEL, metrics)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def _check_audio(got: np.ndarray, ref) -> None:
    want = to_int16(ref.audio)
    assert got.shape == want.shape
    diff = np.abs(got.astype(np.int32) - want.astype(np.int32)).max()
    assert diff <= MAX_INT16_DIFF, diff


def _chat(client, prompt, n, stream=False, fmt="wav"):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], modalities=["text", "audio"],
        audio={"voice": "ethan", "format": fmt}, temperature=0, max_tokens=n, stream=stream,
        stream_options={"include_usage": True} if stream else None, extra_body=TALKER_EXTRA)


def _non_streamed(client, prompt, n, references):
    resp = _chat(client, prompt, n)
    ref = references[prompt]
    msg = resp.choices[0].message
    assert msg.content == ref.text and msg.audio.transcript == ref.text
    assert resp.usage.completion_tokens == len(ref.token_ids)
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.choices[0].finish_reason == ref.finish_reason
    with wave.open(io.BytesIO(base64.b64decode(msg.audio.data))) as w:
        assert w.getframerate() == 24000 and w.getnchannels() == 1
        _check_audio(np.frombuffer(w.readframes(w.getnframes()), dtype="<i2"), ref)


def _streamed(client, prompt, n, references):
    ref = references[prompt]
    text, audio, finish, usage, audio_chunks = [], [], None, None, 0
    for chunk in _chat(client, prompt, n, stream=True, fmt="pcm16"):
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        text.append(delta.content or "")
        a = getattr(delta, "audio", None)
        data = (a.get("data") if isinstance(a, dict) else getattr(a, "data", None)) if a else None
        if data:
            audio.append(base64.b64decode(data))
            audio_chunks += 1
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(text) == ref.text
    assert finish == ref.finish_reason
    assert usage.completion_tokens == len(ref.token_ids)
    if ref.codes.shape[1] > 25:  # beyond the first 25-frame chunk: streamed as produced, not in one piece
        assert audio_chunks >= 2
    _check_audio(np.frombuffer(b"".join(audio), dtype="<i2"), ref)


def test_chat_non_streamed_with_audio(client, references):
    _non_streamed(client, *CASES[0], references)


def test_chat_streamed_with_audio(client, references):
    _streamed(client, *CASES[1], references)


def test_concurrent_requests_each_match_their_single_run(client, references):
    errors = []

    def job(fn, case):
        try:
            fn(client, *case, references)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=job, args=(fn, case)) for fn, case in
               [(_streamed, CASES[0]), (_non_streamed, CASES[1]), (_streamed, CASES[2]), (_non_streamed, CASES[0])]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]


def test_text_only_chat(client, references):
    prompt, n = CASES[2]
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                          temperature=0, max_tokens=n)
    assert resp.choices[0].message.content == references[prompt].text
    assert resp.choices[0].message.audio is None


@pytest.mark.parametrize("fmt", ["wav", "flac", "pcm"])
def test_speech_formats(server, references, fmt):
    prompt, n = CASES[0]
    body = {"model": MODEL, "input": prompt, "voice": "ethan", "response_format": fmt, "temperature": 0,
            "max_tokens": n, **TALKER_EXTRA}
    resp = httpx.post(server.url + "/v1/audio/speech", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    if fmt == "wav":
        assert resp.headers["content-type"] == "audio/wav"
        with wave.open(io.BytesIO(resp.content)) as w:
            assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
            got = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    elif fmt == "flac":
        rate, got = decode_flac(resp.content)
        assert rate == 24000
    else:
        got = np.frombuffer(resp.content, dtype="<i2")
    _check_audio(got, references[prompt])


def test_speech_with_openai_client(client, references):
    prompt, n = CASES[0]
    resp = client.audio.speech.create(model=MODEL, input=prompt, voice="ethan", response_format="wav",
                                      extra_body={"temperature": 0, "max_tokens": n, **TALKER_EXTRA})
    with wave.open(io.BytesIO(resp.content)) as w:
        _check_audio(np.frombuffer(w.readframes(w.getnframes()), dtype="<i2"), references[prompt])


def test_bad_requests_on_the_real_engine(server):
    url = server.url + "/v1/chat/completions"
    long = {"model": MODEL, "messages": [{"role": "user", "content": "word " * 5000}]}
    r = httpx.post(url, json=long)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = httpx.post(url, json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "modalities": ["text", "audio"], "audio": {"voice": "nobody", "format": "wav"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "audio.voice"
    r = httpx.post(url, json={"model": "nope", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def _idle(stats) -> bool:
    stages = [stats[s] for s in ("thinker", "talker", "code2wav")]
    return (stats["requests"] == 0 and all(s["running"] == 0 and s["waiting"] == 0 for s in stages)
            and all(s.get("kv_usage", 0) == 0 and s["records"] == 0 and s["bridge_entries"] == 0 for s in stages)
            and stats["code2wav"]["pending_chunks"] == 0)


def test_disconnect_mid_stream_frees_every_stage(server, engine, client, references):
    omni, _ = engine
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me everything."}], "stream": True,
            "modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "pcm16"}, "temperature": 0,
            **LONG}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        seen = 0
        for line in lines:
            seen += line.startswith("data: ")
            if seen >= 3:
                break
        busy = asyncio.run(omni.resource_stats())
        assert busy["requests"] == 1
    deadline = time.monotonic() + 20
    stats = asyncio.run(omni.resource_stats())
    while not _idle(stats) and time.monotonic() < deadline:
        time.sleep(0.05)
        stats = asyncio.run(omni.resource_stats())
    assert _idle(stats), stats
    # The gauges say the same, and the server still answers correctly.
    text = httpx.get(server.url + "/metrics").text
    assert re.search(r'omnistage_num_requests_running\{stage="thinker"\} 0\.0', text)
    assert re.search(r"omnistage_requests_in_flight 0\.0", text)
    assert re.search(r'omnistage_requests_total\{finish_reason="abort"\} [1-9]', text)
    _non_streamed(client, *CASES[0], references)


def test_disconnect_while_waiting_for_a_non_streamed_answer_frees_every_stage(server, engine, gate):
    omni, _ = engine
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me everything."}],
            "modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "wav"}, "temperature": 0, **LONG}

    def aborts() -> float:
        m = re.search(r'omnistage_requests_total\{finish_reason="abort"\} ([0-9.]+)', httpx.get(server.url + "/metrics").text)
        return float(m.group(1)) if m else 0.0

    before = aborts()
    gate.clear()  # the engine stops after its first step: the answer cannot be complete when the client gives up
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    finally:
        gate.set()
    # Thousands of steps are still ahead of it, so the abort (polled every 0.25 s) arrives long before its end.
    deadline = time.monotonic() + 20
    stats = asyncio.run(omni.resource_stats())
    while not _idle(stats) and time.monotonic() < deadline:
        time.sleep(0.05)
        stats = asyncio.run(omni.resource_stats())
    assert _idle(stats), stats
    assert aborts() == before + 1  # it was aborted, not left to run to its end


def test_health_models_metrics(server, client, engine):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == [MODEL]
    text = httpx.get(server.url + "/metrics").text

    def value(pattern: str) -> float:
        m = re.search(pattern + r" ([0-9.e+-]+)", text)
        assert m, pattern
        return float(m.group(1))

    assert value("omnistage_time_to_first_token_seconds_count") >= 1
    assert value("omnistage_time_to_first_audio_seconds_count") >= 1
    assert value("omnistage_real_time_factor_count") >= 1
    assert value("omnistage_inter_token_latency_seconds_count") >= 1
    assert value("omnistage_e2e_request_latency_seconds_count") >= 1
    assert value("omnistage_prompt_tokens_total") > 0 and value("omnistage_generation_tokens_total") > 0
    for stage in ("thinker", "talker", "code2wav"):
        assert value(rf'omnistage_stage_step_seconds_count\{{stage="{stage}"\}}') > 0
    for stage in ("thinker", "talker"):
        assert 0 <= value(rf'omnistage_kv_cache_usage_ratio\{{stage="{stage}"\}}') <= 1
    # Memory per component, as loaded: every stage's weight gauges add up to (at least) its planned weights, the
    # KV pool gauge is the planned pool, and the server process reports its resident memory.
    for plan in engine[0].engine.memory_plan:
        held = [float(v) for v in re.findall(
            rf'omnistage_stage_weight_bytes\{{component="[a-z0-9_.]+",stage="{plan.stage}"\}} ([0-9.e+]+)', text)]
        assert plan.weight_bytes <= sum(held) <= 1.10 * plan.weight_bytes + (256 << 10), plan
        if plan.kv_bytes:
            assert value(rf'omnistage_stage_kv_cache_bytes\{{stage="{plan.stage}"\}}') == plan.kv_bytes
    assert value('omnistage_process_resident_bytes{process="server"}') > 50e6


def test_cached_prompt_tokens_in_usage_and_prefix_cache_metrics(server, engine, client):
    """A conversation's second turn re-sends the first: the Thinker serves the shared full blocks from its
    prefix cache, and the usage says how many prompt tokens that was (non-streamed and streamed)."""
    omni, _ = engine
    system = {"role": "system", "content": "You answer questions about lighthouses, tides and harbour charts, "
                                           "briefly, in one sentence, and never about anything else at all."}
    turn1 = [system, {"role": "user", "content": "Why do lighthouses blink?"}]
    first = client.chat.completions.create(model=MODEL, messages=turn1, temperature=0, max_tokens=4)
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # nothing of this system prompt was seen
    turn2 = turn1 + [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And tides?"}]
    ids1, ids2 = (omni.engine.render_prompt(m).token_ids for m in (turn1, turn2))
    common = next(i for i, (a, b) in enumerate(zip(ids1, ids2)) if a != b) if ids2[: len(ids1)] != ids1 else len(ids1)
    block = omni.engine.pipeline.stage("thinker").scheduler.block_size
    for stream in (False, True):
        if stream:
            chunks = list(client.chat.completions.create(model=MODEL, messages=turn2, temperature=0, max_tokens=4,
                                                         stream=True, stream_options={"include_usage": True}))
            usage = chunks[-1].usage
        else:
            usage = client.chat.completions.create(model=MODEL, messages=turn2, temperature=0, max_tokens=4).usage
        cached = usage.prompt_tokens_details.cached_tokens
        assert usage.prompt_tokens == len(ids2)
        assert cached % block == 0 and common // block * block <= cached < len(ids2), (cached, common)
    text = httpx.get(server.url + "/metrics").text
    for name in ("queried_tokens", "hit_tokens", "blocks", "evictions"):
        assert re.search(rf'omnistage_prefix_cache_{name}\{{stage="talker"\}} ', text), name
    hits = re.search(r'omnistage_prefix_cache_hit_tokens\{stage="thinker"\} ([0-9.e+-]+)', text)
    assert hits and float(hits.group(1)) >= 2 * (common // block * block) > 0
