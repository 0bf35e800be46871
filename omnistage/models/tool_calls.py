"""Tool-call formats, a family's hook (``ModelFamily.tool_calls``): how tool definitions, calls and results are
written into chat messages, and how a call is recognised in the model's streamed text. The entrypoints reach a
format through the engine client's ``ModelInfo.tool_calls`` and never write one themselves.

Qwen's format (``QWEN_TOOL_CALLS``; Qwen2.5 / Qwen3 / Qwen3-Omni chat templates, both built-in families) is the one
these templates write when given ``tools``: the definitions go into the system message after the instructions
(``# Tools`` ... ``<tools>`` one JSON object per line ``</tools>`` ...); the model answers a call as
``<tool_call>\\n{"name": <name>, "arguments": <json object>}\\n</tool_call>`` (possibly several, possibly after
some text; a forced call, ``tool_choice`` "required" or a named function, is the answer made to begin with
``call_prefix``); an earlier call is written back into an assistant turn the same way and its result into a user
turn as ``<tool_response>\\n<output>\\n</tool_response>``. The engine renders chat messages only, so the format
writes that text into the messages itself, exactly as the template would.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"

_TOOLS_HEADER = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
                 "with function signatures within <tools></tools> XML tags:\n<tools>")
_TOOLS_FOOTER = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                 "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
                 "\"arguments\": <args-json-object>}\n</tool_call>")


class ToolSpec(Protocol):
    """A function tool as an API defines it."""

    name: str
    description: str
    parameters: str  # JSON Schema as JSON text


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of the arguments object
    raw: str  # the text between the tags


@dataclass(frozen=True)
class ToolCallTurn:
    """An earlier call of the model, in the history."""

    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class ToolResultTurn:
    """The result of an earlier call, in the history."""

    output: str


class ToolCallFormat(ABC):
    """A family's tool-call format. ``open_tag`` / ``close_tag`` delimit a call in the model's text."""

    open_tag: str
    close_tag: str

    @abstractmethod
    def messages(self, instructions: str, tools: Sequence[ToolSpec],
                 history: Sequence[Mapping[str, Any] | ToolCallTurn | ToolResultTurn]) -> list[dict[str, Any]]:
        """Chat messages for the model: a system message with the instructions and tool definitions (none when
        both are empty), then ``history`` (chat messages, earlier calls and their results) as turns."""

    @abstractmethod
    def parse_call(self, body: str, tools: Sequence[ToolSpec]) -> ParsedCall | None:
        """The call inside one block of the model's text, or None if it is not a call of a known tool."""

    @abstractmethod
    def call_prefix(self, name: str | None) -> str:
        """The text an answer that must call a tool is made to begin with (the render option
        ``answer_prefix``): the open tag, and for a named tool the call up to its arguments."""

    def block_text(self, body: str) -> str:
        """A block that is not a call of a known tool, given back as the text the model wrote."""
        return f"{self.open_tag}\n{body}\n{self.close_tag}"

    def scanner(self) -> ToolCallScanner:
        return ToolCallScanner(self.open_tag, self.close_tag)


class QwenToolCalls(ToolCallFormat):
    open_tag, close_tag = CALL_OPEN, CALL_CLOSE

    def messages(self, instructions: str, tools: Sequence[ToolSpec],
                 history: Sequence[Mapping[str, Any] | ToolCallTurn | ToolResultTurn]) -> list[dict[str, Any]]:
        """Calls join the assistant turn before them and consecutive results form one user turn, as Qwen's chat
        template renders an assistant message with ``tool_calls`` and ``tool`` messages."""
        out: list[dict[str, Any]] = []
        system = system_text(instructions, tools)
        if system:
            out.append({"role": "system", "content": system})
        results = False  # the last message holds call results
        for entry in history:
            if isinstance(entry, ToolCallTurn):
                piece = call_text(entry.name, entry.arguments)
                if out and out[-1]["role"] == "assistant":  # calls join the assistant turn they came in
                    out[-1]["content"] += ("\n" if out[-1]["content"] else "") + piece
                else:
                    out.append({"role": "assistant", "content": piece})
            elif isinstance(entry, ToolResultTurn):
                piece = response_text(entry.output)
                if results:
                    out[-1]["content"] += "\n" + piece
                else:
                    out.append({"role": "user", "content": piece})
            else:
                out.append(dict(entry))
            results = isinstance(entry, ToolResultTurn)
        return out

    def parse_call(self, body: str, tools: Sequence[ToolSpec]) -> ParsedCall | None:
        return parse_call(body, tools)

    def call_prefix(self, name: str | None) -> str:
        if name is None:
            return f"{CALL_OPEN}\n"
        return f'{CALL_OPEN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '


