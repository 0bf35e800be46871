"""What a client of the engine sees: per-request deltas, model facts, and the engine-client interface the
server depends on (implemented in-process by ``AsyncOmni``; a multi-process engine implements the same)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from omnistage.core.sampling_params import SamplingParams
from omnistage.models.tool_calls import ToolCallFormat


@dataclass
class RequestDelta:
    """What one request gained in one engine step (streamed to the client)."""

    req_id: str
    new_token_ids: list[int] = field(default_factory=list)
    audio: torch.Tensor | None = None  # float32 mono samples of one chunk
    codes: torch.Tensor | None = None  # [Q, k] new codec frames
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | error
    error: str | None = None  # why the request failed (finish_reason "error")
    # With a request's first answer tokens: its prompt tokens served from the text stage's prefix cache.
    cached_tokens: int | None = None


@dataclass(frozen=True)
class ModelInfo:
    """Facts about the served model a client needs to validate and translate requests."""

    name: str
    family: str
    max_model_len: int  # of the stage that reads the prompt
    output_modalities: tuple[str, ...]  # e.g. ("text", "audio")
    text_stage: str  # the stage a bare SamplingParams (and the API's top-level sampling fields) applies to
    stage_sampling: Mapping[str, SamplingParams]  # default sampling by AR stage name
    voices: tuple[str, ...] = ()
    default_voice: str | None = None
    sample_rate: int | None = None
    num_code_groups: int | None = None
    vocab_size: int | None = None  # width of the text stage's logits (token ids a request may name)
    input_modalities: tuple[str, ...] = ("text",)  # what prompts may hold: + "audio", "image", "video"
    samples_per_frame: int | None = None  # audio samples per codec frame (the Talker reads one text token per frame)
    tool_calls: ToolCallFormat | None = None  # the family's tool-call format; None: the model calls no tools


class EngineClient(Protocol):
    info: ModelInfo
    tokenizer: Any

    @property
    def dead(self) -> BaseException | None:
        """The error that stopped the engine, or None while it serves."""

    def render_prompt(self, prompt: Any, **options: Any) -> Any:
        """str | chat messages -> a prepared prompt (token ids + per-request data); thread-safe. ``options`` go
        to the model's media processing (e.g. ``use_audio_in_video=True``)."""

    def generate(
        self,
        prompt: Any,
        modalities: Sequence[str] = ("text",),
        sampling_params: SamplingParams | Mapping[str, SamplingParams] | None = None,
        speaker: str | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestDelta]: ...

    async def abort(self, request_id: str) -> bool: ...

    async def resource_stats(self) -> dict[str, Any]: ...

    def add_step_listener(self, fn: Callable[[Any], None]) -> None:
        """Call ``fn(StepEvents)`` after every stage step (on the engine's thread)."""

    def shutdown(self) -> None: ...
