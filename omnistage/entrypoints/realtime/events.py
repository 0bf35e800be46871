"""The Realtime API's client events as validated models, server events as plain dicts, and the error event.

Two protocols: GA (the default) and beta, which a client asks for with the ``OpenAI-Beta: realtime=v1``
header (as OpenAI's server and the SDK's ``client.beta.realtime``). Server events are written once, with their
GA names; ``for_protocol`` gives a beta client the beta names (``conversation.item.created`` for
``conversation.item.added``, ``response.audio.delta`` for ``response.output_audio.delta``, ...) and drops the
events beta has not got (``conversation.item.done``). Only the event names differ: the session's fields are
GA's under both.

Client events are validated strictly (JSON Schema types, valid Unicode) with unknown fields ignored, as the
HTTP API does. A malformed event never closes the socket: it becomes an ``error`` event naming the bad field
(``param``) and echoing the client's ``event_id``. Field names follow the openai SDK's
``openai.types.realtime`` (GA protocol).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from omnistage.entrypoints.protocol import StageSamplingParams, Text, error_param

MAX_TOKENS_INF = "inf"


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class RealtimeError(Exception):
    """A client mistake (or a refusal) reported as an ``error`` event; the session goes on."""

    def __init__(self, message: str, code: str = "invalid_value", param: str | None = None,
                 type: str = "invalid_request_error", event_id: str | None = None) -> None:
        super().__init__(message)
        self.message, self.code, self.param, self.type, self.event_id = message, code, param, type, event_id

    def event(self) -> dict[str, Any]:
        return server_event("error", error={"type": self.type, "code": self.code, "message": self.message,
                                            "param": self.param, "event_id": self.event_id})


def server_event(type: str, **fields: Any) -> dict[str, Any]:
    return {"type": type, "event_id": new_id("event"), **fields}


BETA_HEADER, BETA_VALUE = "openai-beta", "realtime=v1"
BETA_NAMES = {
    "conversation.item.added": "conversation.item.created",
    "response.output_audio.delta": "response.audio.delta",
    "response.output_audio.done": "response.audio.done",
    "response.output_audio_transcript.delta": "response.audio_transcript.delta",
    "response.output_audio_transcript.done": "response.audio_transcript.done",
    "response.output_text.delta": "response.text.delta",
    "response.output_text.done": "response.text.done",
}
GA_ONLY = frozenset({"conversation.item.done"})


def wants_beta(header: str | None) -> bool:
    """Whether an ``OpenAI-Beta`` header value asks for the beta realtime protocol."""
    return BETA_VALUE in [v.strip() for v in (header or "").split(",")]


def for_protocol(event: dict[str, Any], beta: bool) -> dict[str, Any] | None:
    """A server event (GA names) as the client's protocol has it; None: that protocol has no such event."""
    if not beta:
        return event
    if event["type"] in GA_ONLY:
        return None
    return {**event, "type": BETA_NAMES.get(event["type"], event["type"])}


# ---- client event models ------------------------------------------------------------------------------
class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class AudioFormat(_Model):
    type: Text = "audio/pcm"
    rate: int | None = None


class TurnDetectionParams(_Model):
    type: Text
    threshold: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)
    prefix_padding_ms: int | None = Field(None, ge=0, le=10_000)
    silence_duration_ms: int | None = Field(None, ge=20, le=10_000)
    create_response: bool | None = None
    interrupt_response: bool | None = None
    idle_timeout_ms: int | None = None
    eagerness: Text | None = None


class TranscriptionParams(_Model):
    model: Text | None = None
    language: Text | None = None
    prompt: Text | None = None


class AudioInputParams(_Model):
    format: AudioFormat | None = None
    turn_detection: TurnDetectionParams | None = None  # null switches it off (``model_fields_set`` tells)
    transcription: TranscriptionParams | None = None  # null switches it off
    noise_reduction: Any = None


class AudioOutputParams(_Model):
    format: AudioFormat | None = None
    voice: Text | None = None
    speed: float | None = Field(None, allow_inf_nan=False)


class AudioParams(_Model):
    input: AudioInputParams | None = None
    output: AudioOutputParams | None = None


class FunctionToolParams(_Model):
    type: Text = "function"
    name: Text | None = None
    description: Text | None = None
    parameters: dict[str, Any] | None = None


class SamplingParamsExt(StageSamplingParams):
    """Extension ``sampling`` on the session and on ``response.create``: Thinker sampling (as the HTTP
    API's top-level fields) plus ``talker`` overrides (as the HTTP API's ``talker`` object)."""

    ignore_eos: bool | None = None
    talker: StageSamplingParams | None = None


