"""The real server on a Qwen2.5-Omni checkpoint (picked from config.json with no other flag), driven by the
official openai client: chat with audio and /v1/audio/speech equal the offline ``Omni.generate`` result for
the same greedy, seeded request; an unknown voice is a 400 that lists the checkpoint's voices (and OpenAI's names mapped onto them)."""

from __future__ import annotations

import base64
import io
import wave

import httpx
import numpy as np
import openai
import pytest
from server_thread import ServerThread
from test_server import _check_audio

from omnistage.entrypoints.metrics import ServerMetrics
from omnistage.entrypoints.server import create_app
from omnistage.pipeline.omni import AsyncOmni, Omni

MODEL = "tiny-qwen2.5-omni"
PROMPT, TEXT_TOKENS, CODES, SEED = "Tell me a short story about the sea.", 6, 30, 7
# The seed makes the spoken answer reproducible: it seeds the Talker and Token2Wav's ODE noise.
REQUEST = {"temperature": 0, "seed": SEED, "max_tokens": TEXT_TOKENS}
TALKER = {"talker": {"max_tokens": CODES}}


@pytest.fixture(scope="module")
def reference(q25_ckpt):
    """The same request offline: what the server must return (its params built as the server builds them)."""
    omni = Omni(q25_ckpt)
    defaults = omni.info.stage_sampling
    params = {"thinker": defaults["thinker"].replace(temperature=0.0, seed=SEED, max_tokens=TEXT_TOKENS),
              "talker": defaults["talker"].replace(temperature=0.0, seed=SEED, max_tokens=CODES)}
    (out,) = omni.generate(PROMPT, ["text", "audio"], params, speaker="ethan")
    assert out.codes.shape[1] > 8 and out.audio.numel() == out.codes.shape[1] * 2 * 240
    return out


@pytest.fixture(scope="module")
def server(q25_ckpt):
    metrics = ServerMetrics()
    omni = AsyncOmni(q25_ckpt, on_step=metrics.observe_step)
    assert omni.info.family == "qwen2_5_omni" and omni.info.voices == ("chelsie", "ethan")
    try:
        with ServerThread(create_app(omni, MODEL, metrics)) as srv:
            yield srv.url
    finally:
        omni.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="x", max_retries=0, timeout=120)


def test_chat_with_audio(client, reference):
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], modalities=["text", "audio"],
        audio={"voice": "ethan", "format": "wav"}, extra_body=TALKER, **REQUEST)
    msg = resp.choices[0].message
    assert msg.content == reference.text and msg.audio.transcript == reference.text
    assert resp.usage.prompt_tokens == len(reference.prompt_token_ids)  # the speech system prompt included
    with wave.open(io.BytesIO(base64.b64decode(msg.audio.data))) as w:
        assert w.getframerate() == 24000 and w.getnchannels() == 1
        _check_audio(np.frombuffer(w.readframes(w.getnframes()), dtype="<i2"), reference)


def test_speech(client, reference):
    resp = client.audio.speech.create(model=MODEL, input=PROMPT, voice="ethan", response_format="wav",
                                      extra_body={**REQUEST, **TALKER})
    with wave.open(io.BytesIO(resp.content)) as w:
        _check_audio(np.frombuffer(w.readframes(w.getnframes()), dtype="<i2"), reference)


def test_unknown_voice_is_a_400_listing_the_voices(client):
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       modalities=["text", "audio"], audio={"voice": "nobody", "format": "wav"})
    with pytest.raises(openai.BadRequestError) as speech:
        client.audio.speech.create(model=MODEL, input="Hi", voice="nobody")
    for err, param in ((chat.value, "audio.voice"), (speech.value, "voice")):
        body = err.body if "message" in err.body else err.body["error"]
        assert body["message"] == ("unknown voice 'nobody'; available: the model's voices ['chelsie', 'ethan'] and "
                                   "the names mapped to them ['alloy', 'ash', 'ballad', 'cedar', 'coral', 'echo', "
                                   "'marin', 'sage', 'shimmer', 'verse']")
        assert body["param"] == param and body["code"] == "invalid_voice"


def test_playground_describes_the_family(server):
    info = httpx.get(server + "/playground/info").json()
    assert info["family"] == "qwen2_5_omni" and info["output_modalities"] == ["text", "audio"]
    assert info["voices"] == ["chelsie", "ethan"] and info["default_voice"] == "chelsie"
    assert info["sample_rate"] == 24000
