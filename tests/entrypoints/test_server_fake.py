"""Server behaviour that does not depend on the model: error classes, stop strings, disconnects, 429/503,
metrics. Runs the real app under uvicorn against ``FakeOmni`` (see fake_omni.py)."""

from __future__ import annotations

import base64
import io
import json
import socket
import threading
import time
import wave

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf
from fake_omni import STALL, FakeOmni, chunk_audio
from server_thread import ServerThread

from omnistage.entrypoints import audio_format
from omnistage.entrypoints.audio_format import to_int16
from omnistage.entrypoints.limits import ServerLimits
from omnistage.entrypoints.server import create_app

MODEL = "fake-omni"


@pytest.fixture(scope="module")
def fake():
    return FakeOmni(answer="hello world. bye")


@pytest.fixture(scope="module")
def server(fake):
    with ServerThread(create_app(fake, MODEL)) as srv:
        yield srv


@pytest.fixture(autouse=True)
def _reset(fake):
    fake.dead, fake.queue_full, fake.delay, fake.fail_with = None, False, 0.002, None
    yield


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def _post(server, path, body, raw: bytes | None = None):
    if raw is not None:
        return httpx.post(server.url + path, content=raw, headers={"content-type": "application/json"})
    return httpx.post(server.url + path, json=body)


def _chat(**kw):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    body.update(kw)
    return body


def _assert_error(resp, status, param=None, code=None):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    return err


@pytest.mark.parametrize("body, raw, status, param, code", [
    (None, b"{not json", 400, None, "invalid_json"),
    ({"model": MODEL}, None, 400, "messages", None),
    (_chat(messages=[]), None, 400, "messages", None),
    (_chat(model="gpt-4o"), None, 404, "model", "model_not_found"),
    (_chat(modalities=["audio"]), None, 400, "modalities", None),
    (_chat(modalities=["text", "video"]), None, 400, "modalities", None),
    (_chat(modalities=["text", "audio"], audio={"voice": "ethan", "format": "mp3"}), None, 400, "audio.format", None),
    (_chat(modalities=["text", "audio"], audio={"voice": "nobody", "format": "wav"}), None, 400, "audio.voice",
     "invalid_voice"),
    (_chat(temperature=-1), None, 400, None, None),
    (_chat(top_p=0), None, 400, None, None),
    (_chat(max_tokens=0), None, 400, None, None),
    (_chat(talker={"temperature": -2}), None, 400, None, None),
    (_chat(messages=[{"role": "user", "content": "x" * 500}]), None, 400, "messages", "context_length_exceeded"),
    (_chat(messages=[{"role": "tool", "content": "x"}]), None, 400, None, None),
    (_chat(n=2), None, 400, "n", None),
    (_chat(temperature="hot"), None, 400, "temperature", None),
])
def test_bad_chat_requests(server, fake, body, raw, status, param, code):
    before = len(fake.submitted)
    _assert_error(_post(server, "/v1/chat/completions", body, raw), status, param, code)
    assert len(fake.submitted) == before  # nothing reached the engine


@pytest.mark.parametrize("body, status, param", [
    ({"model": MODEL, "input": "hi", "voice": "ethan", "speed": 1.5}, 400, "speed"),
    ({"model": MODEL, "input": "hi", "voice": "ethan", "response_format": "mp3"}, 400, "response_format"),
    ({"model": MODEL, "input": "hi", "voice": "ethan", "response_format": "wav", "stream_format": "sse"}, 400,
     "response_format"),
    ({"model": MODEL, "input": "  ", "voice": "ethan"}, 400, "input"),
    ({"model": MODEL, "input": "hi", "voice": "zed"}, 400, "voice"),
    ({"model": "other", "input": "hi", "voice": "ethan"}, 404, "model"),
    ({"model": MODEL, "voice": "ethan"}, 400, "input"),
])
def test_bad_speech_requests(server, body, status, param):
    _assert_error(_post(server, "/v1/audio/speech", body), status, param)


def test_unknown_route_uses_error_body(server):
    _assert_error(httpx.get(server.url + "/v1/nothing"), 404)


