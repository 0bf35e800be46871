"""Media input over HTTP: the real server (AsyncOmni on the tiny checkpoint with towers, uvicorn on 127.0.0.1)
against the official openai client. ``input_audio``, ``image_url``, ``audio_url`` and ``video_url`` parts (data
URLs, and files under the allowed media directory) give exactly the offline ``Omni.generate`` answer for the
same media (greedy), spoken answers included; ``use_audio_in_video`` and ``fps`` arrive through ``mm_processor_kwargs``; paths that leave
the allowed directory are refused with the part named; a client that disconnects while its prompt's media are
being encoded has the encoder outputs freed; ``/health`` answers while a large media request is decoded.
(Malformed media classes are in the hostile-input table, ``test_hostile.py``.)"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re
import socket
import threading
import time
import wave
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import quote

import httpx
import numpy as np
import openai
import pytest
from media_files import audio_file, data_url, image_file, input_audio, noise, url_part, user, video_file
from server_thread import ServerThread
from test_hostile import _check_health, _probe_health

from omnistage.core.sampling_params import SamplingParams
from omnistage.entrypoints.audio_format import to_int16
from omnistage.entrypoints.limits import ServerLimits
from omnistage.entrypoints.media_input import MediaLimits
from omnistage.entrypoints.metrics import ServerMetrics
from omnistage.entrypoints.server import create_app
from omnistage.models.registry import load_pipeline_config
from omnistage.pipeline.omni import AsyncOmni, Omni

# transformers' processor warns about numpy copy semantics of its own tensors; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

MODEL = "tiny-omni"
N = 6  # greedy answer tokens
TALKER_FRAMES = 30
MAX_INT16_DIFF = 4  # 1e-4 of full scale, in int16 steps
WAV = audio_file(noise(2.0, 22050, channels=2), 22050)  # stereo at 22.05 kHz: mixed down and resampled
FLAC = audio_file(noise(1.5), 16000, "FLAC")
PNG = image_file(80, 112)  # resized by the processor (2.5 -> 2, 3.5 -> 4 blocks: half to even)
JPEG = image_file(100, 60, "JPEG")
MKV = video_file(20, 48, 64, 10, track=noise(2.0)[:, 0])  # 2 s at 10 fps, with its audio track
FILES = {"clip.wav": WAV, "clip.flac": FLAC, "photo.png": PNG, "photo.jpg": JPEG, "sub/clip.mkv": MKV}


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    allowed = root / "allowed"
    (allowed / "sub").mkdir(parents=True)
    for name, data in FILES.items():
        (allowed / name).write_bytes(data)
    (root / "outside.png").write_bytes(PNG)
    (root / "allowed-not.png").write_bytes(PNG)  # shares the allowed directory's name as a prefix
    (allowed / "escape.png").symlink_to(root / "outside.png")
    return allowed


@pytest.fixture(scope="module")
def offline(tiny_ckpt):
    return Omni(tiny_ckpt)


def _files(media_dir, content):
    """Chat-template parts naming files of ``media_dir`` by their relative names -> full paths."""
    return [{**p, p["type"]: str(media_dir / p[p["type"]])} if p["type"] != "text" else p for p in content]


def _reference(offline, media_dir, content, use_audio_in_video=False):
    """The offline text answer for chat-template parts whose media are the files in ``media_dir``."""
    (out,) = offline.generate([{"role": "user", "content": _files(media_dir, content)}], sampling_params=SamplingParams(
        temperature=0.0, max_tokens=N), use_audio_in_video=use_audio_in_video)
    return out


class ObservedOmni(AsyncOmni):
    """Records the requests the server aborts."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.aborted: list[str] = []

    async def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        return await super().abort(request_id)


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    metrics = ServerMetrics()
    omni = AsyncOmni(tiny_ckpt, on_step=metrics.observe_step)
    yield omni, metrics
    omni.shutdown()


