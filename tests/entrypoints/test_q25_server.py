"""The real server on a Qwen2.5-Omni checkpoint (picked from config.json with no other flag), driven by the
official openai client: chat with audio and /v1/audio/speech equal the offline ``Omni.generate`` result for
the same greedy, seeded request; the same media content parts as Qwen3-Omni's (``input_audio``, image, audio
and video data URLs, ``use_audio_in_video`` through ``mm_processor_kwargs``) give the offline answers, spoken
ones included; an unknown voice is a 400 that lists the checkpoint's voices (and OpenAI's names mapped onto
them)."""

from __future__ import annotations

import base64
import io
import wave

import httpx
import numpy as np
import openai
import pytest
from media_files import audio_file, data_url, image_file, input_audio, noise, url_part, user, video_file
from server_thread import ServerThread
from test_server import _check_audio

from omnistage.core.sampling_params import SamplingParams
from omnistage.entrypoints.audio_format import to_int16
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


WAV = audio_file(noise(2.0, 22050, channels=2), 22050)  # stereo at 22.05 kHz: mixed down and resampled
PNG = image_file(90, 150)
MKV = video_file(8, 56, 56, 4, track=noise(2.0)[:, 0])  # 2 s at 4 fps, with its audio track


def _offline(q25_ckpt, content, modalities=("text",), use_audio_in_video=False):
    """The offline answer for chat-template parts (decoded as the server decodes its data URLs)."""
    params = {"thinker": SamplingParams(temperature=0.0, max_tokens=TEXT_TOKENS),
              "talker": SamplingParams(temperature=0.0, max_tokens=CODES, seed=SEED)}
    (out,) = _offline_omni(q25_ckpt).generate([{"role": "user", "content": content}], list(modalities), params,
                                              speaker="ethan", use_audio_in_video=use_audio_in_video)
    return out


_OFFLINE: dict = {}


def _offline_omni(ckpt):
    if ckpt not in _OFFLINE:
        _OFFLINE[ckpt] = Omni(ckpt)
    return _OFFLINE[ckpt]


def test_media_parts_equal_offline_generation(client, q25_ckpt, tmp_path):
    """Audio, image and video parts (with the video's own track through mm_processor_kwargs) give the offline
    greedy answers; the prompt counts the speech system turn and every placeholder."""
    files = {"clip.wav": WAV, "photo.png": PNG, "clip.mkv": MKV}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    cases = [  # (API content, chat-template parts over the same files, use_audio_in_video)
        ([input_audio(WAV), "What do you hear?"],
         [{"type": "audio", "audio": str(tmp_path / "clip.wav")}, {"type": "text", "text": "What do you hear?"}],
         False),
        ([url_part("image", data_url("image/png", PNG)), "and", input_audio(WAV)],
         [{"type": "image", "image": str(tmp_path / "photo.png")}, {"type": "text", "text": "and"},
          {"type": "audio", "audio": str(tmp_path / "clip.wav")}], False),
        ([url_part("video", data_url("video/x-matroska", MKV)), "What happens?"],
         [{"type": "video", "video": str(tmp_path / "clip.mkv"), "fps": 4.0},
          {"type": "text", "text": "What happens?"}], True),
    ]
    refs = [_offline(q25_ckpt, parts, use_audio_in_video=uav) for _, parts, uav in cases]
    assert len({tuple(r.prompt_token_ids) for r in refs}) == len(refs)
    for (content, _, uav), ref in zip(cases, refs):
        extra = {"mm_processor_kwargs": {"use_audio_in_video": True, "fps": 4.0}} if uav else None
        resp = client.chat.completions.create(model=MODEL, messages=user(*content), temperature=0,
                                              max_tokens=TEXT_TOKENS, extra_body=extra)
        assert resp.choices[0].message.content == ref.text
        assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert resp.usage.completion_tokens == len(ref.token_ids)


def test_spoken_answer_to_a_spoken_question_equals_offline(client, q25_ckpt, tmp_path):
    (tmp_path / "clip.wav").write_bytes(WAV)
    ref = _offline(q25_ckpt, [{"type": "audio", "audio": str(tmp_path / "clip.wav")}], ("text", "audio"))
    assert ref.codes.shape[1] > 0
    resp = client.chat.completions.create(
        model=MODEL, messages=user(input_audio(WAV)), modalities=["text", "audio"],
        audio={"voice": "ethan", "format": "wav"}, temperature=0, seed=SEED, max_tokens=TEXT_TOKENS,
        extra_body={"talker": {"temperature": 0, "max_tokens": CODES}})
    assert resp.choices[0].message.content == ref.text
    with wave.open(io.BytesIO(base64.b64decode(resp.choices[0].message.audio.data))) as w:
        got = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    want = to_int16(ref.audio)
    assert got.shape == want.shape and got.size > 0
    assert np.abs(got.astype(np.int32) - want.astype(np.int32)).max() <= 4  # 1e-4 of full scale


def test_playground_lists_the_media_the_model_takes(server):
    assert httpx.get(server + "/playground/info").json()["input_modalities"] == ["text", "audio", "image", "video"]
