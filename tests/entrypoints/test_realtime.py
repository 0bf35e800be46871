"""Realtime sessions on the real engine (AsyncOmni on the tiny checkpoint, uvicorn on 127.0.0.1) driven by
the official openai SDK's realtime client: answers (text and audio) equal the HTTP chat completion for the same
history (greedy; spoken turns as input_audio), barge-in and a vanished client free every stage."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import time

import httpx
import numpy as np
import pytest
from realtime_audio import b64_chunks, pcm, silence, speech_like
from realtime_client import client, of, text_of, until
from server_thread import ServerThread
from test_server import _idle

from omnistage.entrypoints.audio_format import encode_wav
from omnistage.entrypoints.limits import ServerLimits
from omnistage.entrypoints.metrics import ServerMetrics
from omnistage.entrypoints.realtime.config import FunctionTool
from omnistage.entrypoints.server import create_app
from omnistage.entrypoints.speech_to_text import instruction
from omnistage.models.tool_calls import call_text, response_text, system_text
from omnistage.pipeline.omni import AsyncOmni

MODEL = "tiny-omni"
N = 8  # Thinker tokens per answer
FRAMES = 30  # Talker frames per answer (> the 25-frame first Code2Wav chunk)
TALKER = {"temperature": 0, "max_tokens": FRAMES, "repetition_penalty": 1.0}
# Exactly N tokens (min_tokens): answers long enough to stream, the same length on every side.
GREEDY = {"max_output_tokens": N, "sampling": {"temperature": 0, "min_tokens": N, "talker": TALKER}}
# An answer that cannot end early: thousands of steps in every stage (min_tokens = max_tokens, no EOS).
LONG = {"max_output_tokens": 2000, "sampling": {"temperature": 0, "min_tokens": 2000, "ignore_eos": True, "talker": {
    "temperature": 0, "repetition_penalty": 1.0, "max_tokens": 2000, "min_tokens": 2000}}}
TRANSCRIPT_TOKENS = 12  # a transcript's limit on this server
MAX_INT16_DIFF = 4  # as the HTTP tests: 1e-4 of full scale
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    metrics = ServerMetrics()
    omni = AsyncOmni(tiny_ckpt, on_step=metrics.observe_step)
    yield omni, metrics
    omni.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    omni, metrics = engine
    with ServerThread(create_app(omni, MODEL, metrics, limits=ServerLimits(max_transcript_tokens=TRANSCRIPT_TOKENS))) as srv:
        yield srv


async def _wait_idle(omni) -> dict:
    deadline = time.monotonic() + 20
    stats = await omni.resource_stats()
    while not _idle(stats) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        stats = await omni.resource_stats()
    assert _idle(stats), stats
    return stats


async def _http_answer(url: str, messages: list[dict]) -> tuple[str, np.ndarray, dict]:
    """The HTTP chat completion for the same history (greedy, same limits): text, int16 audio, usage."""
    body = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": N, "min_tokens": N,
            "modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "pcm16"}, "talker": TALKER}
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        resp = await http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    ref = resp.json()
    msg = ref["choices"][0]["message"]
    return msg["content"], np.frombuffer(base64.b64decode(msg["audio"]["data"]), dtype="<i2"), ref["usage"]


def _input_audio(clip: np.ndarray) -> dict:
    """The clip as the HTTP API's input_audio part (a 24 kHz WAV)."""
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(encode_wav(clip, 24000)).decode(),
                                                   "format": "wav"}}


def _user(text: str) -> dict:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def _audio(events) -> np.ndarray:
    chunks = [pcm(e.delta) for e in of(events, "response.output_audio.delta")]
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int16)