def test_queue_full_is_429_with_retry_after(server, fake, client):
    fake.queue_full = True
    resp = _post(server, "/v1/chat/completions", _chat())
    _assert_error(resp, 429, code="queue_full")
    assert int(resp.headers["retry-after"]) >= 1
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])


def test_dead_engine_is_503(server, fake):
    fake.dead = RuntimeError("boom")
    resp = _post(server, "/v1/chat/completions", _chat(stream=True))
    _assert_error(resp, 503, code="engine_dead")
    assert "retry-after" in resp.headers
    _assert_error(httpx.get(server.url + "/health"), 503)


def test_stream_with_multi_token_stop_string_aborts(server, fake, client):
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                            stop=["wor"], stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "hello "
    assert chunks[-1].choices[0].finish_reason == "stop"
    rid = chunks[0].id
    assert rid in fake.aborted and rid not in fake.active


def test_single_token_stop_goes_to_the_engine(server, fake, client):
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], stop=".")
    assert resp.choices[0].message.content == "hello world"
    assert resp.choices[0].finish_reason == "stop"
    assert fake.submitted[-1]["params"]["thinker"].stop_token_ids == (ord("."),)
    assert fake.submitted[-1]["request_id"] not in fake.aborted  # the engine stopped by itself


def test_sampling_translation(server, fake, client):
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=0,
                                   max_completion_tokens=3, seed=7, top_p=0.5,
                                   extra_body={"talker": {"top_k": 5}})
    p = fake.submitted[-1]["params"]
    assert (p["thinker"].temperature, p["thinker"].max_tokens, p["thinker"].seed, p["thinker"].top_p) == (0, 3, 7, 0.5)
    assert (p["talker"].temperature, p["talker"].seed, p["talker"].top_k) == (0, 7, 5)
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=0.7)
    p = fake.submitted[-1]["params"]
    assert p["talker"].temperature == 0.9  # stage default unless temperature is 0 or talker overrides


def test_text_parts_and_developer_role(server, fake, client):
    client.chat.completions.create(model=MODEL, messages=[
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ])
    prompt = "".join(chr(i) for i in fake.submitted[-1]["prompt"].token_ids)
    assert prompt == "<system>be brief<user>ab"


def test_stream_audio_usage_and_done(server, fake):
    body = _chat(modalities=["text", "audio"], audio={"voice": "Chelsie", "format": "pcm16"}, stream=True,
                 stream_options={"include_usage": True}, max_tokens=5)
    events = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "hello"
    audio = b"".join(base64.b64decode(c["choices"][0]["delta"]["audio"]["data"]) for c in chunks
                     if c["choices"] and "audio" in c["choices"][0]["delta"])
    expected = np.concatenate([to_int16(chunk_audio(ord(ch))) for ch in "hello"])
    np.testing.assert_array_equal(np.frombuffer(audio, dtype="<i2"), expected)
    transcript = [c["choices"][0]["delta"]["audio"]["transcript"] for c in chunks
                  if c["choices"] and c["choices"][0]["delta"].get("audio", {}).get("transcript")]
    assert transcript == ["hello"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    assert fake.submitted[-1]["speaker"] == "chelsie"


def test_disconnect_mid_stream_aborts_only_that_request(server, fake, client):
    long_body = _chat(stream=True, messages=[{"role": "user", "content": STALL}])  # cannot finish by itself
    other = {}

    def run_other():
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
        other["text"] = r.choices[0].message.content

    t = threading.Thread(target=run_other)
    t.start()
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=long_body) as resp:
        lines = resp.iter_lines()
        first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
        next(lines)
    rid = first["id"]
    deadline = time.monotonic() + 5
    while rid not in fake.aborted and time.monotonic() < deadline:
        time.sleep(0.02)
    assert rid in fake.aborted and rid not in fake.active
    t.join(10)
    assert other["text"] == "hello world. bye"


