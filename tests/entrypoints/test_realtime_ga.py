"""The Realtime GA protocol from the client's side (the official openai SDK against the engine double of
``test_realtime_fake``): item events (``conversation.item.added`` / ``.done``, beta ``created``), client ids
and ``previous_item_id`` kept, retrieve, OpenAI's error codes for unknown and duplicate ids."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from realtime_audio import b64_chunks, pcm, speech_like
from realtime_client import client, of, send_raw, until
from server_thread import ServerThread
from test_realtime_fake import MODEL, RealtimeFake, prompt_text

from omnistage.entrypoints.limits import ServerLimits
from omnistage.entrypoints.realtime import RealtimeLimits
from omnistage.entrypoints.server import create_app

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
