"""The two Qwen2.5-Omni edges as plain classes: what they hand on, when, and what they forget."""

from __future__ import annotations

import pytest
import torch

from omnistage.models.qwen2_5_omni.bridges import Talker2Token2WavBridge, Thinker2TalkerBridge
from omnistage.models.qwen2_5_omni.streaming import ChunkPlan
from omnistage.models.qwen2_5_omni.talker import TalkerTokenIds
from omnistage.models.qwen2_5_omni.token2wav import NoiseStream

IDS = TalkerTokenIds(codec_pad=10, codec_bos=11, codec_eos=12, codec_mask=14, text_pad=1, text_bos=2, text_eos=3)
E = 4


def _rows(positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows whose values name their position, so the test can see which row went where."""
    pos = torch.tensor(positions)
    return pos, pos[:, None].float().expand(-1, E).clone()


def test_talker_starts_once_prompt_and_first_answer_row_exist():
    bridge = Thinker2TalkerBridge(IDS)
    bridge.add_request("a", num_prompt_tokens=5, voice="Ethan")
    assert bridge.on_thinker_rows("a", *_rows([0, 1, 2])) is None  # chunked prefill, part 1
    assert bridge.on_thinker_rows("a", *_rows([3, 4])) is None  # prompt done; first token not yet fed back
    start = bridge.on_thinker_rows("a", *_rows([5]))
    assert start.prompt_ids == [14] * 5 + [10, 11]
    assert torch.equal(start.state["prompt_rows"][:, 0], torch.arange(5.0))
    assert [int(r[0]) for r in start.state["answer_rows"]] == [5]
    assert start.state["voice"] == "Ethan" and start.state["text_done"] is False
    more = bridge.on_thinker_rows("a", *_rows([6]))
    assert more.prompt_ids is None and [int(r[0]) for r in more.state["answer_rows"]] == [5, 6]
    # A recompute after preemption sends rows again: ignored, nothing new.
    assert bridge.on_thinker_rows("a", *_rows([0, 1, 2, 3, 4, 5, 6])) is None
    assert bridge.on_thinker_finished("a").state == {"text_done": True}
    assert bridge.num_pending == 0
    assert bridge.on_thinker_rows("a", *_rows([7])) is None  # finished: forgotten


def test_answer_rows_cannot_skip_ahead():
    bridge = Thinker2TalkerBridge(IDS)
    bridge.add_request("a", num_prompt_tokens=2, voice="Ethan")
    with pytest.raises(RuntimeError, match="before all 2 prompt rows"):
        bridge.on_thinker_rows("a", *_rows([0, 2]))
    bridge.add_request("b", num_prompt_tokens=2, voice="Ethan")
    bridge.on_thinker_rows("b", *_rows([0, 1, 2]))
    with pytest.raises(RuntimeError, match="before the rows ahead"):
        bridge.on_thinker_rows("b", *_rows([4]))


def test_no_fed_back_token_means_nothing_to_speak_and_abort_forgets():
    bridge = Thinker2TalkerBridge(IDS)
    bridge.add_request("a", num_prompt_tokens=3, voice="Ethan")
    bridge.on_thinker_rows("a", *_rows([0, 1, 2]))
    assert bridge.on_thinker_finished("a") is None  # the Thinker stopped after one token
    bridge.add_request("b", num_prompt_tokens=3, voice="Ethan")
    bridge.abort("b")
    assert bridge.num_pending == 0 and bridge.on_thinker_rows("b", *_rows([0, 1, 2, 3])) is None


def test_codes_to_windows_per_request():
    block, repeats, mel = 8, 2, 80
    plan = ChunkPlan(chunk_blocks=2, past_blocks=1, future_blocks=1)
    bridge = Talker2Token2WavBridge(plan, block, repeats, mel, eos_ids=IDS.eos_ids)
    bridge.add_request("a", "Ethan", seed=3)
    bridge.add_request("b", "Chelsie", seed=4)
    # a: 12 codes (24 frames) = chunk (16) + look-ahead (8): its first window is ready.
    windows = bridge.on_talker_tokens("a", list(range(20, 32)))
    assert len(windows) == 1 and windows[0].keep_start == 0 and windows[0].keep_frames == 16
    assert windows[0].voice == "Ethan" and windows[0].codes.tolist() == list(range(20, 32))
    assert torch.equal(windows[0].noise, NoiseStream(torch.Generator().manual_seed(3), mel).take(24))
    assert bridge.on_talker_tokens("b", [1, 2, 3]) == []
    # The EOS id the Talker samples last is not a code.
    rest = bridge.on_talker_tokens("a", [40, 41, IDS.codec_eos]) + bridge.on_talker_finished("a")
    assert sum(w.keep_frames for w in windows + rest) == 14 * repeats
    assert rest[-1].codes[-2:].tolist() == [40, 41]
    assert bridge.on_talker_finished("a") == []  # already gone
    bridge.abort("b")
    assert bridge.num_pending == 0 and bridge.on_talker_tokens("b", [1] * 20) == []

