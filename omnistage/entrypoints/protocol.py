"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Unknown request fields are ignored (clients such as the official SDK send optional fields this server
does not use); fields whose value would change the result but are unsupported are rejected by the
server with a 400 instead of being silently ignored (``n > 1``, ``speed != 1``).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    # "developer" is OpenAI's newer name for the system role.
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class AudioParams(_Request):
    voice: str | None = None
    format: str = "wav"


class StreamOptions(_Request):
    include_usage: bool = False


class StageSamplingParams(_Request):
    """Per-stage sampling overrides (extension field ``talker`` on chat and speech requests)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    max_tokens: int | None = None


class ChatCompletionRequest(_Request):
    model: str
    messages: list[ChatMessage]
    modalities: list[str] | None = None
    audio: AudioParams | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension
    repetition_penalty: float | None = None  # extension
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    talker: StageSamplingParams | None = None  # extension: talker sampling (see server docs)


class SpeechRequest(_Request):
    model: str
    input: str
    voice: str | None = None
    response_format: str = "wav"
    speed: float = 1.0
    stream_format: Literal["audio", "sse"] = "audio"
    max_tokens: int | None = None  # extension: length of the spoken answer (thinker tokens)
    temperature: float | None = None  # extension: thinker temperature (default: stage default)
    seed: int | None = None  # extension
    talker: StageSamplingParams | None = None  # extension


# ---- responses -------------------------------------------------------------------------------------
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    completion_tokens_details: dict[str, int] | None = None


class AudioOutput(BaseModel):
    id: str
    data: str  # base64
    expires_at: int
    transcript: str


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    audio: AudioOutput | None = None


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None
    logprobs: None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[Choice]
    usage: Usage


class ChunkDelta(BaseModel):
    role: str | None = None
    content: str | None = None
    audio: dict[str, Any] | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: ChunkDelta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "omnistage"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