def test_speech_formats(server):
    for fmt in ("wav", "flac", "pcm"):
        resp = _post(server, "/v1/audio/speech", {"model": MODEL, "input": "hi", "voice": "ethan",
                                                  "response_format": fmt, "max_tokens": 3})
        assert resp.status_code == 200, resp.text
        expected = np.concatenate([to_int16(chunk_audio(ord(ch))) for ch in "hel"])
        if fmt == "wav":
            with wave.open(io.BytesIO(resp.content)) as w:
                assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
                got = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
        elif fmt == "flac":
            assert resp.content[:4] == b"fLaC"
            continue  # decoded in test_audio_format
        else:
            got = np.frombuffer(resp.content, dtype="<i2")
        np.testing.assert_array_equal(got, expected)


def test_speech_sse(server):
    body = {"model": MODEL, "input": "hi", "voice": "ethan", "response_format": "pcm", "stream_format": "sse",
            "max_tokens": 2}
    with httpx.stream("POST", server.url + "/v1/audio/speech", json=body) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: ")]
    assert [e["type"] for e in events] == ["speech.audio.delta"] * 2 + ["speech.audio.done"]
    assert events[-1]["usage"]["output_tokens"] == 2


def test_models_health_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").status_code == 200
    text = httpx.get(server.url + "/metrics").text
    for name in ("omnistage_num_requests_running{stage=\"thinker\"}", "omnistage_kv_cache_usage_ratio",
                 "omnistage_time_to_first_token_seconds_bucket", "omnistage_inter_token_latency_seconds_count",
                 "omnistage_e2e_request_latency_seconds_count", "omnistage_time_to_first_audio_seconds_count",
                 "omnistage_real_time_factor_count", "omnistage_prompt_tokens_total",
                 "omnistage_generation_tokens_total"):
        assert name in text, name


def _local_port(resp: httpx.Response) -> int:
    return resp.extensions["network_stream"].get_extra_info("client_addr")[1]


def test_every_5xx_leaves_the_keep_alive_connection_usable(server, fake, monkeypatch):
    """A 500 from an unexpected exception (here: the audio encoder raising), a 500 from a request the engine
    failed, and a 503: each is a complete response, and the next request reuses the same connection."""

    def broken(*_a, **_k):
        raise RuntimeError("encoder exploded")

    with httpx.Client(base_url=server.url) as http:
        port = _local_port(http.get("/v1/models"))
        monkeypatch.setattr(audio_format, "encode", broken)
        resp = http.post("/v1/audio/speech", json={"model": MODEL, "input": "hi", "voice": "ethan"})
        err = _assert_error(resp, 500)
        assert err["type"] == "server_error" and "encoder exploded" in err["message"]
        assert resp.headers.get("connection") != "close"
        monkeypatch.undo()
        fake.fail_with = "error"
        _assert_error(http.post("/v1/chat/completions", json=_chat()), 500)
        fake.fail_with, fake.dead = None, RuntimeError("boom")
        _assert_error(http.post("/v1/chat/completions", json=_chat()), 503)
        fake.dead = None
        ok = http.post("/v1/chat/completions", json=_chat())
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "hello world. bye"
        assert _local_port(ok) == port  # one connection throughout


@pytest.fixture(scope="module")
def small_server():
    """The fake engine behind 1 KiB body and 64-character prompt limits."""
    with ServerThread(create_app(FakeOmni(), MODEL, limits=ServerLimits(max_body_bytes=1024,
                                                                        max_prompt_chars=64))) as srv:
        yield srv


def test_body_limit_is_413_and_the_connection_survives(small_server):
    with httpx.Client(base_url=small_server.url) as http:
        port = _local_port(http.get("/health"))
        for size in (1025, 200_000):  # the rest is read and dropped: the connection stays usable
            resp = http.post("/v1/chat/completions", json=_chat(padding="x" * size))
            _assert_error(resp, 413, code="request_too_large")
            assert resp.headers.get("connection") != "close"
            assert _local_port(http.get("/health")) == port

        def chunks():  # no Content-Length: counted while it arrives
            for _ in range(10):
                yield b" " * 200

        resp = http.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
        _assert_error(resp, 413, code="request_too_large")
        assert _local_port(http.post("/v1/chat/completions", json=_chat())) == port


