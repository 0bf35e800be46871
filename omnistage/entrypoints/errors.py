"""The API's error type and bodies: ``APIError`` (status, OpenAI's ``{"error": {message, type, param, code}}``
body, headers) and the errors the server maps to it (a submit refused by the engine client, a pydantic
validation failure, a field that is not supported)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi.responses import JSONResponse

from omnistage.entrypoints.protocol import error_param
from omnistage.pipeline.omni import EngineDeadError, QueueFullError

RETRY_AFTER_S = 1


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def submit_error(exc: BaseException) -> APIError:
    """Map what ``AsyncOmni.generate`` raises to an HTTP error."""
    if isinstance(exc, QueueFullError):
        return APIError(429, f"server is busy: {exc}", "rate_limit_error", code="queue_full",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), "server_error", code="engine_dead", headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, ValueError):
        return APIError(400, str(exc))
    return APIError(500, f"internal error: {exc!r}", "server_error")


def unsupported(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="unsupported_parameter")


def schema_error(errors: list[Any]) -> APIError:
    """pydantic errors -> one 400 naming the first bad field."""
    first = errors[0] if errors else {}
    msgs = []
    for e in errors[:5]:
        msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
        msgs.append(f"{error_param(tuple(e.get('loc', ()))) or 'body'}: {msg}")
    code = "invalid_json" if first.get("type") == "json_invalid" else "invalid_request"
    return APIError(400, "; ".join(msgs) or "invalid request", param=error_param(tuple(first.get("loc", ()))),
                    code=code)
