"""Tool-call formats are a family's hook: both built-in families declare Qwen's, the engine client's ModelInfo
carries it to the entrypoints, and a conversation of a model without one refuses tools."""

from __future__ import annotations

import pytest

from omnistage.entrypoints.realtime.config import FunctionTool
from omnistage.entrypoints.realtime.conversation import Conversation, FunctionCall, UserMessage
from omnistage.entrypoints.realtime.events import RealtimeError
from omnistage.models.registry import get_family
from omnistage.models.tool_calls import QWEN_TOOL_CALLS, ToolCallTurn, ToolResultTurn


@pytest.mark.parametrize("family", ["qwen3_omni", "qwen2_5_omni"])
def test_built_in_families_use_qwens_format(family):
    assert get_family(family).tool_calls is QWEN_TOOL_CALLS


def test_engine_info_carries_the_familys_format(tiny_ckpt):
    from omnistage.pipeline.engine import OmniEngine
    from omnistage.pipeline.engine_args import EngineArgs

    engine = OmniEngine(EngineArgs(str(tiny_ckpt)))
    assert engine.info.tool_calls is engine.family.tool_calls is QWEN_TOOL_CALLS


def test_qwen_format_joins_calls_to_their_turn_and_results_into_one_user_turn():
    history = [{"role": "user", "content": "hi"}, ToolCallTurn("f", "{}"), ToolResultTurn("1"), ToolResultTurn("2"),
               ToolCallTurn("f", '{"x": 1}')]
    msgs = QWEN_TOOL_CALLS.messages("", [], history)
    assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant"]
    assert msgs[2]["content"] == "<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response>"
    assert history[0] == {"role": "user", "content": "hi"}  # the history is not modified


def test_a_model_without_a_tool_format_refuses_tools():
    conv = Conversation(max_items=10, max_audio_samples=24000)
    conv.add(UserMessage("u1", [("text", "hi")]))
    assert conv.messages("Be brief.", []) == [{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "hi"}]
    with pytest.raises(RealtimeError, match="does not call tools"):
        conv.messages("", [FunctionTool("f")])
    conv.add(FunctionCall("c1", call_id="call_1", name="f"))
    with pytest.raises(RealtimeError, match="does not call tools"):
        conv.messages("", [])