QWEN_TOOL_CALLS = QwenToolCalls()


def system_text(instructions: str, tools: Sequence[ToolSpec]) -> str:
    """The system message: instructions, then the tool definitions (as Qwen's template writes them)."""
    if not tools:
        return instructions
    lines = [_TOOLS_HEADER]
    for t in tools:
        fn = {"name": t.name, "description": t.description, "parameters": json.loads(t.parameters)}
        lines.append("\n" + json.dumps({"type": "function", "function": fn}, ensure_ascii=False))
    body = "".join(lines) + _TOOLS_FOOTER
    return f"{instructions}\n\n{body}" if instructions else body


def call_text(name: str, arguments: str) -> str:
    return f'{CALL_OPEN}\n{{"name": "{name}", "arguments": {arguments}}}\n{CALL_CLOSE}'


def response_text(output: str) -> str:
    return f"{RESPONSE_OPEN}\n{output}\n{RESPONSE_CLOSE}"


def parse_call(body: str, tools: Sequence[ToolSpec]) -> ParsedCall | None:
    """The JSON inside one ``<tool_call>`` block, or None if it is not a call of a known tool."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict) or data.get("name") not in {t.name for t in tools}:
        return None
    args = data.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(data["name"], json.dumps(args, ensure_ascii=False), body)


class ToolCallScanner:
    """Splits streamed text into plain text and call blocks (``<tool_call>`` ... ``</tool_call>`` by default).

    ``feed`` returns (text that is certainly plain, bodies of the blocks it completed). Text that could still
    be the start of the open tag (a trailing ``<tool``) is held back until the next piece decides it.
    ``in_call`` is true while a block is open; ``started_call`` once any block has opened; ``call_offset`` is
    where (in all the text fed) the first block's tag began.
    """

    def __init__(self, open_tag: str = CALL_OPEN, close_tag: str = CALL_CLOSE) -> None:
        self.open_tag, self.close_tag = open_tag, close_tag
        self.pending = ""
        self.consumed = 0  # characters fed before ``pending``
        self.in_call = False
        self.started_call = False
        self.call_offset: int | None = None

    @property
    def undecided(self) -> bool:
        """Held text could still open a call."""
        return bool(self.pending) and not self.in_call

    def _drop(self, n: int) -> None:
        self.pending = self.pending[n:]
        self.consumed += n

    def feed(self, text: str) -> tuple[str, list[str]]:
        self.pending += text
        plain: list[str] = []
        bodies: list[str] = []
        while True:
            if self.in_call:
                end = self.pending.find(self.close_tag)
                if end < 0:
                    return "".join(plain), bodies
                bodies.append(self.pending[:end].strip())
                self._drop(end + len(self.close_tag))
                self.in_call = False
                continue
            start = self.pending.find(self.open_tag)
            if start >= 0:
                plain.append(self.pending[:start])
                if self.call_offset is None:
                    self.call_offset = self.consumed + start
                self._drop(start + len(self.open_tag))
                self.in_call = self.started_call = True
                continue
            keep = _partial_suffix(self.pending, self.open_tag)
            plain.append(self.pending[:len(self.pending) - keep])
            self._drop(len(self.pending) - keep)
            return "".join(plain), bodies

    def flush(self) -> tuple[str, str | None]:
        """At the end of the text: (held plain text, body of a block left open or None)."""
        rest = self.pending
        self._drop(len(rest))
        if self.in_call:
            self.in_call = False
            return "", rest
        return rest, None


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
