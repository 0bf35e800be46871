"""The conversation of one session: its items, as the API shows them and as chat messages for the model.

History the model sees each turn (rendered with the family's chat template through ``render_prompt``):
- user messages with their text and their audio (the model hears earlier user audio again: it has no
  transcript of it, and hearing it is what the model was trained on);
- assistant messages as their text (the transcript of what was spoken; after an interruption only the part
  that was played);
- function calls and their outputs, written in the family's tool-call format (``ModelInfo.tool_calls``; Qwen's:
  calls in the assistant turn, outputs in a user turn).
The history is bounded: beyond ``max_history_items`` items, or ``max_history_audio_s`` seconds of user audio,
the oldest items are dropped; a prompt longer than the context drops the oldest items too (``truncation:
"auto"``), one at a time, until it fits.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omnistage.entrypoints.realtime.config import AUDIO_RATE, FunctionTool
from omnistage.entrypoints.realtime.events import ItemParams, RealtimeError, new_id
from omnistage.entrypoints.realtime.input_buffer import MIN_COMMIT_MS, ms_to_samples
from omnistage.models.tool_calls import ToolCallFormat, ToolCallTurn, ToolResultTurn

DUPLICATE_ITEM_ID = "duplicate_item_id"  # OpenAI's code for this case is not documented; unverified


@dataclass(eq=False)  # items are compared by identity (they hold arrays)
class Item:
    id: str

    def to_api(self, with_audio: bool = False) -> dict[str, Any]:
        """The item as the API shows it; ``with_audio``: user audio included (``conversation.item.retrieved``),
        else null as in every other event."""
        raise NotImplementedError


@dataclass(eq=False)
class UserMessage(Item):
    parts: list[tuple[str, Any]] = field(default_factory=list)  # ("text", str) | ("audio", int16 24 kHz)
    role: str = "user"  # user | system
    transcripts: dict[int, str] = field(default_factory=dict)  # by part index: input audio transcription's

    @property
    def audio_samples(self) -> int:
        return sum(v.shape[0] for k, v in self.parts if k == "audio")

    def to_api(self, with_audio: bool = False) -> dict[str, Any]:
        content = [{"type": "input_text", "text": v} if k == "text" else
                   {"type": "input_audio", "transcript": self.transcripts.get(i),
                    "audio": base64.b64encode(v.astype("<i2").tobytes()).decode("ascii") if with_audio else None}
                   for i, (k, v) in enumerate(self.parts)]
        return {"id": self.id, "object": "realtime.item", "type": "message", "role": self.role,
                "status": "completed", "content": content}

    def message(self) -> dict[str, Any]:
        if all(k == "text" for k, _ in self.parts):
            return {"role": self.role, "content": "".join(v for _, v in self.parts)}
        content = [{"type": "text", "text": v} if k == "text" else
                   {"type": "audio", "audio": (v.astype(np.float32) / 32768.0, AUDIO_RATE)} for k, v in self.parts]
        return {"role": self.role, "content": content}


@dataclass(eq=False)
class AssistantMessage(Item):
    text: str = ""
    audio: bool = False  # the content is output_audio (its transcript) rather than output_text
    status: str = "in_progress"
    token_ids: list[int] = field(default_factory=list)  # the answer's tokens (for truncation to played audio)
    sent_samples: int = 0  # audio sent to the client

    def content(self) -> list[dict[str, Any]]:
        if self.audio:
            return [{"type": "output_audio", "transcript": self.text}]
        return [{"type": "output_text", "text": self.text}]

    def to_api(self, with_audio: bool = False) -> dict[str, Any]:
        return {"id": self.id, "object": "realtime.item", "type": "message", "role": "assistant",
                "status": self.status, "content": self.content() if self.text or self.status != "in_progress" else []}


@dataclass(eq=False)
class FunctionCall(Item):
    call_id: str = ""
    name: str = ""
    arguments: str = "{}"
    status: str = "completed"

    def to_api(self, with_audio: bool = False) -> dict[str, Any]:
        return {"id": self.id, "object": "realtime.item", "type": "function_call", "status": self.status,
                "call_id": self.call_id, "name": self.name, "arguments": self.arguments}


@dataclass(eq=False)
class FunctionCallOutput(Item):
    call_id: str = ""
    output: str = ""

    def to_api(self, with_audio: bool = False) -> dict[str, Any]:
        return {"id": self.id, "object": "realtime.item", "type": "function_call_output", "status": "completed",
                "call_id": self.call_id, "output": self.output}


class Conversation:
    def __init__(self, max_items: int, max_audio_samples: int, tool_calls: ToolCallFormat | None = None) -> None:
        """``tool_calls``: the served family's format (``ModelInfo.tool_calls``); None: no tools."""
        self.items: list[Item] = []
        self.max_items, self.max_audio_samples = max_items, max_audio_samples
        self.tool_calls = tool_calls

    def find(self, item_id: str) -> Item | None:
        return next((it for it in self.items if it.id == item_id), None)

    def get(self, item_id: str, action: str) -> Item:
        """The item ``action`` (retrieve, truncate, delete) is for, or OpenAI's error for a missing one
        (``item_<action>_invalid_item_id``)."""
        item = self.find(item_id)
        if item is None:
            doing = {"retrieve": "retrieving", "truncate": "truncating", "delete": "deleting"}[action]
            raise RealtimeError(f"Error {doing} item: the item with id {item_id!r} does not exist.",
                                param="item_id", code=f"item_{action}_invalid_item_id")
        return item

    def previous_id(self, item: Item) -> str | None:
        """The id of the item before ``item`` (None: it is first)."""
        pos = self.items.index(item)
        return self.items[pos - 1].id if pos > 0 else None

    def add(self, item: Item, previous_item_id: str | None = None) -> str | None:
        """Insert ``item`` (after ``previous_item_id``: an item id or "root"; default: at the end); returns the
        id of the item before it. Then drop the oldest items beyond the history bounds."""
        if self.find(item.id) is not None:
            raise RealtimeError(f"Item with id {item.id!r} already exists in the conversation; choose another id",
                                param="item.id", code=DUPLICATE_ITEM_ID)
        if previous_item_id is None:
            pos = len(self.items)
        elif previous_item_id == "root":
            pos = 0
        else:
            prev = self.find(previous_item_id)
            if prev is None:
                raise RealtimeError(f"no item with id {previous_item_id!r}", param="previous_item_id",
                                    code="item_not_found")
            pos = self.items.index(prev) + 1
        prev = self.items[pos - 1].id if pos > 0 else None
        self.items.insert(pos, item)
        self._bound()
        return prev

    def delete(self, item_id: str) -> None:
        self.items.remove(self.get(item_id, "delete"))

    def _bound(self) -> None:
        def audio() -> int:
            return sum(it.audio_samples for it in self.items if isinstance(it, UserMessage))

        while len(self.items) > self.max_items or (len(self.items) > 1 and audio() > self.max_audio_samples):
            self.items.pop(0)

    def messages(self, instructions: str, tools: Sequence[FunctionTool], skip: int = 0) -> list[dict[str, Any]]:
        """Chat messages for the model from the items after the first ``skip`` (dropped by truncation), in the
        family's tool-call format."""
        history = [_entry(item) for item in self.items[skip:]]
        if self.tool_calls is not None:
            return self.tool_calls.messages(instructions, tools, history)
        if tools or any(isinstance(e, ToolCallTurn | ToolResultTurn) for e in history):
            raise RealtimeError("this model does not call tools: it has no tool-call format", param="tools",
                                code="unsupported_parameter")
        system = [{"role": "system", "content": instructions}] if instructions else []
        return system + history


