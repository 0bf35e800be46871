"""Request bodies: read within the body limit (an oversized one drained so the client reads its 413), parsed
as JSON and validated into the API's pydantic models, translated in the preprocessing pool, and the heap
trimmed after a big one."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ValidationError

from omnistage.entrypoints.errors import APIError, schema_error

DRAIN_BYTES = 64 << 20  # how much of an oversized body is read and dropped to deliver the 413
TRIM_AFTER_BYTES = 1 << 16  # after a body this big (parsed and tokenized in the pool threads), trim the heap


def too_large(limit: int, close: bool) -> APIError:
    return APIError(413, f"request body is larger than this server's limit of {limit} bytes",
                    code="request_too_large", headers={"Connection": "close"} if close else None)


async def drain(chunks: AsyncIterator[bytes], budget: int) -> bool:
    """Read and drop the rest of a body, up to ``budget`` bytes; True if it ended within the budget."""
    async for chunk in chunks:
        budget -= len(chunk)
        if budget < 0:
            return False
    return True


async def read_body(raw: Request, limit: int) -> bytearray:
    """The request body, refused with 413 once it passes ``limit`` bytes. Like nginx's lingering close, an
    oversized body is read and dropped up to ``DRAIN_BYTES`` more, so the client (which usually sends
    everything before reading) gets the 413 on a connection that stays usable; a bigger one is answered at
    once and the connection closed (the client may then see a reset instead of the 413)."""
    chunks = raw.stream()
    declared = raw.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise APIError(400, "invalid Content-Length header", headers={"Connection": "close"}) from None
        if size > limit:
            drained = size <= limit + DRAIN_BYTES and await drain(chunks, size)
            raise too_large(limit, close=not drained)
    buf = bytearray()
    async for chunk in chunks:
        buf += chunk
        if len(buf) > limit:
            seen = len(buf)
            del buf
            raise too_large(limit, close=not await drain(chunks, limit + DRAIN_BYTES - seen))
    return buf


def parse_json(body: bytes | bytearray) -> Any:
    try:
        return json.loads(body)
    except RecursionError:
        raise APIError(400, "the JSON body is nested too deeply", code="invalid_json") from None
    except UnicodeDecodeError:
        raise APIError(400, "the request body is not valid UTF-8", code="invalid_json") from None
    except ValueError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None


def validate(model: type[BaseModel], body: bytes | bytearray) -> Any:
    data = parse_json(body)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise schema_error(exc.errors()) from None


def release_freed_memory() -> None:
    """glibc keeps freed heap pages of big, short-lived requests mapped (up to its trim threshold in every
    thread's arena); malloc_trim hands them back so a rejected maximal body does not stay in the RSS."""
    if _malloc_trim is not None:
        _malloc_trim(0)


def _load_malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc
        return None


_malloc_trim = _load_malloc_trim()


def run_translator(fn: Callable[[bytearray], Any], box: list[bytearray]) -> tuple[Any, APIError | None]:
    """Run a translator entry point on the body in ``box`` (in the pool). A rejection is returned, not
    raised, stripped of its traceback and context: those hold the frames and the parsed body, and a big
    rejected body must be gone before its memory is trimmed."""
    body = box.pop()
    big = len(body) > TRIM_AFTER_BYTES
    try:
        return fn(body), None
    except APIError as err:
        err.__traceback__ = err.__context__ = err.__cause__ = None
        return None, err
    finally:
        del body
        if big:
            release_freed_memory()
