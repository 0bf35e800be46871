"""``POST /v1/audio/transcriptions`` on the real engine (tiny checkpoint), driven by the official openai client:
the transcript is the Thinker's own greedy answer to the same prompt (the audio, then the transcription
instruction; a chat completion with those two parts is the reference), in json / text / verbose_json and
streamed; concurrent files keep their own transcripts; bad fields are 4xx naming the field."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import openai
import pytest
from realtime_audio import speech_like
from server_thread import ServerThread
from test_realtime import _input_audio

from omnistage.entrypoints.audio_format import encode_wav
from omnistage.entrypoints.limits import ServerLimits
from omnistage.entrypoints.metrics import ServerMetrics
from omnistage.entrypoints.server import create_app
from omnistage.entrypoints.speech_to_text import instruction
from omnistage.pipeline.omni import AsyncOmni

MODEL = "tiny-omni"
LIMIT = 10  # transcript tokens on this server


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    omni = AsyncOmni(tiny_ckpt)
    try:
        with ServerThread(create_app(omni, MODEL, ServerMetrics(), ServerLimits(max_transcript_tokens=LIMIT))) as srv:
            yield srv
    finally:
        omni.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def _clip(seed: int, seconds: float = 1.0) -> np.ndarray:
    return speech_like(seconds, seed=seed)


def _wav(clip: np.ndarray) -> bytes:
    return encode_wav(clip, 24000)


def _reference(server, clip: np.ndarray, language: str | None = None, prompt: str | None = None) -> tuple[str, dict]:
    """The chat completion of the same prompt: the clip, then the instruction; greedy, the same limit."""
    body = {"model": MODEL, "temperature": 0, "max_tokens": LIMIT, "modalities": ["text"], "messages": [
        {"role": "user", "content": [_input_audio(clip), {"type": "text", "text": instruction(language, prompt)}]}]}
    resp = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["message"]["content"], resp.json()["usage"]


def test_a_wav_is_transcribed_as_the_thinker_answers_its_prompt_in_every_format(server, client):
    clip = _clip(1)
    want, usage = _reference(server, clip, "en", "a weather report")
    assert want
    got = client.audio.transcriptions.create(model="gpt-4o-transcribe", file=("clip.wav", _wav(clip), "audio/wav"),
                                             language="en", prompt="a weather report")
    assert got.text == want
    assert (got.usage.type, got.usage.input_tokens, got.usage.output_tokens) == (
        "tokens", usage["prompt_tokens"], usage["completion_tokens"])
    assert got.usage.input_token_details.audio_tokens > 0
    assert got.usage.total_tokens == got.usage.input_tokens + got.usage.output_tokens
    want, _ = _reference(server, clip)
    text = client.audio.transcriptions.create(model="whisper-1", file=("clip.wav", _wav(clip)), response_format="text")
    assert text == want
    verbose = client.audio.transcriptions.create(model=MODEL, file=("clip.wav", _wav(clip)), language="de",
                                                 response_format="verbose_json")
    assert (verbose.task, verbose.language, verbose.duration) == ("transcribe", "german", 1.0)
    assert verbose.text == _reference(server, clip, "de")[0]


def test_a_streamed_transcription_sends_deltas_then_the_whole_text(server, client):
    clip = _clip(2)
    want, usage = _reference(server, clip)
    events = list(client.audio.transcriptions.create(model="gpt-4o-mini-transcribe", file=("clip.wav", _wav(clip)),
                                                     stream=True))
    assert [e.type for e in events] == ["transcript.text.delta"] * (len(events) - 1) + ["transcript.text.done"]
    assert "".join(e.delta for e in events[:-1]) == events[-1].text == want
    assert events[-1].usage.output_tokens == usage["completion_tokens"]


def test_concurrent_files_keep_their_own_transcripts(server):
    clips = [_clip(3, 0.6), _clip(4, 1.4), _clip(5, 0.9)]
    wants = [_reference(server, c)[0] for c in clips]

    async def one(http: httpx.AsyncClient, clip: np.ndarray) -> str:
        resp = await http.post("/v1/audio/transcriptions", data={"model": "whisper-1"},
                               files={"file": ("c.wav", _wav(clip), "audio/wav")})
        assert resp.status_code == 200, resp.text
        return resp.json()["text"]

    async def all_at_once() -> list[str]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            return await asyncio.gather(*(one(http, c) for c in clips))

    assert asyncio.run(all_at_once()) == wants


def test_temperature_samples_within_the_limit(server):
    resp = httpx.post(server.url + "/v1/audio/transcriptions", data={"model": "whisper-1", "temperature": "0.9"},
                      files={"file": ("c.wav", _wav(_clip(6)))}, timeout=120)
    assert resp.status_code == 200, resp.text
    assert 0 < resp.json()["usage"]["output_tokens"] <= LIMIT


BAD = [  # (form fields, files, status, param, code)
    ({"model": "whisper-1"}, None, 400, "file", "invalid_request_error"),
    ({}, {"file": ("c.wav", b"x")}, 400, "model", "invalid_request_error"),
    ({"model": "whisper-1"}, {"file": ("c.wav", b"not audio at all")}, 400, "file", "invalid_media"),
    ({"model": "whisper-1"}, {"file": ("c.wav", b"")}, 400, "file", "invalid_media"),
    ({"model": "nope"}, "wav", 404, "model", "model_not_found"),
    ({"model": "gpt-4o-transcribe-diarize"}, "wav", 400, "model", "invalid_value"),
    ({"model": "whisper-1", "response_format": "srt"}, "wav", 400, "response_format", "unsupported_parameter"),
    ({"model": "whisper-1", "response_format": "xml"}, "wav", 400, "response_format", "invalid_request_error"),
    ({"model": "whisper-1", "temperature": "2"}, "wav", 400, "temperature", "invalid_request_error"),
    ({"model": "whisper-1", "stream": "maybe"}, "wav", 400, "stream", "invalid_request_error"),
    ({"model": "whisper-1", "language": "English"}, "wav", 400, "language", "invalid_value"),
    ({"model": "whisper-1", "timestamp_granularities[]": "word"}, "wav", 400, "timestamp_granularities",
     "unsupported_parameter"),
]


@pytest.mark.parametrize("fields,files,status,param,code", BAD)
def test_bad_fields_are_4xx_naming_the_field(server, fields, files, status, param, code):
    if files == "wav":
        files = {"file": ("c.wav", _wav(_clip(7, 0.3)))}
    resp = httpx.post(server.url + "/v1/audio/transcriptions", data=fields, files=files, timeout=60)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and code in (err["code"], err["type"]), err


def test_a_json_body_is_refused_naming_the_file(server):
    resp = httpx.post(server.url + "/v1/audio/transcriptions", json={"model": "whisper-1"}, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "file"