@pytest.fixture(scope="module")
def server(engine, media_dir):
    omni, metrics = engine
    limits = ServerLimits(media=MediaLimits(allowed_dir=str(media_dir)))
    with ServerThread(create_app(omni, MODEL, metrics, limits)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def _ask(client, content, **extra):
    return client.chat.completions.create(model=MODEL, messages=user(*content), temperature=0, max_tokens=N,
                                          extra_body=extra or None)


def _same(resp, ref) -> None:
    assert resp.choices[0].message.content == ref.text
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.usage.completion_tokens == len(ref.token_ids)


def test_audio_and_image_parts_equal_offline_results(client, offline, media_dir):
    cases = [  # (API content, the same as chat-template parts over the files)
        ([input_audio(WAV), "What do you hear?"], [{"type": "audio", "audio": "clip.wav"},
                                                   {"type": "text", "text": "What do you hear?"}]),
        ([url_part("image", data_url("image/png", PNG)), "What is this?"],
         [{"type": "image", "image": "photo.png"}, {"type": "text", "text": "What is this?"}]),
        (["Compare", input_audio(FLAC, "flac"), url_part("image", data_url("image/jpeg", JPEG)), "and",
          url_part("audio", data_url("audio/wav", WAV))],
         [{"type": "text", "text": "Compare"}, {"type": "audio", "audio": "clip.flac"},
          {"type": "image", "image": "photo.jpg"}, {"type": "text", "text": "and"},
          {"type": "audio", "audio": "clip.wav"}]),
    ]
    refs = [_reference(offline, media_dir, parts) for _, parts in cases]
    assert len({r.text for r in refs}) == len(refs)  # the media decide the answer: the cases can tell apart
    with ThreadPoolExecutor(len(cases)) as pool:  # batched together in the engine
        responses = list(pool.map(lambda c: _ask(client, c[0]), cases))
    for resp, ref in zip(responses, refs):
        _same(resp, ref)


def test_video_data_url_with_and_without_its_audio_track(client, offline, media_dir):
    video = url_part("video", data_url("video/x-matroska", MKV))
    parts = [{"type": "video", "video": "sub/clip.mkv"}, {"type": "text", "text": "What happens?"}]
    plain = _reference(offline, media_dir, parts)
    _same(_ask(client, [video, "What happens?"]), plain)
    # use_audio_in_video and fps through mm_processor_kwargs (as vLLM takes them).
    with_track = _reference(offline, media_dir, [{**parts[0], "fps": 5.0}, parts[1]], use_audio_in_video=True)
    assert len(with_track.prompt_token_ids) > len(plain.prompt_token_ids)
    _same(_ask(client, [video, "What happens?"], mm_processor_kwargs={"use_audio_in_video": True, "fps": 5.0}),
          with_track)


def test_files_inside_the_allowed_directory_only(client, server, offline, media_dir):
    ref = _reference(offline, media_dir, [{"type": "image", "image": "photo.png"}, {"type": "text", "text": "?"}])
    path = media_dir / "photo.png"
    for url in ("photo.png", str(path), "file://" + quote(str(path)), "file://localhost" + str(path),
                "sub/../photo.png"):
        _same(_ask(client, [url_part("image", url), "?"]), ref)
    audio = _reference(offline, media_dir, [{"type": "audio", "audio": "clip.wav"}, {"type": "text", "text": "?"}])
    _same(_ask(client, [url_part("audio", "clip.wav"), "?"]), audio)
    # Outside (lexically, through a symlink, a sibling sharing the prefix), missing, not a file, remote host.
    refused = [
        ("../outside.png", "media_url_not_allowed"),
        (str(media_dir.parent / "outside.png"), "media_url_not_allowed"),
        (str(media_dir) + "-not.png", "media_url_not_allowed"),
        ("file://" + str(media_dir.parent / "outside.png"), "media_url_not_allowed"),
        ("escape.png", "media_url_not_allowed"),
        ("/etc/passwd", "media_url_not_allowed"),
        ("file://otherhost" + str(path), "media_url_not_allowed"),
        ("missing.png", "invalid_media"),
        ("file://[bad", "invalid_media"),
        ("sub", "invalid_media"),
        ("clip.wav", "invalid_media"),  # a file, but not an image
    ]
    for url, code in refused:
        body = {"model": MODEL, "messages": user("look", url_part("image", url))}
        resp = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert resp.status_code == 400, (url, resp.text)
        err = resp.json()["error"]
        assert (err["param"], err["code"]) == ("messages.0.content.1", code), (url, err)
        assert "messages.0.content.1" in err["message"]
        assert "outside.png" not in err["message"] or url.endswith("outside.png")  # no resolved paths leak


def test_spoken_answer_to_audio_and_image_equals_offline(client, offline, media_dir):
    talker = SamplingParams(temperature=0.0, max_tokens=TALKER_FRAMES, repetition_penalty=1.0)
    parts = [{"type": "audio", "audio": "clip.wav"}, {"type": "image", "image": "photo.png"},
             {"type": "text", "text": "Say what you hear and see."}]
    (ref,) = offline.generate([{"role": "user", "content": _files(media_dir, parts)}], ["text", "audio"],
                              {"thinker": SamplingParams(temperature=0.0, max_tokens=N), "talker": talker},
                              speaker="ethan")
    assert ref.codes.shape[1] > 0
    resp = client.chat.completions.create(
        model=MODEL, messages=user(input_audio(WAV), url_part("image", data_url("image/png", PNG)),
                                   "Say what you hear and see."),
        modalities=["text", "audio"], audio={"voice": "ethan", "format": "wav"}, temperature=0, max_tokens=N,
        extra_body={"talker": {"temperature": 0, "max_tokens": TALKER_FRAMES, "repetition_penalty": 1.0}})
    _same(resp, ref)
    with wave.open(io.BytesIO(base64.b64decode(resp.choices[0].message.audio.data))) as w:
        got = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    want = to_int16(ref.audio)
    assert got.shape == want.shape and got.size > 0
    diff = np.abs(got.astype(np.int32) - want.astype(np.int32)).max()
    print(f"spoken answer to audio + image: {got.size} samples, max |diff| vs offline {diff} int16 steps")
    assert diff <= MAX_INT16_DIFF


def test_health_answers_while_a_large_media_request_is_decoded(server):
    # 200 s of 16 kHz audio (6.4 MB as WAV, 8.5 MB in the body): decoded, resampled, turned into features and
    # tokenized in the preprocessing pool while /health is probed every 10 ms.
    body = {"model": MODEL, "messages": user(input_audio(audio_file(noise(200.0), 16000)), "Summarize."),
            "max_tokens": 1}
    lat: list[tuple[int, float]] = []
    done = threading.Event()
    prober = threading.Thread(target=_probe_health, args=(server.url, done, lat))
    prober.start()
    try:
        t = time.perf_counter()
        resp = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
        took = time.perf_counter() - t
    finally:
        done.set()
        prober.join()
    assert resp.status_code == 200, resp.text[:300]
    assert resp.json()["usage"]["prompt_tokens"] > 2500  # ~13 audio tokens per second
    print(f"large media request: {took:.2f} s")
    _check_health("a large media request is decoded", lat)


# ---- abort while the encoders run ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gate():
    """Clear it and the engine thread stops after its next stage step (``blocked`` is set) until it is set."""
    ev, blocked = threading.Event(), threading.Event()
    ev.set()
    yield ev, blocked
    ev.set()


@pytest.fixture(scope="module")
def slow_prefill(tiny_ckpt, gate):
    """An engine whose Thinker prefills 16 prompt rows per step: one image (16 rows) per step."""
    ev, blocked = gate
    metrics = ServerMetrics()

    def on_step(events) -> None:
        metrics.observe_step(events)
        if not ev.is_set():
            blocked.set()
            ev.wait(60)

    small = {"stages": {"thinker": {"scheduler": {"max_num_batched_tokens": 16}}}}
    omni = ObservedOmni(tiny_ckpt, pipeline=load_pipeline_config("qwen3_omni", small), on_step=on_step)
    with ServerThread(create_app(omni, MODEL, metrics)) as srv:
        yield omni, srv
    omni.shutdown()


def _raw_post(url: str, path: str, body: dict, request_id: str) -> socket.socket:
    """Send a request and leave its connection open (closing it is the client's disconnect)."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\nX-Request-Id: {request_id}\r\n\r\n".encode() + data)
    return sock


def test_disconnect_while_the_encoders_run_frees_their_outputs(slow_prefill, gate):
    omni, srv = slow_prefill
    ev, blocked = gate
    thinker = omni.engine.orchestrator.stages["thinker"]
    encoders = thinker.runner.model.encoders
    images = [url_part("image", data_url("image/png", image_file(128, 128))) for _ in range(4)]  # 16 rows each
    body = {"model": MODEL, "messages": user(*images, "Describe them."), "max_tokens": 4}
    encoded_before = encoders.stats.items_encoded
    ev.clear()
    blocked.clear()
    sock = _raw_post(srv.url, "/v1/chat/completions", body, "media-abort")
    try:
        assert blocked.wait(60)  # the engine ran one step of this request and is held after it
        held = thinker.stats()  # safe: the engine thread is waiting in the step hook
        assert held["encoder_entries"] >= 1 and held["encoder_holders"] == 1 and held["running"] == 1
        assert "media-abort" in encoders.held
    finally:
        sock.close()  # the client gives up during the prefill
    try:
        deadline = time.monotonic() + 20
        while "media-abort" not in omni.aborted and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "media-abort" in omni.aborted  # the server noticed while the engine still held the request
    finally:
        ev.set()
    deadline = time.monotonic() + 20
    stats = asyncio.run(omni.resource_stats())
    while stats["requests"] and time.monotonic() < deadline:
        time.sleep(0.02)
        stats = asyncio.run(omni.resource_stats())
    t = stats["thinker"]
    assert stats["requests"] == 0 and t["running"] == 0 and t["records"] == 0 and t["kv_usage"] == 0
    assert t["encoder_entries"] == 0 and t["encoder_holders"] == 0 and not encoders.held
    # The prompt was never fully prefilled: some of its images were never encoded.
    assert 1 <= encoders.stats.items_encoded - encoded_before < 4
    text = httpx.get(srv.url + "/metrics").text
    assert re.search(r'omnistage_encoder_cache_entries\{stage="thinker"\} 0\.0', text)
    assert re.search(r"omnistage_requests_in_flight 0\.0", text)
    assert _metric(text, r'omnistage_requests_total\{finish_reason="abort"\}') == 1  # counted, though it said nothing


def _metric(text: str, pattern: str) -> float:
    m = re.search(pattern + r" ([0-9.e+-]+)", text)
    return float(m.group(1)) if m else 0.0


def test_time_to_first_token_counts_the_media_encoding_and_prefill(slow_prefill, gate):
    omni, srv = slow_prefill
    ev, blocked = gate
    body = {"model": MODEL, "messages": user(url_part("image", data_url("image/png", PNG)), "?"), "max_tokens": 1}
    before = _metric(httpx.get(srv.url + "/metrics").text, "omnistage_time_to_first_token_seconds_sum")
    ev.clear()
    blocked.clear()
    with ThreadPoolExecutor(1) as pool:
        reply = pool.submit(httpx.post, srv.url + "/v1/chat/completions", json=body, timeout=60)
        assert blocked.wait(60)  # the first prefill step (encoding the image) ran; hold the engine 0.5 s
        time.sleep(0.5)
        ev.set()
        assert reply.result().status_code == 200
    ttft = _metric(httpx.get(srv.url + "/metrics").text, "omnistage_time_to_first_token_seconds_sum") - before
    assert ttft >= 0.5
