"""Driving a realtime session with the official openai SDK in tests."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai

TIMEOUT_S = 60


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)


async def until(conn: Any, *types: str, timeout: float = TIMEOUT_S) -> list[Any]:
    """Every event up to and including the first one of ``types``."""
    out: list[Any] = []

    async def read() -> list[Any]:
        while True:
            ev = await conn.recv()
            out.append(ev)
            if ev.type in types:
                return out

    return await asyncio.wait_for(read(), timeout)


async def send_raw(conn: Any, data: str | bytes | dict) -> None:
    """Anything at all, bypassing the SDK's typing (malformed events)."""
    if isinstance(data, dict):
        data = json.dumps(data)
    await conn._connection.send(data)


def of(events: list[Any], type: str) -> list[Any]:
    return [e for e in events if e.type == type]


def text_of(events: list[Any]) -> str:
    return "".join(e.delta for e in events if e.type in ("response.output_text.delta",
                                                           "response.output_audio_transcript.delta"))