MaxTokens = int | Literal["inf"]


class SessionParams(_Model):
    type: Text | None = None
    model: Text | None = None
    instructions: Text | None = None
    output_modalities: list[Text] | None = None
    audio: AudioParams | None = None
    tools: list[FunctionToolParams] | None = None
    tool_choice: Text | dict[str, Any] | None = None
    max_output_tokens: MaxTokens | None = None
    truncation: Text | dict[str, Any] | None = None
    sampling: SamplingParamsExt | None = None
    # Fields of the API this server does not implement; rejected when set to something that would matter.
    prompt: Any = None
    tracing: Any = None
    include: Any = None
    reasoning: Any = None


class ContentParams(_Model):
    type: Text
    text: Text | None = None
    audio: str | None = None  # base64 pcm16 24 kHz
    transcript: Text | None = None


class ItemParams(_Model):
    type: Text
    id: Text | None = Field(None, max_length=64)
    role: Text | None = None
    content: list[ContentParams] | None = None
    call_id: Text | None = None
    name: Text | None = None
    arguments: Text | None = None
    output: Text | None = None


class ResponseOutputAudio(_Model):
    voice: Text | None = None
    format: AudioFormat | None = None


class ResponseAudioParams(_Model):
    output: ResponseOutputAudio | None = None


class ResponseParams(_Model):
    instructions: Text | None = None
    output_modalities: list[Text] | None = None
    max_output_tokens: MaxTokens | None = None
    audio: ResponseAudioParams | None = None
    tools: list[FunctionToolParams] | None = None
    tool_choice: Text | dict[str, Any] | None = None
    metadata: dict[str, Text] | None = None
    conversation: Text | None = None
    input: list[Any] | None = None
    sampling: SamplingParamsExt | None = None


class SessionUpdate(_Model):
    session: SessionParams


class AudioAppend(_Model):
    audio: str


class ItemCreate(_Model):
    item: ItemParams
    previous_item_id: Text | None = None


class ItemTruncate(_Model):
    item_id: Text
    content_index: int = Field(ge=0)
    audio_end_ms: int = Field(ge=0)


class ItemRef(_Model):
    """``conversation.item.delete`` and ``conversation.item.retrieve``."""

    item_id: Text


class ResponseCreate(_Model):
    response: ResponseParams | None = None


class ResponseCancel(_Model):
    response_id: Text | None = None


class Empty(_Model):
    pass


CLIENT_EVENTS: dict[str, type[_Model]] = {
    "session.update": SessionUpdate,
    "input_audio_buffer.append": AudioAppend,
    "input_audio_buffer.commit": Empty,
    "input_audio_buffer.clear": Empty,
    "conversation.item.create": ItemCreate,
    "conversation.item.truncate": ItemTruncate,
    "conversation.item.delete": ItemRef,
    "conversation.item.retrieve": ItemRef,
    "response.create": ResponseCreate,
    "response.cancel": ResponseCancel,
}


def parse_client_event(raw: str | bytes) -> tuple[str, _Model, str | None]:
    """One WebSocket message -> (type, validated event, client event_id); raises RealtimeError."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise RealtimeError("the event is nested too deeply", code="invalid_json") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise RealtimeError(f"the event is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise RealtimeError("an event must be a JSON object", code="invalid_event")
    event_id = data.get("event_id")
    event_id = event_id if isinstance(event_id, str) and len(event_id) <= 256 else None
    kind = data.get("type")
    if not isinstance(kind, str):
        raise RealtimeError("the event has no 'type' string", code="invalid_event", param="type",
                            event_id=event_id)
    model = CLIENT_EVENTS.get(kind)
    if model is None:
        raise RealtimeError(f"unknown or unsupported event type {kind[:64]!r}; supported: "
                            f"{sorted(CLIENT_EVENTS)}", code="unknown_event", param="type", event_id=event_id)
    try:
        return kind, model.model_validate(data), event_id
    except ValidationError as exc:
        errors = exc.errors()
        first = errors[0] if errors else {}
        msgs = [f"{_param(e.get('loc', ())) or 'event'}: "
                f"{str(e.get('msg', 'invalid value')).removeprefix('Value error, ')}" for e in errors[:5]]
        raise RealtimeError(f"invalid {kind} event: " + "; ".join(msgs), param=_param(first.get("loc", ())),
                            event_id=event_id) from None


_UNION_MEMBERS = frozenset({"int", "float", "str", "bool", "dict", "list"})


def _param(loc: Any) -> str | None:
    """A pydantic error location as the API's ``param``, without union member names."""
    return error_param(tuple(p for p in loc if p not in _UNION_MEMBERS))
