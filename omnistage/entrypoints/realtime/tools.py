"""Function tools in Qwen's format: how definitions, calls and results are written into the prompt, and how a
call is recognised in the Thinker's streamed text.

The format is the one Qwen's chat templates (Qwen2.5 / Qwen3 / Qwen3-Omni) write when given ``tools``: the
definitions go into the system message after the instructions (``# Tools`` ... ``<tools>`` one JSON object
per line ``</tools>`` ...); the model answers a call as
``<tool_call>\\n{"name": <name>, "arguments": <json object>}\\n</tool_call>`` (possibly several, possibly after
some text); an earlier call is written back into an assistant turn the same way and its result into a user
turn as ``<tool_response>\\n<output>\\n</tool_response>``. The engine client renders chat messages only, so
this module writes that text into the messages itself, exactly as the template would.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from omnistage.entrypoints.realtime.config import FunctionTool

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"

_TOOLS_HEADER = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
                 "with function signatures within <tools></tools> XML tags:\n<tools>")
_TOOLS_FOOTER = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                 "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
                 "\"arguments\": <args-json-object>}\n</tool_call>")


def system_text(instructions: str, tools: Sequence[FunctionTool]) -> str:
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


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of the arguments object
    raw: str  # the text between the tags


def parse_call(body: str, tools: Sequence[FunctionTool]) -> ParsedCall | None:
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
    """Splits streamed text into plain text and ``<tool_call>`` blocks.

    ``feed`` returns (text that is certainly plain, bodies of the blocks it completed). Text that could still
    be the start of ``<tool_call>`` (a trailing ``<tool``) is held back until the next piece decides it.
    ``in_call`` is true while a block is open; ``started_call`` once any block has opened; ``call_offset`` is
    where (in all the text fed) the first block's tag began.
    """

    def __init__(self) -> None:
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
                end = self.pending.find(CALL_CLOSE)
                if end < 0:
                    return "".join(plain), bodies
                bodies.append(self.pending[:end].strip())
                self._drop(end + len(CALL_CLOSE))
                self.in_call = False
                continue
            start = self.pending.find(CALL_OPEN)
            if start >= 0:
                plain.append(self.pending[:start])
                if self.call_offset is None:
                    self.call_offset = self.consumed + start
                self._drop(start + len(CALL_OPEN))
                self.in_call = self.started_call = True
                continue
            keep = _partial_suffix(self.pending, CALL_OPEN)
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