def _entry(item: Item) -> dict[str, Any] | ToolCallTurn | ToolResultTurn:
    if isinstance(item, UserMessage):
        return item.message()
    if isinstance(item, AssistantMessage):
        return {"role": "assistant", "content": item.text}
    if isinstance(item, FunctionCall):
        return ToolCallTurn(item.name, item.arguments)
    if isinstance(item, FunctionCallOutput):
        return ToolResultTurn(item.output)
    raise TypeError(f"not a conversation item: {item!r}")


def new_item_id() -> str:
    return new_id("item")


def _decode_audio(data: str | None, param: str) -> np.ndarray:
    try:
        raw = base64.b64decode(data or "", validate=True)
    except (binascii.Error, ValueError):
        raise RealtimeError("audio is not valid base64", param=param) from None
    if len(raw) % 2 or len(raw) < 2 * ms_to_samples(MIN_COMMIT_MS):
        raise RealtimeError(f"audio must be pcm16 (24 kHz) of at least {MIN_COMMIT_MS} ms", param=param)
    return np.frombuffer(raw, dtype="<i2").copy()


def item_from_params(p: ItemParams) -> Item:
    """A conversation item from ``conversation.item.create`` (validated; the client's id kept)."""
    item_id = p.id or new_item_id()
    if p.type == "message":
        if p.role not in ("user", "system", "assistant"):
            raise RealtimeError(f"message role must be user, system or assistant, got {p.role!r}", param="item.role")
        if not p.content:
            raise RealtimeError("a message needs content", param="item.content")
        allowed = {"user": ("input_text", "input_audio"), "system": ("input_text",),
                   "assistant": ("output_text", "output_audio", "text")}[p.role]
        parts: list[tuple[str, Any]] = []
        for i, c in enumerate(p.content):
            where = f"item.content.{i}"
            if c.type not in allowed:
                raise RealtimeError(f"content type {c.type!r} is not supported in a {p.role} message; supported: "
                                    f"{list(allowed)}", param=f"{where}.type", code="unsupported_content")
            if c.type == "input_audio":
                parts.append(("audio", _decode_audio(c.audio, f"{where}.audio")))
            elif c.type == "output_audio":
                if c.transcript is None:
                    raise RealtimeError("assistant audio is kept as its transcript: give 'transcript'",
                                        param=f"{where}.transcript")
                parts.append(("text", c.transcript))
            else:
                if c.text is None:
                    raise RealtimeError(f"content of type {c.type!r} needs 'text'", param=f"{where}.text")
                parts.append(("text", c.text))
        if p.role == "assistant":
            audio = any(c.type == "output_audio" for c in p.content)
            return AssistantMessage(item_id, text="".join(v for _, v in parts), audio=audio, status="completed")
        return UserMessage(item_id, parts, role=p.role)
    if p.type == "function_call":
        if not p.name:
            raise RealtimeError("a function_call item needs a name", param="item.name")
        return FunctionCall(item_id, call_id=p.call_id or new_id("call"), name=p.name, arguments=p.arguments or "{}")
    if p.type == "function_call_output":
        if not p.call_id:
            raise RealtimeError("a function_call_output item needs the call_id it answers", param="item.call_id")
        if p.output is None:
            raise RealtimeError("a function_call_output item needs an output", param="item.output")
        return FunctionCallOutput(item_id, call_id=p.call_id, output=p.output)
    raise RealtimeError(f"item type {p.type!r} is not supported; message, function_call or function_call_output",
                        param="item.type", code="unsupported_content")

