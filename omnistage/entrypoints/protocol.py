"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Unknown request fields are ignored (clients such as the official SDK send optional fields this server
does not use). Fields that would change the result are declared here so the server can either honour them
or reject them with a 400 naming the field (see the server module docstring for the whole contract).
Types are strict (JSON Schema's: ``true`` is not a number, ``"0.5"`` is not a number, ``1e9`` is not an
integer). Every string a request carries must be valid Unicode: a lone surrogate (``"\\ud800"`` in JSON) is a 400
naming the field, never a failure inside the tokenizer.
"""

from __future__ import annotations

import re
import time
from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag

from omnistage.core.sampling_params import LOGIT_BIAS_RANGE, PENALTY_RANGE, SEED_MAX, SEED_MIN

_SURROGATE = re.compile("[\ud800-\udfff]")


def _valid_unicode(text: str) -> str:
    m = _SURROGATE.search(text)
    if m is not None:
        raise ValueError(f"text is not valid Unicode: lone surrogate U+{ord(m.group()):04X} at index {m.start()}")
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]


def _str_or_list(value: Any) -> str | None:
    return "<str>" if isinstance(value, str) else "<list>" if isinstance(value, list) else None


def _str_or_list_of(item: Any, what: str) -> Any:
    """``str | list[item]`` with one error per bad value (plain unions report one error per member)."""
    return Annotated[
        Union[Annotated[Text, Tag("<str>")], Annotated[list[item], Tag("<list>")]],  # noqa: UP007
        Discriminator(_str_or_list, custom_error_type="invalid_type", custom_error_message=f"must be {what}"),
    ]


def _number(**bounds: float) -> Any:
    return Field(None, allow_inf_nan=False, **bounds)


class _Request(BaseModel):
    # Strict types, as JSON Schema (and so OpenAI) has them: true is not 1, "0.5" is not a number, 1e9 is not
    # an integer. JSON object keys are strings, so ``logit_bias`` keys are parsed leniently.
    model_config = ConfigDict(extra="ignore", strict=True)


class InputAudio(_Request):
    data: Text  # base64
    format: Text


class MediaURL(_Request):
    url: Text  # a data: URL, or a local file under the server's allowed media directory
    detail: Literal["auto", "low", "high"] | None = None  # image_url only; accepted, the model's processor decides


class ContentPart(_Request):
    """One part of a message's content: ``text``, or media (``input_audio``, ``image_url``, ``audio_url``,
    ``video_url``) in user messages; the field named like the type holds it. The server names the others."""

    type: Text
    text: Text | None = None
    input_audio: InputAudio | None = None
    image_url: MediaURL | None = None
    audio_url: MediaURL | None = None
    video_url: MediaURL | None = None


class ChatMessage(_Request):
    # "developer" is OpenAI's newer name for the system role.
    role: Literal["system", "developer", "user", "assistant"]
    content: _str_or_list_of(ContentPart, "a string or a list of content parts") | None = None
    tool_calls: list[Any] | None = None  # rejected when non-empty (no tools)
    function_call: Any = None  # rejected (no tools)


class AudioParams(_Request):
    voice: Text | None = None
    format: Text = "wav"


class StreamOptions(_Request):
    include_usage: bool = False


class ResponseFormat(_Request):
    type: Text


class MMProcessorKwargs(_Request):
    """Options of the model's media processing (vLLM's ``mm_processor_kwargs``); unknown keys are refused."""

    model_config = ConfigDict(extra="forbid", strict=True)
    use_audio_in_video: bool = False  # videos bring their audio track, interleaved with the frames by time
    fps: float | None = Field(None, gt=0, le=1000, allow_inf_nan=False)  # frames sampled per second of video


class StageSamplingParams(_Request):
    """Per-stage sampling overrides (extension field ``talker`` on chat and speech requests)."""

    temperature: float | None = _number(ge=0, le=2)
    top_p: float | None = _number(gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1)
    repetition_penalty: float | None = _number(gt=0, le=2)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    max_tokens: int | None = Field(None, ge=1)
    min_tokens: int | None = Field(None, ge=0)


_Bias = Annotated[float, Field(ge=LOGIT_BIAS_RANGE[0], le=LOGIT_BIAS_RANGE[1], allow_inf_nan=False)]


class ChatCompletionRequest(_Request):
    model: Text
    messages: list[ChatMessage]
    modalities: list[Text] | None = None
    audio: AudioParams | None = None
    temperature: float | None = _number(ge=0, le=2)
    top_p: float | None = _number(gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1)  # extension
    repetition_penalty: float | None = _number(gt=0, le=2)  # extension
    frequency_penalty: float | None = _number(ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    presence_penalty: float | None = _number(ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    logit_bias: dict[Annotated[int, Field(ge=0, strict=False)], _Bias] | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    min_tokens: int | None = Field(None, ge=0)  # extension
    ignore_eos: bool = False  # extension
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: _str_or_list_of(Text, "a string or a list of strings") | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    # Declared only to be rejected when set: they would change the answer and are not implemented.
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: ResponseFormat | None = None
    web_search_options: Any = None
    talker: StageSamplingParams | None = None  # extension: talker sampling (see server docs)
    mm_processor_kwargs: MMProcessorKwargs | None = None  # extension (as vLLM)


class SpeechRequest(_Request):
    model: Text
    input: Text
    voice: Text | None = None
    response_format: Text = "wav"
    speed: float = Field(1.0, allow_inf_nan=False)
    stream_format: Literal["audio", "sse"] = "audio"
    instructions: Text | None = None  # rejected when non-empty (the model cannot be steered that way)
    max_tokens: int | None = Field(None, ge=1)  # extension: length of the spoken answer (thinker tokens)
    temperature: float | None = _number(ge=0, le=2)  # extension: thinker temperature (default: stage default)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)  # extension
    talker: StageSamplingParams | None = None  # extension


def error_param(loc: tuple[Any, ...]) -> str | None:
    """A pydantic error location as the API's ``param`` ("messages.0.content"), without union tags."""
    parts = [str(p) for p in loc if not (isinstance(p, str) and (p.startswith("<") or "[" in p))]
    return ".".join(parts) or None


# ---- responses -------------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None  # {"cached_tokens": n}: served from the prefix cache
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


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "omnistage"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
