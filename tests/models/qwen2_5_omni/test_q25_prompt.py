"""Qwen2.5-Omni prompt rendering for speech."""

from __future__ import annotations

from omnistage.models.qwen2_5_omni.prompt import SPEECH_SYSTEM_PROMPT, with_speech_system_prompt


def test_speech_system_prompt_is_added_only_without_a_system_turn():
    user = [{"role": "user", "content": "Hi"}]
    assert with_speech_system_prompt(user) == [{"role": "system", "content": SPEECH_SYSTEM_PROMPT}, *user]
    own = [{"role": "system", "content": "Be brief."}, *user]
    assert with_speech_system_prompt(own) == own
