"""Prompt rendering Qwen2.5-Omni needs for speech.

The released model speaks only under its own system prompt (the model card and transformers' docs warn that
audio output is not guaranteed otherwise). A conversation that asks for speech and brings no system turn gets
it; one that brings its own system turn keeps it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

SPEECH_SYSTEM_PROMPT = (
    "You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of perceiving auditory "
    "and visual inputs, as well as generating text and speech."
)


def with_speech_system_prompt(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """``messages`` with the speech system turn first, unless the conversation already opens with a system turn."""
    messages = list(messages)
    if messages and messages[0].get("role") == "system":
        return messages
    return [{"role": "system", "content": SPEECH_SYSTEM_PROMPT}, *messages]
