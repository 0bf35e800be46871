"""Errors that belong to one request: the stage that raises them fails that request and keeps serving the
others."""

from __future__ import annotations


class RequestError(RuntimeError):
    """Serving ``req_id`` failed (bad input discovered late, a per-request invariant broken, an injected
    fault). Raised before the step's results are committed, so the other requests of the step are simply
    scheduled again."""

    def __init__(self, req_id: str, message: str) -> None:
        super().__init__(f"request {req_id!r}: {message}")
        self.req_id = req_id
        self.reason = message
