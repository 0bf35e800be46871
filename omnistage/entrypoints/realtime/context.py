"""What the realtime rooms share without importing each other: the server-wide RealtimeContext, the part of a
session a response uses (SessionHandle, which ``RealtimeSession`` implements), and SessionClosed."""

from __future__ import annotations

from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from omnistage.entrypoints.metrics import ServerMetrics
from omnistage.entrypoints.realtime.config import RealtimeLimits, SessionConfig
from omnistage.entrypoints.voices import VoiceMap
from omnistage.models.family import PreparedPrompt
from omnistage.pipeline.client import EngineClient

if TYPE_CHECKING:
    from omnistage.entrypoints.realtime.conversation import Item


@dataclass
class RealtimeContext:
    """What every session of one server shares."""

    omni: EngineClient
    model: str
    metrics: ServerMetrics
    pool: Executor  # rendering prompts (tokenizer, audio features) runs here, off the event loop
    limits: RealtimeLimits
    voices: VoiceMap  # the names sessions may ask for (the model's and the mapped ones)
    transcript_tokens: int  # one input transcription's limit (ServerLimits.max_transcript_tokens)
    open_sessions: int = 0


class SessionClosed(Exception):
    """The client is gone; nothing more can be sent."""


class SessionHandle(Protocol):
    """What a response needs of its session (so ``response`` does not import ``session``)."""

    ctx: RealtimeContext
    conversation_id: str

    async def send(self, event: dict[str, Any]) -> None: ...

    async def add_item(self, item: Item, previous_item_id: str | None = None, announce: bool = True) -> str | None:
        ...

    async def item_done(self, item: Item) -> None: ...

    async def render_for(self, config: SessionConfig, answer_prefix: str = "") -> PreparedPrompt: ...

    def audio_prompt_tokens(self, prompt: PreparedPrompt | None) -> int: ...
