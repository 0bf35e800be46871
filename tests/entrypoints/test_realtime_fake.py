"""Realtime sessions against a deterministic engine double (``fake_omni``): tool-call detection (the tiny
random model never calls a tool by itself), malformed events, limits, server VAD turns and their metrics.
The official openai SDK's realtime client talks to a real uvicorn server."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time

import httpx
import numpy as np
import pytest
from fake_omni import CHUNK, INFO, FakeOmni
from realtime_audio import b64_chunks, pcm, silence, speech_like
from realtime_client import client, of, send_raw, text_of, until
from server_thread import ServerThread

from omnistage.entrypoints.limits import ServerLimits
from omnistage.entrypoints.realtime import RealtimeLimits
from omnistage.entrypoints.server import create_app
from omnistage.entrypoints.speech_to_text import INSTRUCTION
from omnistage.models.family import PreparedPrompt
from omnistage.models.tool_calls import system_text

MODEL = "fake-omni"
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


class RealtimeFake(FakeOmni):
    """FakeOmni that renders audio parts (as ``<audio:samples@rate>``) and an answer prefix (after the prompt), speaks one audio chunk per token (its
    codec "frame"), and answers from a queue of answers."""

    def __init__(self) -> None:
        super().__init__(delay=0.0)
        self.info = dataclasses.replace(INFO, samples_per_frame=CHUNK, max_model_len=2000)
        self.answers: list[str] = []
        self.transcripts: list[str] = []
        self.transcript_delay = 0.0

    def render_prompt(self, messages, answer_prefix: str = "") -> PreparedPrompt:
        text = ""
        for m in messages:
            content = m["content"]
            if not isinstance(content, str):
                content = "".join(p["text"] if p["type"] == "text" else f"<audio:{len(p['audio'][0])}@{p['audio'][1]}>"
                                  for p in content)
            text += f"<{m['role']}>{content}"
        return PreparedPrompt([ord(c) for c in text + answer_prefix])

    def answer_for(self, prompt: PreparedPrompt) -> tuple[str, float]:
        """Transcriptions (their prompt holds the instruction) from ``transcripts``, answers from ``answers``."""
        if INSTRUCTION in "".join(chr(t) for t in prompt.token_ids):
            return (self.transcripts.pop(0) if self.transcripts else "(inaudible)"), self.transcript_delay
        if self.answers:
            self.answer = self.answers.pop(0)
        return self.answer, self.delay


def prompt_text(fake: RealtimeFake, i: int = -1) -> str:
    return "".join(chr(t) for t in fake.submitted[i]["prompt"].token_ids)


@pytest.fixture(scope="module")
def fake():
    return RealtimeFake()


@pytest.fixture(scope="module")
def server(fake):
    limits = RealtimeLimits(max_sessions=2, max_buffered_audio_s=2, max_event_bytes=1 << 20)
    with ServerThread(create_app(fake, MODEL, limits=ServerLimits(realtime=limits))) as srv:
        yield srv


def run(coro):
    return asyncio.run(coro)


def test_tool_call_is_detected_before_speech_and_the_session_resumes_on_its_output(server, fake):
    async def scenario():
        async with client(server.url).realtime.connect(model=MODEL) as conn:
            await until(conn, "session.created")
            await conn.session.update(session={"type": "realtime", "instructions": "Be brief.", "tools": [WEATHER],
                                               "max_output_tokens": 200})
            await until(conn, "session.updated")
            # The answer opens with a call, then the model ends (token 0 is the fake's EOS) and would go on.
            fake.answers = [CALL + "\x00 never said", "It is sunny."]
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": "Weather?"}]})
            await conn.response.create()
            first = await until(conn, "response.done")
            call = of(first, "response.function_call_arguments.done")[0]
            assert (call.name, call.arguments) == ("get_weather", '{"city": "Paris"}')
            assert of(first, "response.function_call_arguments.delta")[0].delta == '{"city": "Paris"}'
            assert not of(first, "response.output_audio.delta") and not text_of(first)  # nothing spoken
            done = of(first, "response.done")[0].response
            assert done.status == "completed"
            assert [(o.type, o.call_id) for o in done.output] == [("function_call", call.call_id)]
            assert fake.submitted[-1]["request_id"] in fake.aborted  # stopped once the text had ended
            assert prompt_text(fake) == (f"<system>{system_text('Be brief.', _tools())}<user>Weather?")
            # The client runs the tool and sends its output; the next response resumes the conversation.
            await conn.conversation.item.create(item={"type": "function_call_output", "call_id": call.call_id,
                                                      "output": '{"temp": 21}'})
            await until(conn, "conversation.item.done")
            await conn.response.create()
            second = await until(conn, "response.done")
            assert text_of(second) == "It is sunny."
            audio = np.concatenate([pcm(e.delta) for e in of(second, "response.output_audio.delta")])
            assert audio.size == len("It is sunny.") * CHUNK
            assert of(second, "response.done")[0].response.status == "completed"
            assert prompt_text(fake).endswith(
                f"<user>Weather?<assistant>{CALL}<user><tool_response>\n{{\"temp\": 21}}\n</tool_response>")

    run(scenario())


def _tools():
    from omnistage.entrypoints.realtime.config import tools as parse_tools
    from omnistage.entrypoints.realtime.events import FunctionToolParams

    return parse_tools([FunctionToolParams.model_validate(WEATHER)], "tools")


def test_speech_before_a_tool_call_stops_where_the_call_starts(server, fake):
    async def scenario():
        async with client(server.url).realtime.connect(model=MODEL) as conn:
            await conn.session.update(session={"type": "realtime", "tools": [WEATHER], "max_output_tokens": 200})
            await until(conn, "session.updated")
            fake.answers = ["Let me check. " + CALL]
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": "Weather?"}]})
            await conn.response.create()
            events = await until(conn, "response.done")
            assert text_of(events) == "Let me check. "
            audio = np.concatenate([pcm(e.delta) for e in of(events, "response.output_audio.delta")])
            # One frame per token: the audio of the 14 tokens before the call, none of the call's.
            assert audio.size == len("Let me check. ") * CHUNK
            out = of(events, "response.done")[0].response.output
            assert [o.type for o in out] == ["message", "function_call"]
            assert out[0].content[0].transcript == "Let me check. "

    run(scenario())


MALFORMED = [
    ("not json", "invalid_json", None),
    ("[1, 2]", "invalid_event", None),
    ({"type": 5}, "invalid_event", "type"),
    ({"type": "output_audio_buffer.clear"}, "unknown_event", "type"),
    ({"type": "input_audio_buffer.append", "audio": "@@@"}, "invalid_value", "audio"),
    ({"type": "input_audio_buffer.append", "audio": "AA=="}, "invalid_value", "audio"),
    ({"type": "input_audio_buffer.append"}, "invalid_value", "audio"),
    ({"type": "session.update", "session": {"output_modalities": ["video"]}}, "invalid_value",
     "session.output_modalities"),
    ({"type": "session.update", "session": {"output_modalities": ["text", "audio"]}}, "invalid_value",
     "session.output_modalities"),
    ({"type": "session.update", "session": {"audio": {"input": {"turn_detection": {"type": "push_to_talk"}}}}},
     "invalid_value", "session.audio.input.turn_detection.type"),
    ({"type": "session.update", "session": {"audio": {"input": {"turn_detection": {"type": "semantic_vad",
                                                                                     "eagerness": "eager"}}}}},
     "invalid_value", "session.audio.input.turn_detection.eagerness"),
    ({"type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/pcmu"}}}}},
     "unsupported_parameter", "session.audio.input.format.type"),
    ({"type": "session.update", "session": {"audio": {"output": {"voice": "nobody"}}}}, "invalid_voice",
     "session.audio.output.voice"),
    ({"type": "session.update", "session": {"audio": {"input": {"turn_detection": {"type": "server_vad",
                                                                                     "threshold": 2}}}}},
     "invalid_value", "session.audio.input.turn_detection.threshold"),
    ({"type": "session.update", "session": {"max_output_tokens": True}}, "invalid_value", "session.max_output_tokens"),
    ({"type": "session.update", "session": {"instructions": "\ud800"}}, "invalid_value", "session.instructions"),
    ({"type": "session.update", "session": {"tools": [{"type": "mcp", "server_label": "x"}]}},
     "unsupported_parameter", "session.tools.0.type"),
    ({"type": "session.update", "session": {"model": "other"}}, "model_not_found", "session.model"),
    ({"type": "conversation.item.create", "item": {"type": "message", "role": "tool", "content": []}},
     "invalid_value", "item.role"),
    ({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                                                   "content": [{"type": "input_image"}]}},
     "unsupported_content", "item.content.0.type"),
    ({"type": "conversation.item.create", "item": {"type": "function_call_output", "output": "x"}},
     "invalid_value", "item.call_id"),
    ({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [{"type": "input_text"}]},
      "previous_item_id": "nope"}, "invalid_value", "item.content.0.text"),
    ({"type": "conversation.item.truncate", "item_id": "nope", "content_index": 0, "audio_end_ms": 0},
     "item_truncate_invalid_item_id", "item_id"),
    ({"type": "conversation.item.delete", "item_id": "nope"}, "item_delete_invalid_item_id", "item_id"),
    ({"type": "conversation.item.retrieve", "item_id": "nope"}, "item_retrieve_invalid_item_id", "item_id"),
    ({"type": "input_audio_buffer.commit"}, "input_audio_buffer_commit_empty", None),
    ({"type": "response.cancel"}, "response_cancel_not_active", None),
    ({"type": "response.create"}, "conversation_empty", None),
    ({"type": "response.create", "response": {"conversation": "none"}}, "unsupported_parameter",
     "response.conversation"),
    ("x" * (1 << 20 + 1), "event_too_large", None),
]


def test_malformed_events_get_error_events_and_the_session_goes_on(server):
    async def scenario():
        async with client(server.url).realtime.connect(model=MODEL) as conn:
            await until(conn, "session.created")
            for i, (raw, code, param) in enumerate(MALFORMED):
                if isinstance(raw, dict):
                    raw = {**raw, "event_id": f"evt_{i}"}
                await send_raw(conn, raw)
                events = await until(conn, "error", "response.done")
                err = of(events, "error")[0].error
                assert (err.code, err.param) == (code, param), (raw, err)
                assert err.type in ("invalid_request_error",) and err.message
                if isinstance(raw, dict) and code not in ("invalid_json",):
                    assert err.event_id == f"evt_{i}"
            await send_raw(conn, b"\xff\xfe binary garbage")  # a binary frame
            assert (await until(conn, "error"))[-1].error.code == "invalid_json"
            # Still the same healthy session.
            await conn.session.update(session={"type": "realtime", "instructions": "ok"})
            assert (await until(conn, "session.updated"))[-1].session.instructions == "ok"

    run(scenario())


def test_model_mismatch_and_session_limit_are_error_events_then_close(server):
    async def scenario():
        async with client(server.url).realtime.connect(model="other") as conn:
            err = (await until(conn, "error"))[-1].error
            assert err.code == "model_not_found"
        async with client(server.url).realtime.connect(model=MODEL) as a, \
                client(server.url).realtime.connect(model=MODEL) as b:
            await until(a, "session.created")
            await until(b, "session.created")
            async with client(server.url).realtime.connect(model=MODEL) as c:
                err = (await until(c, "error"))[-1].error
                assert (err.code, err.type) == ("session_limit_reached", "rate_limit_error")
        text = httpx.get(server.url + "/metrics").text
        assert re.search(r"omnistage_realtime_sessions_rejected_total [1-9]", text)

    run(scenario())


def test_idle_session_is_closed_after_its_answer_and_frees_its_slot():
    slow = RealtimeFake()
    slow.delay = 0.05  # per token: the answer below streams for ~1.2 s, longer than the idle timeout
    limits = RealtimeLimits(max_sessions=1, idle_timeout_s=0.4)

    async def scenario(url):
        async with client(url).realtime.connect(model=MODEL) as conn:
            await until(conn, "session.created")
            slow.answers = ["A slow answer, token by token."]
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": "Hi"}]})
            await conn.response.create()
            events = await until(conn, "response.done", "error")
            assert text_of(events) == "A slow answer, token by token."  # a running answer is not idleness
            assert of(events, "response.done")[0].response.status == "completed"
            err = (await until(conn, "error"))[-1].error
            assert err.code == "session_idle_timeout"
        async with client(url).realtime.connect(model=MODEL) as conn:  # the one slot is free again
            await until(conn, "session.created")

    with ServerThread(create_app(slow, MODEL, limits=ServerLimits(realtime=limits))) as srv:
        run(scenario(srv.url))
        deadline = time.monotonic() + 10  # the server sees the second client's close a moment later
        while not re.search(r"^omnistage_realtime_sessions 0\.0$", httpx.get(srv.url + "/metrics").text, re.M):
            assert time.monotonic() < deadline, "the closed sessions were not counted out"
            time.sleep(0.05)


def test_input_buffer_limit_is_reported_once_and_the_turn_keeps_what_fits(server, fake):
    async def scenario():
        async with client(server.url).realtime.connect(model=MODEL) as conn:
            await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
            await until(conn, "session.updated")
            for chunk in b64_chunks(speech_like(3.0)):  # 3 s into a 2 s buffer
                await conn.input_audio_buffer.append(audio=chunk)
            await conn.input_audio_buffer.commit()
            events = await until(conn, "input_audio_buffer.committed")
            errors = of(events, "error")
            assert len(errors) == 1 and errors[0].error.code == "input_audio_buffer_full"
            await until(conn, "conversation.item.done")
            fake_answer = "Yes."
            fake.answers = [fake_answer]
            await conn.response.create()
            done = await until(conn, "response.done")
            assert text_of(done) == fake_answer
            assert "<audio:48000@24000>" in prompt_text(fake)  # exactly the 2 s that fit

    run(scenario())


def test_server_vad_turn_is_committed_answered_and_timed(server, fake):
    clip = np.concatenate([silence(0.6), speech_like(1.0), silence(0.9)])

    async def scenario():
        async with client(server.url).realtime.connect(model=MODEL) as conn:
            await until(conn, "session.created")  # server VAD is on by default
            fake.answers = ["Hello there."]
            for chunk in b64_chunks(clip):
                await conn.input_audio_buffer.append(audio=chunk)
            events = await until(conn, "response.done")
            kinds = [e.type for e in events if e.type.startswith(("input_audio", "conversation", "response.created"))]
            assert kinds[:6] == ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                                 "input_audio_buffer.committed", "conversation.item.added", "conversation.item.done",
                                 "response.created"]
            start = of(events, "input_audio_buffer.speech_started")[0]
            stop = of(events, "input_audio_buffer.speech_stopped")[0]
            assert start.item_id == stop.item_id == of(events, "input_audio_buffer.committed")[0].item_id
            n = (stop.audio_end_ms - start.audio_start_ms) * 24
            assert f"<user><audio:{n}@24000>" in prompt_text(fake)  # exactly the committed span
            assert text_of(events) == "Hello there." and of(events, "response.output_audio.delta")

    run(scenario())
    text = httpx.get(server.url + "/metrics").text
    assert re.search(r"omnistage_realtime_speech_end_to_first_audio_seconds_count [1-9]", text)
    assert re.search(r'omnistage_realtime_turns_total\{status="completed"\} [1-9]', text)
    assert re.search(r"omnistage_realtime_sessions 0\.0", text)


def test_truncate_keeps_the_text_of_the_audio_the_client_played(server, fake):
    async def scenario():
        async with client(server.url).realtime.connect(model=MODEL) as conn:
            await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
            await until(conn, "session.updated")
            fake.answers = ["Hello there, friend.", "Ok."]
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": "Hi"}]})
            await conn.response.create()
            item = of(await until(conn, "response.done"), "response.done")[0].response.output[0]
            # The client played 11 frames (one per token here: 11 * 480 samples = 220 ms) before the user spoke.
            await conn.conversation.item.truncate(item_id=item.id, content_index=0, audio_end_ms=220)
            ev = (await until(conn, "conversation.item.truncated", "error"))[-1]
            assert (ev.type, ev.audio_end_ms) == ("conversation.item.truncated", 220)
            await conn.conversation.item.truncate(item_id=item.id, content_index=0, audio_end_ms=5000)
            assert (await until(conn, "error"))[-1].error.param == "audio_end_ms"  # beyond what was sent
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": "And?"}]})
            await conn.response.create()
            await until(conn, "response.done")
            assert prompt_text(fake) == "<user>Hi<assistant>Hello there<user>And?"

    run(scenario())
