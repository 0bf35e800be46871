"""The Realtime GA protocol from the client's side (the official openai SDK against the engine double of
``test_realtime_fake``): item events (``conversation.item.added`` / ``.done``, beta ``created``), client ids
and ``previous_item_id`` kept, retrieve, OpenAI's error codes for unknown and duplicate ids; forced
``tool_choice``; instructions-only and "inf" responses; values refused as OpenAI refuses them; a GA voice-agent
client's turn with barge-in, truncate and retrieve replayed without an error event."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from fake_omni import CHUNK
from realtime_audio import b64_chunks, pcm, silence, speech_like
from realtime_client import client, of, send_raw, text_of, until
from server_thread import ServerThread
from test_realtime_fake import MODEL, WEATHER, RealtimeFake, prompt_text

from omnistage.entrypoints.limits import ServerLimits
from omnistage.entrypoints.realtime import RealtimeLimits
from omnistage.entrypoints.realtime.noise import DELAY, NoiseReducer
from omnistage.entrypoints.server import create_app
from omnistage.testing.speech_turns import phrase, snr_db, with_noise

TEXT_ONLY = {"type": "realtime", "output_modalities": ["text"], "audio": {"input": {"turn_detection": None}}}


@pytest.fixture(scope="module")
def fake():
    return RealtimeFake()


@pytest.fixture(scope="module")
def server(fake):
    limits = RealtimeLimits(max_sessions=2)
    with ServerThread(create_app(fake, MODEL, limits=ServerLimits(realtime=limits))) as srv:
        yield srv


def _user(text: str, **item) -> dict:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}], **item}


def _item_events(events) -> list[tuple[str, str, str | None]]:
    return [(e.type, e.item.id, e.previous_item_id) for e in events
            if e.type in ("conversation.item.added", "conversation.item.done", "conversation.item.created")]


def test_items_are_added_then_done_with_client_ids_and_previous_item_ids_kept(server, fake):
    async def scenario():
        async with client(server.url).realtime.connect(model=MODEL) as conn:
            await conn.session.update(session=TEXT_ONLY)
            await until(conn, "session.updated")
            await conn.conversation.item.create(item=_user("second", id="item_b"))
            events = await until(conn, "conversation.item.done")
            assert _item_events(events) == [("conversation.item.added", "item_b", None),
                                            ("conversation.item.done", "item_b", None)]
            assert of(events, "conversation.item.done")[0].item.status == "completed"
            await conn.conversation.item.create(item=_user("first", id="item_a"), previous_item_id="root")
            assert _item_events(await until(conn, "conversation.item.done"))[-1] == (
                "conversation.item.done", "item_a", None)
            await conn.conversation.item.create(item=_user("between", id="item_m"), previous_item_id="item_a")
            assert _item_events(await until(conn, "conversation.item.done"))[-1] == (
                "conversation.item.done", "item_m", "item_a")
            fake.answers = ["Hi."]
            await conn.response.create()
            events = await until(conn, "response.done")
            assert prompt_text(fake) == "<user>first<user>between<user>second"
            kinds = [e.type for e in events if not e.type.endswith(".delta")]
            assert kinds == ["response.created", "response.output_item.added", "conversation.item.added",
                             "response.content_part.added", "response.output_text.done", "response.content_part.done",
                             "response.output_item.done", "conversation.item.done", "response.done"]
            answer = of(events, "response.output_item.added")[0].item.id
            added, done = of(events, "conversation.item.added")[0], of(events, "conversation.item.done")[0]
            assert (added.item.id, added.previous_item_id, added.item.status) == (answer, "item_b", "in_progress")
            assert (done.item.id, done.previous_item_id, done.item.status) == (answer, "item_b", "completed")
            assert done.item.content[0].text == "Hi."
            # The context left after this response, as OpenAI's servers follow response.done with the limits.
            limits = (await until(conn, "rate_limits.updated"))[-1].rate_limits
            used = len(fake.submitted[-1]["prompt"].token_ids) + len("Hi.")
            assert [(r.name, r.limit, r.remaining) for r in limits] == [("tokens", 2000, 2000 - used)]
            # An id already in the conversation is refused; the conversation is unchanged.
            await send_raw(conn, {"type": "conversation.item.create", "item": _user("again", id="item_a"),
                                  "event_id": "evt_dup"})
            err = (await until(conn, "error"))[-1].error
            assert (err.code, err.param, err.event_id) == ("duplicate_item_id", "item.id", "evt_dup")
            await conn.conversation.item.retrieve(item_id="item_a")
            got = (await until(conn, "conversation.item.retrieved"))[-1].item
            assert (got.id, got.content[0].text) == ("item_a", "first")

    asyncio.run(scenario())


def test_retrieve_gives_the_user_audio_and_unknown_ids_get_openai_codes(server):
    clip = speech_like(0.5)

    async def scenario():
        async with client(server.url).realtime.connect(model=MODEL) as conn:
            await conn.session.update(session=TEXT_ONLY)
            await until(conn, "session.updated")
            await conn.input_audio_buffer.append(audio=b64_chunks(clip, ms=1000)[0])
            await conn.input_audio_buffer.commit()
            events = await until(conn, "conversation.item.done")
            committed = of(events, "input_audio_buffer.committed")[0]
            assert [t for t, *_ in _item_events(events)] == ["conversation.item.added", "conversation.item.done"]
            assert of(events, "conversation.item.added")[0].item.content[0].audio is None  # not in every event
            await conn.conversation.item.retrieve(item_id=committed.item_id)
            item = (await until(conn, "conversation.item.retrieved"))[-1].item
            assert item.id == committed.item_id and item.content[0].type == "input_audio"
            np.testing.assert_array_equal(pcm(item.content[0].audio), clip)
            await conn.conversation.item.delete(item_id=committed.item_id)
            assert (await until(conn, "conversation.item.deleted"))[-1].item_id == committed.item_id
            for action, event in (("retrieve", {}), ("delete", {}),
                                  ("truncate", {"content_index": 0, "audio_end_ms": 0})):
                await send_raw(conn, {"type": f"conversation.item.{action}", "item_id": committed.item_id, **event})
                err = (await until(conn, "error"))[-1].error
                assert (err.code, err.param) == (f"item_{action}_invalid_item_id", "item_id")
                assert committed.item_id in err.message

    asyncio.run(scenario())


def test_beta_clients_get_the_beta_event_names(server, fake):
    async def scenario():
        beta = client(server.url).with_options(websocket_base_url=server.url.replace("http", "ws", 1) + "/v1")
        async with beta.beta.realtime.connect(model=MODEL) as conn:  # sends OpenAI-Beta: realtime=v1
            await until(conn, "session.created")
            await send_raw(conn, {"type": "conversation.item.create", "item": _user("Hi", id="item_x")})
            fake.answers = ["Hello."]
            await send_raw(conn, {"type": "response.create"})
            events = await until(conn, "response.done")
            types = [e.type for e in events]
            assert "conversation.item.added" not in types and "conversation.item.done" not in types
            assert [(i, p) for t, i, p in _item_events(events)][0] == ("item_x", None)
            assert {t for t, *_ in _item_events(events)} == {"conversation.item.created"}
            assert len(_item_events(events)) == 2  # the user's item and the answer
            assert "response.audio.delta" in types and "response.audio_transcript.done" in types
            assert not [t for t in types if t.startswith("response.output_audio")]
            assert "".join(e.delta for e in of(events, "response.audio_transcript.delta")) == "Hello."

    asyncio.run(scenario())


def test_tool_choice_required_and_named_force_the_call_prefix(server, fake):
    clock = {"type": "function", "name": "get_time", "description": "Time in a city",
             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}

    async def scenario():
        async with client(server.url).realtime.connect(model=MODEL) as conn:
            await conn.session.update(session={"type": "realtime", "tools": [WEATHER, clock], "tool_choice": "required",
                                               "audio": {"input": {"turn_detection": None}}})
            assert (await until(conn, "session.updated"))[-1].session.tool_choice == "required"
            await conn.conversation.item.create(item=_user("Hi"))
            # The model continues the forced "<tool_call>\n" (the fake ignores its prompt).
            fake.answers = ['{"name": "get_time", "arguments": {"city": "Oslo"}}\n</tool_call>']
            await conn.response.create()
            events = await until(conn, "response.done")
            assert prompt_text(fake).endswith("<user>Hi<tool_call>\n")
            assert fake.submitted[-1]["modalities"] == ("text",)  # a forced call is never spoken
            call = of(events, "response.function_call_arguments.done")[0]
            assert (call.name, call.arguments) == ("get_time", '{"city": "Oslo"}')
            done = of(events, "response.done")[0].response
            assert [o.type for o in done.output] == ["function_call"] and done.output_modalities == ["text"]
            assert not of(events, "response.output_audio.delta") and not of(events, "response.output_text.delta")
            # A named function, per response: the prefix holds its name; the model writes the arguments.
            fake.answers = ['{"city": "Paris"}}\n</tool_call>']
            await conn.response.create(response={"tool_choice": {"type": "function", "name": "get_weather"}})
            events = await until(conn, "response.done")
            assert prompt_text(fake).endswith('<tool_call>\n{"name": "get_weather", "arguments": ')
            call = of(events, "response.function_call_arguments.done")[0]
            assert (call.name, call.arguments) == ("get_weather", '{"city": "Paris"}')
            await conn.session.update(session={"tool_choice": {"type": "function", "name": "get_time"}})
            got = (await until(conn, "session.updated"))[-1].session.tool_choice
            assert (got.type, got.name) == ("function", "get_time")
            # Back to "auto": the model decides, nothing is forced.
            await conn.session.update(session={"tool_choice": "auto"})
            await until(conn, "session.updated")
            fake.answers = ["Hello."]
            await conn.response.create()
            events = await until(conn, "response.done")
            # The history holds both calls, written back in the format; no prefix follows them.
            assert prompt_text(fake).endswith('<assistant><tool_call>\n{"name": "get_time", "arguments": {"city": '
                                              '"Oslo"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", '
                                              '"arguments": {"city": "Paris"}}\n</tool_call>')
            assert text_of(events) == "Hello."
            assert fake.submitted[-1]["modalities"] == ("text", "audio")
            for choice, param in [({"type": "function", "name": "nope"}, "session.tool_choice.name"),
                                  ({"type": "mcp", "server_label": "x"}, "session.tool_choice.type"),
                                  ("sometimes", "session.tool_choice")]:
                await send_raw(conn, {"type": "session.update", "session": {"tool_choice": choice}})
                err = (await until(conn, "error"))[-1].error
                assert (err.code, err.param) == ("invalid_value", param), err
            await send_raw(conn, {"type": "session.update", "session": {"tools": [], "tool_choice": "required"}})
            assert (await until(conn, "error"))[-1].error.param == "session.tool_choice"

    asyncio.run(scenario())


def test_instructions_alone_answer_an_empty_conversation_and_inf_reaches_the_context(server, fake):
    async def scenario():
        async with client(server.url).realtime.connect(model=MODEL) as conn:
            await conn.session.update(session=TEXT_ONLY)
            assert (await until(conn, "session.updated"))[-1].session.max_output_tokens == "inf"
            fake.answers = ["Hello, how can I help?"]
            await conn.response.create(response={"instructions": "Greet the user."})
            events = await until(conn, "response.done")
            assert not of(events, "error") and text_of(events) == "Hello, how can I help?"
            assert prompt_text(fake) == "<system>Greet the user."
            prompt = fake.submitted[-1]["prompt"].token_ids
            # "inf": everything the context leaves (not the deployment's 64-token default).
            assert fake.submitted[-1]["params"]["thinker"].max_tokens == fake.info.max_model_len - len(prompt)
            await conn.response.create(response={"instructions": "Greet the user.", "max_output_tokens": 5})
            events = await until(conn, "response.done")
            assert fake.submitted[-1]["params"]["thinker"].max_tokens == 5 and text_of(events) == "Hello"
            done = of(events, "response.done")[0].response
            assert (done.status, done.status_details.reason, done.max_output_tokens) == (
                "incomplete", "max_output_tokens", 5)
            # The greetings joined the conversation: the next plain response answers after them.
            fake.answers = ["Yes?"]
            await conn.response.create()
            await until(conn, "response.done")
            assert prompt_text(fake) == "<assistant>Hello, how can I help?<assistant>Hello"

    asyncio.run(scenario())


UNSUPPORTED_VALUES = [  # values outside what a field takes: OpenAI's invalid_value refusal
    ({"audio": {"input": {"noise_reduction": {"type": "studio"}}}}, "session.audio.input.noise_reduction.type",
     "Invalid value: 'studio'. Supported values are: 'near_field', 'far_field' and null."),
    ({"audio": {"input": {"turn_detection": {"type": "semantic_vad", "eagerness": "eager"}}}},
     "session.audio.input.turn_detection.eagerness",
     "Invalid value: 'eager'. Supported values are: 'low', 'medium', 'high' and 'auto'."),
]


def test_unsupported_values_are_refused_as_openai_refuses_them_and_the_session_goes_on(server, fake):
    async def scenario():
        async with client(server.url).realtime.connect(model=MODEL) as conn:
            await until(conn, "session.created")
            for i, (session, param, message) in enumerate(UNSUPPORTED_VALUES):
                await send_raw(conn, {"type": "session.update", "event_id": f"evt_{i}",
                                      "session": {"type": "realtime", "instructions": "changed", **session}})
                err = (await until(conn, "error"))[-1].error
                assert (err.type, err.code, err.param, err.event_id) == (
                    "invalid_request_error", "invalid_value", param, f"evt_{i}")
                assert err.message.startswith(message), err.message
            # Nothing of those updates was applied, null is accepted, and the session answers as before.
            await conn.session.update(session={"type": "realtime", "output_modalities": ["text"],
                                               "audio": {"input": {"noise_reduction": None, "transcription": None}}})
            session = (await until(conn, "session.updated"))[-1].session
            assert session.instructions == "" and session.audio.input.noise_reduction is None
            await conn.conversation.item.create(item=_user("Hi"))
            fake.answers = ["Hello."]
            await conn.response.create()
            assert of(await until(conn, "response.done"), "response.done")[0].response.status == "completed"

    asyncio.run(scenario())


TRANSCRIBED = "conversation.item.input_audio_transcription"


async def _until_all(conn, *types: str) -> list:
    """Every event until one of each of ``types`` has come."""
    events: list = []
    while not all(of(events, t) for t in types):
        events += await until(conn, *[t for t in types if not of(events, t)])
    return events


def test_committed_turns_are_transcribed_after_their_answer_started_and_the_transcript_joins_the_item(server, fake):
    turn = np.concatenate([silence(0.3), speech_like(0.8), silence(0.8)])

    async def scenario():
        async with client(server.url).realtime.connect(model=MODEL) as conn:
            await conn.session.update(session={
                "type": "realtime", "output_modalities": ["text"],
                "audio": {"input": {"transcription": {"model": "gpt-4o-transcribe", "language": "en",
                                                      "prompt": "weather"},
                                    "turn_detection": {"type": "server_vad"}}}})
            got = (await until(conn, "session.updated"))[-1].session.audio.input.transcription
            assert (got.model, got.language, got.prompt) == ("gpt-4o-transcribe", "en", "weather")
            # A slow transcription: the answer does not wait for it.
            fake.transcripts, fake.transcript_delay, fake.answers = ["What is the weather"], 0.05, ["Sunny."]
            for chunk in b64_chunks(turn):
                await conn.input_audio_buffer.append(audio=chunk)
            events = await _until_all(conn, "response.done", f"{TRANSCRIBED}.completed")
            types = [e.type for e in events]
            assert "error" not in types
            item = of(events, "input_audio_buffer.committed")[0].item_id
            deltas = of(events, f"{TRANSCRIBED}.delta")
            done = of(events, f"{TRANSCRIBED}.completed")[0]
            assert len(deltas) == len("What is the weather") and all(
                (d.item_id, d.content_index) == (item, 0) for d in deltas + [done])
            assert "".join(d.delta for d in deltas) == done.transcript == "What is the weather"
            assert types.index("response.done") < types.index(f"{TRANSCRIBED}.completed")
            assert types.index("input_audio_buffer.committed") < types.index(f"{TRANSCRIBED}.delta")
            assert done.usage.type == "tokens" and done.usage.output_tokens == len(done.transcript)
            # The answer went to the engine first; the transcription is a text-only request on the turn's audio.
            answer, transcription = fake.submitted[-2], fake.submitted[-1]
            assert prompt_text(fake, -2).startswith("<user><audio:") and answer["modalities"] == ("text",)
            assert transcription["modalities"] == ("text",) and transcription["params"]["thinker"].temperature == 0
            assert prompt_text(fake) == (f"<user><audio:{_committed_samples(fake, -2)}@24000>Transcribe the audio "
                                         "into text. The speech is in English. Context: weather")
            await conn.conversation.item.retrieve(item_id=item)
            part = (await until(conn, "conversation.item.retrieved"))[-1].item.content[0]
            assert (part.type, part.transcript) == ("input_audio", "What is the weather")
            # A manual commit is transcribed at once; the engine's failure is the transcription's own event.
            fake.transcript_delay = 0.0
            await conn.session.update(session={"audio": {"input": {"turn_detection": None}}})
            await until(conn, "session.updated")
            await conn.input_audio_buffer.append(audio=b64_chunks(speech_like(0.3), ms=300)[0])
            fake.fail_with = "error"
            try:
                await conn.input_audio_buffer.commit()
                events = await until(conn, f"{TRANSCRIBED}.failed", f"{TRANSCRIBED}.completed")
            finally:
                fake.fail_with = None
            failed = events[-1]
            assert failed.type == f"{TRANSCRIBED}.failed" and not of(events, "error")
            assert (failed.item_id, failed.content_index, failed.error.code) == (
                of(events, "input_audio_buffer.committed")[0].item_id, 0, "request_failed")
            # Switched off: a commit is not transcribed.
            await conn.session.update(session={"audio": {"input": {"transcription": None}}})
            assert (await until(conn, "session.updated"))[-1].session.audio.input.transcription is None
            n = len(fake.submitted)
            await conn.input_audio_buffer.append(audio=b64_chunks(speech_like(0.3), ms=300)[0])
            await conn.input_audio_buffer.commit()
            await conn.conversation.item.retrieve(item_id="nope")  # a round trip: anything sent came first
            events = await until(conn, "error")
            assert not [e for e in events if e.type.startswith(TRANSCRIBED)] and len(fake.submitted) == n
            for field, value, code in (("model", "gpt-4o-transcribe-diarize", "invalid_value"),
                                       ("model", "nope", "model_not_found"), ("language", "english", "invalid_value")):
                await send_raw(conn, {"type": "session.update", "session": {
                    "audio": {"input": {"transcription": {"model": "whisper-1", field: value}}}}})
                err = (await until(conn, "error"))[-1].error
                assert (err.code, err.param) == (code, f"session.audio.input.transcription.{field}"), err

    asyncio.run(scenario())


def test_a_client_that_leaves_mid_transcription_aborts_it(server, fake):
    async def scenario():
        async with client(server.url).realtime.connect(model=MODEL) as conn:
            await conn.session.update(session={**TEXT_ONLY, "audio": {"input": {
                "turn_detection": None, "transcription": {"model": "whisper-1"}}}})
            await until(conn, "session.updated")
            await conn.input_audio_buffer.append(audio=b64_chunks(speech_like(0.3), ms=300)[0])
            await conn.input_audio_buffer.commit()
            await until(conn, f"{TRANSCRIBED}.delta")  # under way, and slow
        deadline = time.monotonic() + 10
        while fake.active and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    fake.transcripts, fake.transcript_delay = ["a very slow transcript indeed"], 0.5
    try:
        asyncio.run(scenario())
    finally:
        fake.transcript_delay = 0.0
    assert not fake.active and fake.submitted[-1]["request_id"] in fake.aborted
    assert fake.submitted[-1]["modalities"] == ("text",)


def test_noise_reduction_filters_the_stream_the_vad_and_the_model_get(server, fake):
    noisy = with_noise(speech_like(0.8), 10.0, seed=4)

    async def scenario():
        async with client(server.url).realtime.connect(model=MODEL) as conn:
            await conn.session.update(session={**TEXT_ONLY, "audio": {"input": {
                "turn_detection": None, "noise_reduction": {"type": "far_field"}}}})
            got = (await until(conn, "session.updated"))[-1].session.audio.input.noise_reduction
            assert got.type == "far_field"
            chunks = b64_chunks(noisy, ms=70)
            for chunk in chunks:
                await conn.input_audio_buffer.append(audio=chunk)
            await conn.input_audio_buffer.commit()
            item = of(await until(conn, "conversation.item.done"), "input_audio_buffer.committed")[0].item_id
            await conn.conversation.item.retrieve(item_id=item)
            heard = pcm((await until(conn, "conversation.item.retrieved"))[-1].item.content[0].audio)
            offline = NoiseReducer("far_field")
            want = np.concatenate([offline.process(pcm(c)) for c in chunks])
            np.testing.assert_array_equal(heard, want)  # the filtered stream, 10.7 ms behind (what is complete)
            assert snr_db(noisy[:want.size - DELAY], want[DELAY:]) < 30  # it did change the audio
            await conn.session.update(session={"audio": {"input": {"noise_reduction": None}}})
            assert (await until(conn, "session.updated"))[-1].session.audio.input.noise_reduction is None

    asyncio.run(scenario())


def _committed_samples(fake, i: int) -> int:
    """The samples of the audio in the ``i``-th submitted prompt (``<audio:N@24000>``)."""
    text = prompt_text(fake, i)
    return int(text[text.rindex("<audio:") + 7:].split("@")[0])


def _in_order(types: list[str], expected: list[str]) -> bool:
    """``expected`` is a subsequence of ``types``."""
    it = iter(types)
    return all(t in it for t in expected)


def test_a_ga_voice_agent_turn_with_barge_in_truncate_and_retrieve_has_no_error(server, fake):
    """The event sequence a GA voice-agent client sends (its session update with input transcription, semantic
    VAD, noise reduction and a GA voice; audio turns, barge-in, truncate of the interrupted answer, retrieve of the user's turn),
    replayed. The turns trail off at their end, as speakers do (semantic VAD's cue)."""
    turn = np.concatenate([silence(0.4), phrase(1.0, 0, trailing=True), silence(0.9)])

    async def scenario():
        async with client(server.url).realtime.connect(model=MODEL) as conn:
            await until(conn, "session.created")
            fmt = {"type": "audio/pcm", "rate": 24000}
            await conn.session.update(session={
                "type": "realtime", "instructions": "You are a helpful assistant.", "output_modalities": ["audio"],
                "audio": {"input": {"format": fmt, "noise_reduction": {"type": "near_field"},
                                    "transcription": {"model": "gpt-4o-transcribe"},
                                    "turn_detection": {"type": "semantic_vad", "eagerness": "auto",
                                                       "create_response": True, "interrupt_response": True}},
                          "output": {"format": fmt, "voice": "alloy"}},
                "tools": [WEATHER], "tool_choice": "auto"})
            events = await until(conn, "session.updated")
            long = "A long answer that keeps going for a while, word after word."
            fake.answers, fake.transcripts = [long, "Sure."], ["What is the weather", "No, wait"]
            for chunk in b64_chunks(turn):
                await conn.input_audio_buffer.append(audio=chunk)
            events += await until(conn, "response.output_audio.delta")
            user_item = of(events, "input_audio_buffer.committed")[0].item_id
            answer_item = of(events, "response.output_item.added")[0].item.id
            for chunk in b64_chunks(phrase(1.0, 3, trailing=True)):  # the user speaks over the answer
                await conn.input_audio_buffer.append(audio=chunk)
            first = await until(conn, "response.done")
            events += first
            assert of(first, "response.done")[0].response.status == "cancelled"
            # The client truncates the answer to what it played (half of what it got) while the user speaks on.
            played = sum(pcm(e.delta).size for e in of(events, "response.output_audio.delta")) // 48
            await conn.conversation.item.truncate(item_id=answer_item, content_index=0, audio_end_ms=played)
            events += await until(conn, "conversation.item.truncated")
            for chunk in b64_chunks(silence(0.9)):  # the end of the user's turn
                await conn.input_audio_buffer.append(audio=chunk)
            events += await until(conn, "rate_limits.updated")  # the second turn's answer
            while len(of(events, f"{TRANSCRIBED}.completed")) < 2:
                events += await until(conn, f"{TRANSCRIBED}.completed")
            await conn.conversation.item.retrieve(item_id=user_item)
            events += await until(conn, "conversation.item.retrieved")
            types = [e.type for e in events]
            assert "error" not in types, [e.error for e in of(events, "error")]
            shown = [t for t in types if not t.endswith(".delta")]
            assert _in_order(types, [
                "session.updated", "input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                "input_audio_buffer.committed", "conversation.item.added", "conversation.item.done",
                "response.created", "response.output_item.added", "conversation.item.added",
                "response.content_part.added", "response.output_audio.delta",
                "input_audio_buffer.speech_started",  # barge-in
                "response.output_audio.done", "response.output_audio_transcript.done", "response.content_part.done",
                "response.output_item.done", "conversation.item.done", "response.done", "rate_limits.updated",
                "conversation.item.truncated", "input_audio_buffer.speech_stopped", "input_audio_buffer.committed", "conversation.item.added",
                "conversation.item.done", "response.created", "response.done", "rate_limits.updated",
                "conversation.item.retrieved"]), " ".join(shown)
            done_items = {e.item.id: e.item for e in of(events, "conversation.item.done")}
            assert done_items[answer_item].status == "incomplete" and done_items[user_item].status == "completed"
            assert of(events, "conversation.item.retrieved")[0].item.id == user_item
            assert of(events, "conversation.item.retrieved")[0].item.content[0].transcript == "What is the weather"
            turns = [e.item_id for e in of(events, "input_audio_buffer.committed")]
            assert [(e.item_id, e.transcript) for e in of(events, f"{TRANSCRIBED}.completed")] == list(
                zip(turns, ["What is the weather", "No, wait"]))
            assert types.index(f"{TRANSCRIBED}.delta") > types.index("response.output_item.added")
            td = of(events, "session.updated")[0].session.audio.input.turn_detection
            assert (td.type, td.eagerness) == ("semantic_vad", "auto")
            assert of(events, "response.done")[-1].response.audio.output.voice == "alloy"
            last = max(i for i, r in enumerate(fake.submitted) if "audio" in r["modalities"])  # the last answer
            assert fake.submitted[last]["speaker"] == "ethan"  # alloy, by the default map
            # The next turn heard the answer as far as the client played it (one token per audio chunk here).
            assert f"<assistant>{long[:played * 24 // CHUNK]}<user><audio:" in prompt_text(fake, last)

    fake.delay = 0.1  # per token: the first answer streams for seconds, long enough to speak over
    try:
        asyncio.run(scenario())
    finally:
        fake.delay = 0.0
