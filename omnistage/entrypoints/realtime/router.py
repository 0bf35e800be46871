"""``WS /v1/realtime?model=...``: the OpenAI Realtime API (GA events) over one WebSocket per session.

A connection is accepted first, so that every refusal reaches the client as an ``error`` event: a model other
than the served one (then closed, 1008), the session limit (then closed, 1013: try again later). After that
nothing a client sends closes the socket: malformed or unknown events get an ``error`` event. A message larger
than ``RealtimeLimits.max_event_bytes`` is refused the same way; beyond the WebSocket server's own frame limit
(uvicorn's ``ws_max_size``, 16 MiB) the transport closes the connection. A session that sends nothing for
``RealtimeLimits.idle_timeout_s`` while no response runs gets a ``session_idle_timeout`` error event and is
closed (1000). A client sending ``OpenAI-Beta: realtime=v1`` gets the beta protocol's event names
(``events.for_protocol``); every other one GA's. When the client goes away, its running response is aborted in every stage and the session's
state is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import Executor

from fastapi import APIRouter, WebSocket, WebSocketDisconnect

from omnistage.entrypoints.metrics import ServerMetrics
from omnistage.entrypoints.realtime.config import RealtimeLimits
from omnistage.entrypoints.realtime.context import RealtimeContext, SessionClosed
from omnistage.entrypoints.realtime.events import BETA_HEADER, RealtimeError, wants_beta
from omnistage.entrypoints.realtime.session import RealtimeSession
from omnistage.entrypoints.voices import VoiceMap
from omnistage.pipeline.client import EngineClient

SUBPROTOCOL = "realtime"  # browsers offer it (with the key as a second subprotocol) and need one echoed


def realtime_router(omni: EngineClient, model: str, metrics: ServerMetrics, pool: Executor,
                    limits: RealtimeLimits, voices: VoiceMap, transcript_tokens: int) -> APIRouter:
    ctx = RealtimeContext(omni, model, metrics, pool, limits, voices, transcript_tokens)
    router = APIRouter()

    @router.websocket("/v1/realtime")
    async def realtime(ws: WebSocket) -> None:
        offered = ws.scope.get("subprotocols") or []
        await ws.accept(subprotocol=SUBPROTOCOL if SUBPROTOCOL in offered else None)
        asked = ws.query_params.get("model")
        if asked not in (None, model):
            await _refuse(ws, RealtimeError(f"The model {asked!r} does not exist; this server serves {model!r}",
                                            code="model_not_found", param="model"), 1008)
            return
        if ctx.open_sessions >= ctx.limits.max_sessions:
            metrics.realtime_rejected.inc()
            await _refuse(ws, RealtimeError(f"this server holds at most {ctx.limits.max_sessions} realtime sessions; "
                                            "try again later", code="session_limit_reached",
                                            type="rate_limit_error"), 1013)
            return
        session = RealtimeSession(ctx, ws.send_text, beta=wants_beta(ws.headers.get(BETA_HEADER)))
        ctx.open_sessions += 1
        metrics.realtime_sessions.inc()
        try:
            await session.start()
            while True:
                try:
                    message = await asyncio.wait_for(ws.receive(), ctx.limits.idle_timeout_s)
                except TimeoutError:
                    if session.response is not None and session.response.active:
                        continue  # the client is listening to an answer
                    await _refuse(ws, RealtimeError(f"no event for {ctx.limits.idle_timeout_s:g} s: the session is "
                                                    "closed", code="session_idle_timeout"), 1000)
                    break
                if message["type"] == "websocket.disconnect":
                    break
                data = message.get("text")
                data = data if data is not None else message.get("bytes") or b""
                if len(data) > ctx.limits.max_event_bytes:
                    await session.send(RealtimeError(f"the event has {len(data)} bytes; this server accepts at most "
                                                     f"{ctx.limits.max_event_bytes}", code="event_too_large").event())
                    continue
                await session.handle(data)
        except (WebSocketDisconnect, SessionClosed):
            pass
        finally:
            await session.close()
            ctx.open_sessions -= 1
            metrics.realtime_sessions.dec()

    return router


async def _refuse(ws: WebSocket, err: RealtimeError, code: int) -> None:
    with contextlib.suppress(Exception):
        await ws.send_json(err.event())
        await ws.close(code=code, reason=err.code)
