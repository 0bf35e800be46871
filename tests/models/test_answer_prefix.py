"""The ``answer_prefix`` render option (a forced tool call's beginning): the prefix's tokens follow the prompt's,
and with media their 3-D positions are the ones generated tokens would get (``index + rope_delta``)."""

from __future__ import annotations

import pytest
import torch
from media_reference import SCENARIOS, ckpt_str, ours

from omnistage.models.qwen3_omni.processor import thinker_media
from omnistage.models.registry import family_for_checkpoint
from omnistage.models.tool_calls import QWEN_TOOL_CALLS

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
PREFIX = QWEN_TOOL_CALLS.call_prefix("get_weather")


@pytest.mark.parametrize("name", ["image", "audio"])
def test_prefix_after_media_takes_the_decode_positions(tiny_ckpt, name):
    proc = ours(ckpt_str(tiny_ckpt))
    messages, _ = SCENARIOS[name]
    base, forced = proc(messages), proc(messages, answer_prefix=PREFIX)
    added = proc.tokenizer.encode(PREFIX, add_special_tokens=False)
    assert added[0] == proc.tokenizer.convert_tokens_to_ids("<tool_call>")  # the tag is one special token
    assert forced.token_ids == base.token_ids + added
    a, b = thinker_media(base.data), thinker_media(forced.data)
    n = len(base.token_ids)
    assert b.positions.shape[0] == len(forced.token_ids) and b.rope_delta == a.rope_delta
    torch.testing.assert_close(b.positions[:n], a.positions, rtol=0, atol=0)
    decode = (torch.arange(n, len(forced.token_ids), dtype=torch.float32) + a.rope_delta)[:, None].expand(-1, 3)
    torch.testing.assert_close(b.positions[n:], decode, rtol=0, atol=0)


@pytest.mark.parametrize("ckpt", ["tiny_ckpt", "q25_ckpt"])
def test_text_prompts_of_both_families_end_with_the_prefix(request, ckpt):
    path = request.getfixturevalue(ckpt)
    family = family_for_checkpoint(path)(path)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    base = family.render_prompt(messages).token_ids
    forced = family.render_prompt(messages, answer_prefix=PREFIX).token_ids
    assert forced == base + family.tokenizer.encode(PREFIX, add_special_tokens=False)
    assert family.tokenizer.decode(forced[len(base):]) == PREFIX