def test_a_declared_huge_body_is_refused_before_it_is_sent(small_server):
    with socket.create_connection(("127.0.0.1", small_server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000000000000\r\n\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413") and b"connection: close" in head.lower()
    assert json.loads(body)["error"]["code"] == "request_too_large"


def test_prompt_character_limit_is_checked_before_tokenizing(small_server):
    resp = httpx.post(small_server.url + "/v1/chat/completions",
                      json=_chat(messages=[{"role": "user", "content": "y" * 65}]))
    err = _assert_error(resp, 400, "messages", "context_length_exceeded")
    assert "65 characters" in err["message"]


def test_new_sampling_fields_reach_the_engine(server, fake, client):
    client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], frequency_penalty=0.5, presence_penalty=-0.25,
        logit_bias={"104": 5, str(0x10FFFF): -100}, max_tokens=9,
        extra_body={"min_tokens": 4, "ignore_eos": True, "talker": {"min_tokens": 3, "max_tokens": 7}})
    p = fake.submitted[-1]["params"]
    th, tk = p["thinker"], p["talker"]
    assert (th.frequency_penalty, th.presence_penalty) == (0.5, -0.25)
    assert th.logit_bias == ((104, 5.0), (0x10FFFF, -100.0))
    assert (th.min_tokens, th.max_tokens, th.ignore_eos) == (4, 9, True)
    assert (tk.min_tokens, tk.max_tokens) == (3, 7)
    _assert_error(_post(server, "/v1/chat/completions", _chat(logit_bias={str(0x110000): 1})), 400,
                  f"logit_bias.{0x110000}")


def test_a_tiny_temperature_is_greedy_in_every_stage(server, fake, client):
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=1e-300)
    p = fake.submitted[-1]["params"]
    assert p["thinker"].greedy and p["talker"].greedy


def test_media_content_parts_are_refused_by_a_model_without_towers(server, fake):
    before = len(fake.submitted)
    bodies = {"input_audio": {"data": "AAAA", "format": "wav"}, "image_url": {"url": "data:image/png;base64,AAAA"},
              "audio_url": {"url": "data:audio/wav;base64,AAAA"}, "video_url": {"url": "data:video/mp4;base64,AAAA"},
              "file": {"file_id": "f"}}
    for kind, body in bodies.items():
        msg = {"role": "user", "content": [{"type": "text", "text": "look"}, {"type": kind, kind: body}]}
        err = _assert_error(_post(server, "/v1/chat/completions", _chat(messages=[msg])), 400,
                            "messages.0.content.1", "unsupported_content")
        assert repr(kind) in err["message"]
        assert ("not supported" if kind == "file" else "this model takes no") in err["message"]
    err = _assert_error(_post(server, "/v1/chat/completions", _chat(mm_processor_kwargs={"use_audio_in_video": True})),
                        400, "mm_processor_kwargs", "unsupported_parameter")
    assert len(fake.submitted) == before


def test_an_answer_without_audio_is_still_a_valid_file(server, fake):
    fake.answer = ""  # the engine finishes at once: no token, no audio
    try:
        for fmt, n in (("wav", 0), ("flac", 1)):  # FLAC cannot say "0 samples": one silent sample
            resp = _post(server, "/v1/audio/speech", {"model": MODEL, "input": "hi", "voice": "ethan",
                                                      "response_format": fmt})
            assert resp.status_code == 200, resp.text
            samples, rate = sf.read(io.BytesIO(resp.content), dtype="int16")
            assert rate == 24000 and samples.tolist() == [0] * n
            if fmt == "wav":
                with wave.open(io.BytesIO(resp.content)) as w:
                    assert (w.getnframes(), w.getframerate()) == (0, 24000)
        resp = _post(server, "/v1/chat/completions", _chat(modalities=["text", "audio"],
                                                           audio={"voice": "ethan", "format": "flac"}))
        data = base64.b64decode(resp.json()["choices"][0]["message"]["audio"]["data"])
        assert sf.read(io.BytesIO(data), dtype="int16")[0].tolist() == [0]
    finally:
        fake.answer = "hello world. bye"
