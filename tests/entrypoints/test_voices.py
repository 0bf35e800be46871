"""OpenAI's voice names mapped to the model's (``entrypoints.voices``, ``--voice-map``): the default cycle, the
overrides, and every place a voice is taken (chat completions, speech, realtime sessions) against ``FakeOmni``
(voices ethan, chelsie)."""

from __future__ import annotations

import argparse
import asyncio

import httpx
import pytest
from fake_omni import FakeOmni
from realtime_client import client, of, send_raw, until
from server_thread import ServerThread

from omnistage.entrypoints import serve_args
from omnistage.entrypoints.server import create_app
from omnistage.entrypoints.voices import OPENAI_VOICES, UnknownVoice, VoiceMap, parse_voice_map

MODEL = "fake-omni"


def test_default_map_cycles_over_the_model_voices_and_overrides_win():
    default = VoiceMap(("ethan", "chelsie"))
    assert [default.resolve(v) for v in OPENAI_VOICES] == ["ethan", "chelsie"] * 5
    assert default.resolve("Chelsie") == "chelsie" and default.resolve("ALLOY") == "ethan"
    mapped = VoiceMap(("ethan", "chelsie"), parse_voice_map(" alloy=Chelsie, narrator=ethan "))
    assert (mapped.resolve("alloy"), mapped.resolve("narrator"), mapped.resolve("ash")) == ("chelsie", "ethan",
                                                                                            "chelsie")
    with pytest.raises(UnknownVoice, match=r"'nobody'.*\['chelsie', 'ethan'\].*'alloy'.*'narrator'"):
        mapped.resolve("nobody")
    assert VoiceMap(()).aliases == {}  # a model that does not speak maps nothing


@pytest.mark.parametrize("text, match", [
    ("alloy", "not NAME=MODEL_VOICE"), ("alloy=", "not NAME=MODEL_VOICE"), ("=ethan", "not NAME=MODEL_VOICE"),
    ("alloy=ethan,ALLOY=chelsie", "twice"),
])
def test_malformed_voice_maps_are_refused(text, match):
    with pytest.raises(ValueError, match=match):
        parse_voice_map(text)


@pytest.mark.parametrize("overrides, match", [({"alloy": "zed"}, "not one of the model's voices"),
                                              ({"ethan": "chelsie"}, "one of the model's own voices")])
def test_maps_onto_voices_the_model_lacks_are_refused(overrides, match):
    with pytest.raises(ValueError, match=match):
        VoiceMap(("ethan", "chelsie"), overrides)


def test_serve_takes_the_voice_map_option(monkeypatch):
    parser = argparse.ArgumentParser()
    serve_args.add_serve_arguments(parser)
    seen = {}
    monkeypatch.setattr(serve_args, "serve", lambda *a, **kw: seen.update(kw))
    serve_args.serve_from_args(parser.parse_args(["--voice-map", "alloy=chelsie,echo=ethan"]))
    assert seen["voice_map"] == {"alloy": "chelsie", "echo": "ethan"}
    with pytest.raises(SystemExit):
        parser.parse_args(["--voice-map", "alloy"])


@pytest.fixture(scope="module")
def fake():
    return FakeOmni(answer="hi", delay=0.0)


@pytest.fixture(scope="module")
def server(fake):
    with ServerThread(create_app(fake, MODEL, voice_map={"alloy": "chelsie"})) as srv:
        yield srv


def test_http_chat_and_speech_speak_mapped_names_with_the_model_voice(server, fake):
    for name, want in (("alloy", "chelsie"), ("ash", "chelsie"), ("echo", "ethan"), ("Ethan", "ethan")):
        resp = httpx.post(server.url + "/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "modalities": ["text", "audio"],
            "audio": {"voice": name, "format": "wav"}})
        assert resp.status_code == 200, resp.text
        assert fake.submitted[-1]["speaker"] == want
        resp = httpx.post(server.url + "/v1/audio/speech", json={"model": MODEL, "input": "hi", "voice": name})
        assert resp.status_code == 200, resp.text
        assert fake.submitted[-1]["speaker"] == want
    resp = httpx.post(server.url + "/v1/audio/speech", json={"model": MODEL, "input": "hi", "voice": "nobody"})
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert (err["code"], err["param"]) == ("invalid_voice", "voice")
    assert "'ethan'" in err["message"] and "'alloy'" in err["message"] and "'cedar'" in err["message"]


def test_realtime_sessions_echo_the_chosen_name_and_speak_its_model_voice(server, fake):
    async def scenario():
        async with client(server.url).realtime.connect(model=MODEL) as conn:
            await conn.session.update(session={"type": "realtime", "audio": {"output": {"voice": "alloy"},
                                                                             "input": {"turn_detection": None}}})
            assert (await until(conn, "session.updated"))[-1].session.audio.output.voice == "alloy"
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": "Hi"}]})
            await conn.response.create()
            done = of(await until(conn, "response.done"), "response.done")[0].response
            assert done.audio.output.voice == "alloy" and fake.submitted[-1]["speaker"] == "chelsie"
            await conn.response.create(response={"audio": {"output": {"voice": "echo"}}})
            await until(conn, "response.done")
            assert fake.submitted[-1]["speaker"] == "ethan"  # the default cycle: echo is OpenAI's 5th name
            await send_raw(conn, {"type": "session.update",
                                  "session": {"audio": {"output": {"voice": "nobody"}}}})
            err = (await until(conn, "error"))[-1].error
            assert (err.code, err.param) == ("invalid_voice", "session.audio.output.voice")
            assert "'chelsie'" in err.message and "'marin'" in err.message

    asyncio.run(scenario())
