"""A client that hangs up while its request body is still being read is a client abort: counted in the abort
metric, answered 499 (to nobody), nothing logged as an error. Drives the ASGI app directly, so the hang-up
comes exactly mid-body."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from fake_omni import FakeOmni

from omnistage.entrypoints.metrics import ServerMetrics
from omnistage.entrypoints.server import create_app

MODEL = "fake-omni"


def _abort_count(metrics: ServerMetrics) -> float:
    return metrics.registry.get_sample_value("omnistage_requests_total", {"finish_reason": "abort"}) or 0.0


async def _hang_up_mid_body(app, path: str, body: bytes, sent_bytes: int) -> list[dict]:
    """POST ``body`` (its full Content-Length declared), send only ``sent_bytes`` of it, then disconnect."""
    incoming = [{"type": "http.request", "body": body[:sent_bytes], "more_body": True}]
    replies: list[dict] = []

    async def receive() -> dict:
        if incoming:
            return incoming.pop(0)
        return {"type": "http.disconnect"}  # and so on, for whoever asks again

    async def send(message: dict) -> None:
        replies.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": [(b"host", b"test"), (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000),
    }
    await app(scope, receive, send)
    return replies


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi " * 2000}]}),
    ("/v1/audio/speech", {"model": MODEL, "input": "hello " * 500, "voice": "ethan"}),
])
def test_disconnect_while_the_body_is_read_is_a_client_abort(caplog, path, body):
    fake = FakeOmni()
    metrics = ServerMetrics()
    app = create_app(fake, MODEL, metrics)
    raw = json.dumps(body).encode()
    before = _abort_count(metrics)
    with caplog.at_level(logging.DEBUG):
        replies = asyncio.run(_hang_up_mid_body(app, path, raw, len(raw) // 3))
    assert _abort_count(metrics) == before + 1
    starts = [m for m in replies if m["type"] == "http.response.start"]
    assert [m["status"] for m in starts] == [499]
    assert not fake.submitted  # nothing reached the engine
    loud = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not loud, [(r.name, r.getMessage()) for r in loud]