def _check_audio(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape and got.size > 0
    assert np.abs(got.astype(np.int32) - want.astype(np.int32)).max() <= MAX_INT16_DIFF


def _check_done(events, status: str) -> object:
    done = of(events, "response.done")[0].response
    assert done.status == status, done
    return done


def test_text_turns_stream_text_and_audio_equal_to_http_chat(server):
    async def scenario():
        async with client(server.url).realtime.connect(model=MODEL) as conn:
            created = (await until(conn, "session.created"))[-1].session
            assert created.output_modalities == ["audio"] and created.audio.output.voice == "ethan"
            await conn.session.update(session={"type": "realtime", "instructions": "Be brief.", **GREEDY})
            await until(conn, "session.updated")
            history = [{"role": "system", "content": "Be brief."}]
            for turn, prompt in enumerate(("Hi", "Tell me a short story about the sea.")):
                await conn.conversation.item.create(item=_user(prompt))
                await conn.response.create()
                events = await until(conn, "response.done")
                done = _check_done(events, "incomplete")  # exactly N tokens: the length limit ends it
                assert done.status_details.reason == "max_output_tokens"
                text = text_of(events)
                assert of(events, "response.output_audio_transcript.done")[0].transcript == text
                assert done.output[0].content[0].transcript == text
                assert done.usage.output_token_details.text_tokens == N
                assert done.usage.output_token_details.audio_tokens > 0
                if turn:  # the re-sent history comes from the prefix cache, and the usage says how much
                    assert 0 < done.usage.input_token_details.cached_tokens < done.usage.input_tokens
                deltas = of(events, "response.output_audio.delta")
                assert max(pcm(e.delta).size for e in deltas) <= 12000  # at most 0.5 s per delta
                history.append({"role": "user", "content": prompt})
                want, want_audio, usage = await _http_answer(server.url, history)
                assert text == want
                assert done.usage.input_tokens == usage["prompt_tokens"]
                _check_audio(_audio(events), want_audio)
                history.append({"role": "assistant", "content": text})

    asyncio.run(scenario())


def test_spoken_turn_with_server_vad_is_answered_as_http_chat_answers_that_audio(server):
    sent = np.concatenate([silence(0.6), speech_like(1.2, seed=1), silence(0.9)])

    async def scenario():
        async with client(server.url).realtime.connect(model=MODEL) as conn:
            await conn.session.update(session={"type": "realtime", **GREEDY})  # audio out, server VAD: defaults
            await until(conn, "session.updated")
            for chunk in b64_chunks(sent):
                await conn.input_audio_buffer.append(audio=chunk)
            events = await until(conn, "response.done")
            start = of(events, "input_audio_buffer.speech_started")[0]
            stop = of(events, "input_audio_buffer.speech_stopped")[0]
            assert 600 - 300 - 40 <= start.audio_start_ms <= 600 - 300 + 60
            assert of(events, "input_audio_buffer.committed")[0].item_id == start.item_id
            clip = sent[start.audio_start_ms * 24:stop.audio_end_ms * 24]
            want, want_audio, _ = await _http_answer(server.url, [{"role": "user", "content": [_input_audio(clip)]}])
            assert text_of(events) == want and want
            done = _check_done(events, "incomplete")
            assert done.usage.input_token_details.audio_tokens > 0
            _check_audio(_audio(events), want_audio)

    asyncio.run(scenario())


async def _http_transcript(url: str, clip: np.ndarray, language: str | None) -> tuple[str, dict]:
    """The Thinker alone on the same prompt (the clip, then the transcription instruction), greedy."""
    body = {"model": MODEL, "temperature": 0, "max_tokens": TRANSCRIPT_TOKENS, "modalities": ["text"],
            "messages": [{"role": "user", "content": [_input_audio(clip),
                                                      {"type": "text", "text": instruction(language)}]}]}
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        resp = await http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["message"]["content"], resp.json()["usage"]


def test_input_transcription_is_the_thinkers_own_and_the_answer_beside_it_is_unchanged(server, engine):
    sent = np.concatenate([silence(0.6), speech_like(1.2, seed=1), silence(0.9)])

    async def scenario():
        async with client(server.url).realtime.connect(model=MODEL) as conn:
            await conn.session.update(session={"type": "realtime", **GREEDY, "audio": {"input": {
                "transcription": {"model": "whisper-1", "language": "en"}}}})
            await until(conn, "session.updated")
            for chunk in b64_chunks(sent):
                await conn.input_audio_buffer.append(audio=chunk)
            events = await until(conn, "response.done")
            if not of(events, "conversation.item.input_audio_transcription.completed"):
                events += await until(conn, "conversation.item.input_audio_transcription.completed")
            assert not of(events, "error") and not of(events, "conversation.item.input_audio_transcription.failed")
            start = of(events, "input_audio_buffer.speech_started")[0]
            stop = of(events, "input_audio_buffer.speech_stopped")[0]
            clip = sent[start.audio_start_ms * 24:stop.audio_end_ms * 24]
            done = of(events, "conversation.item.input_audio_transcription.completed")[0]
            deltas = of(events, "conversation.item.input_audio_transcription.delta")
            assert done.item_id == start.item_id and {d.item_id for d in deltas} == {start.item_id}
            want, usage = await _http_transcript(server.url, clip, "en")
            assert done.transcript == "".join(d.delta for d in deltas) == want and want
            assert (done.usage.input_tokens, done.usage.output_tokens) == (usage["prompt_tokens"],
                                                                          usage["completion_tokens"])
            # The answer, computed beside the transcription, is the same as without it.
            answer, answer_audio, _ = await _http_answer(server.url, [{"role": "user", "content": [_input_audio(clip)]}])
            assert text_of(events) == answer
            _check_audio(_audio(events), answer_audio)
            await conn.conversation.item.retrieve(item_id=start.item_id)
            assert (await until(conn, "conversation.item.retrieved"))[-1].item.content[0].transcript == want
        await _wait_idle(engine[0])

    asyncio.run(scenario())


def test_barge_in_cancels_everywhere_and_the_next_turn_starts_from_what_was_played(server, engine):
    omni, _ = engine
    speech = speech_like(0.8, seed=2)

    async def scenario():
        async with client(server.url).realtime.connect(model=MODEL) as conn:
            await conn.session.update(session={"type": "realtime", **LONG})
            await until(conn, "session.updated")
            await conn.conversation.item.create(item=_user("Tell me everything."))
            await conn.response.create()
            first = await until(conn, "response.output_audio.delta")
            await asyncio.sleep(0.3)  # the client plays some of it
            sent = [silence(0.2)]
            for chunk in b64_chunks(sent[0]):
                await conn.input_audio_buffer.append(audio=chunk)
            # The user speaks: the answer (thousands of steps from its end) is cancelled in every stage.
            for chunk in b64_chunks(speech):
                await conn.input_audio_buffer.append(audio=chunk)
            sent.append(speech)
            events = first + await until(conn, "response.done")
            (started,) = of(events, "input_audio_buffer.speech_started")
            done = _check_done(events, "cancelled")
            assert done.status_details.reason == "turn_detected"
            played = done.output[0].content[0].transcript
            assert done.output[0].status == "incomplete"
            assert text_of(events).startswith(played) and len(played) < len(text_of(events))
            await _wait_idle(omni)
            # The next turn: the speech ends, is committed and answered normally.
            await conn.session.update(session={"type": "realtime", **GREEDY})
            await until(conn, "session.updated")
            tail = silence(0.9)
            for chunk in b64_chunks(tail):
                await conn.input_audio_buffer.append(audio=chunk)
            sent.append(tail)
            events = await until(conn, "response.done")
            _check_done(events, "incomplete")
            stop = of(events, "input_audio_buffer.speech_stopped")[0]
            assert stop.item_id == started.item_id
            clip = np.concatenate(sent)[started.audio_start_ms * 24:stop.audio_end_ms * 24]
            messages = [{"role": "user", "content": "Tell me everything."}, {"role": "assistant", "content": played},
                        {"role": "user", "content": [_input_audio(clip)]}]
            want, want_audio, _ = await _http_answer(server.url, messages)
            assert text_of(events) == want
            _check_audio(_audio(events), want_audio)

    asyncio.run(scenario())


def test_a_client_that_vanishes_mid_response_frees_everything(server, engine):
    omni, _ = engine

    def metric(name: str) -> float:
        m = re.search(rf"^{name} ([0-9.e+-]+)$", httpx.get(server.url + "/metrics").text, re.M)
        return float(m.group(1)) if m else 0.0

    cancelled = 'omnistage_realtime_turns_total{status="cancelled"}'
    before = metric(re.escape(cancelled))

    async def scenario():
        conn = await client(server.url).realtime.connect(model=MODEL).enter()
        await conn.session.update(session={"type": "realtime", **LONG})
        await conn.conversation.item.create(item=_user("Tell me everything."))
        await conn.response.create()
        await until(conn, "response.output_audio.delta")
        assert (await omni.resource_stats())["requests"] == 1
        conn._connection.transport.abort()  # gone: no close handshake
        await _wait_idle(omni)

    asyncio.run(scenario())
    deadline = time.monotonic() + 10
    while metric("omnistage_realtime_sessions") != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric("omnistage_realtime_sessions") == 0
    assert metric(re.escape(cancelled)) == before + 1


def test_tools_on_the_real_engine_prompt_and_function_output_round_trip(server):

    async def scenario():
        async with client(server.url).realtime.connect(model=MODEL) as conn:
            await conn.session.update(session={"type": "realtime", "tools": [WEATHER], **GREEDY})
            tools = (await until(conn, "session.updated"))[-1].session.tools
            assert [t.name for t in tools] == ["get_weather"]
            await conn.conversation.item.create(item=_user("Weather in Paris?"))
            await conn.response.create()
            first = await until(conn, "response.done")
            system = system_text("", [FunctionTool("get_weather", WEATHER["description"],
                                                   json.dumps(WEATHER["parameters"]))])
            history = [{"role": "system", "content": system}, {"role": "user", "content": "Weather in Paris?"}]
            want, want_audio, _ = await _http_answer(server.url, history)
            assert text_of(first) == want  # no call: the held speech is released, as HTTP speaks it
            _check_audio(_audio(first), want_audio)
            # A call the client adds (as if the model had made it) and its result: the next answer hears both.
            await conn.conversation.item.create(item={"type": "function_call", "call_id": "call_1",
                                                      "name": "get_weather", "arguments": '{"city": "Paris"}'})
            await conn.conversation.item.create(item={"type": "function_call_output", "call_id": "call_1",
                                                      "output": '{"temp": 21}'})
            await until(conn, "conversation.item.done")
            await conn.response.create()
            second = await until(conn, "response.done")
            history += [{"role": "assistant", "content": want + "\n" + call_text("get_weather", '{"city": "Paris"}')},
                        {"role": "user", "content": response_text('{"temp": 21}')}]
            want2, want_audio2, _ = await _http_answer(server.url, history)
            assert text_of(second) == want2
            _check_audio(_audio(second), want_audio2)

    asyncio.run(scenario())


def test_forced_tool_call_on_the_real_engine_continues_the_call_prefix_after_user_audio(server, engine):
    omni, _ = engine
    clip = speech_like(1.0, seed=2)

    async def direct(messages: list[dict], prefix: str) -> str:
        """The engine's own greedy text for the prompt rendered with the prefix (what the response must see)."""
        prompt = omni.render_prompt(messages, answer_prefix=prefix)
        params = {"thinker": omni.info.stage_sampling["thinker"].replace(temperature=0.0, max_tokens=N, min_tokens=N)}
        ids = [t async for d in omni.generate(prompt, ("text",), params) for t in d.new_token_ids]
        return omni.tokenizer.decode(ids, skip_special_tokens=True)

    async def scenario():
        async with client(server.url).realtime.connect(model=MODEL) as conn:
            await conn.session.update(session={"type": "realtime", "tools": [WEATHER], **GREEDY,
                                               "tool_choice": {"type": "function", "name": "get_weather"},
                                               "audio": {"input": {"turn_detection": None}}})
            await until(conn, "session.updated")
            for chunk in b64_chunks(clip):
                await conn.input_audio_buffer.append(audio=chunk)
            await conn.input_audio_buffer.commit()
            await until(conn, "conversation.item.done")
            await conn.response.create()
            events = await until(conn, "response.done")
            assert not of(events, "error") and not of(events, "response.output_audio.delta")
            done = of(events, "response.done")[0].response
            assert done.usage.output_token_details.text_tokens == N and done.output_modalities == ["text"]
            tool = FunctionTool("get_weather", WEATHER["description"], json.dumps(WEATHER["parameters"]))
            audio = (clip.astype(np.float32) / 32768.0, 24000)
            messages = [{"role": "system", "content": system_text("", [tool])},
                        {"role": "user", "content": [{"type": "audio", "audio": audio}]}]
            prefix = '<tool_call>\n{"name": "get_weather", "arguments": '
            want = await direct(messages, prefix)
            # The tiny random model's N tokens do not close the call: the open call comes back as text (as under
            # "auto"), the prefix and what the engine wrote after it.
            assert not of(events, "response.function_call_arguments.done")
            assert text_of(events) == prefix + want, (text_of(events), want)

    asyncio.run(scenario())
