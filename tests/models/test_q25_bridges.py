"""Qwen2.5-Omni's bridges against a recording sink: what reaches the downstream stage, when, and what they
forget."""

from __future__ import annotations

import pytest
import torch
from test_qwen3_bridges import Sink

from omnistage.models.qwen2_5_omni.bridges import TalkerToToken2Wav, ThinkerToTalker, talker2token2wav_args
from omnistage.models.qwen2_5_omni.streaming import ChunkPlan
from omnistage.models.qwen2_5_omni.talker import TalkerTokenIds
from omnistage.models.qwen2_5_omni.token2wav import NoiseStream

IDS = TalkerTokenIds(codec_pad=10, codec_bos=11, codec_eos=12, codec_mask=14, text_pad=1, text_bos=2, text_eos=3)
E = 4


def _rows(positions: list[int]) -> dict:
    """Rows whose values name their position, so the test can see which row went where."""
    pos = torch.tensor(positions)
    return {"positions": pos, "rows": pos[:, None].float().expand(-1, E).clone()}


def _answers(sink: Sink, req_id: str) -> list[int]:
    return [int(r[0]) for r in sink.state(req_id)["answer_rows"]]


def test_talker_starts_once_prompt_and_first_answer_row_exist():
    bridge, sink = ThinkerToTalker(IDS), Sink()
    bridge.add_request("a", {"num_prompt": 5, "voice": "Ethan"})
    bridge.on_input("a", _rows([0, 1, 2]), sink)  # chunked prefill, part 1
    bridge.on_input("a", _rows([3, 4]), sink)  # prompt done; first token not yet fed back
    assert sink.tokens == [] and sink.states == {}
    bridge.on_input("a", _rows([5]), sink)
    assert sink.tokens == [("a", [14] * 5 + [10, 11], True)]  # codec_mask x P, codec_pad, codec_bos: complete
    assert torch.equal(sink.state("a")["prompt_rows"][:, 0], torch.arange(5.0))
    assert _answers(sink, "a") == [5] and "text_done" not in sink.state("a")
    bridge.on_input("a", _rows([6, 7]), sink)
    assert _answers(sink, "a") == [5, 6, 7] and len(sink.tokens) == 1
    # A recompute after preemption sends rows again: ignored, nothing new.
    bridge.on_input("a", _rows(list(range(8))), sink)
    assert _answers(sink, "a") == [5, 6, 7]
    bridge.on_end("a", sink)
    assert sink.state("a")["text_done"] is True and sink.finished == {}
    assert len(bridge) == 0
    bridge.on_input("a", _rows([8]), sink)  # ended: forgotten
    assert _answers(sink, "a") == [5, 6, 7]


def test_answer_rows_cannot_skip_ahead():
    bridge, sink = ThinkerToTalker(IDS), Sink()
    bridge.add_request("a", {"num_prompt": 2, "voice": "Ethan"})
    with pytest.raises(RuntimeError, match="before all 2 prompt rows"):
        bridge.on_input("a", _rows([0, 2]), sink)
    bridge.add_request("b", {"num_prompt": 2, "voice": "Ethan"})
    bridge.on_input("b", _rows([0, 1, 2]), sink)
    with pytest.raises(RuntimeError, match="before the rows ahead"):
        bridge.on_input("b", _rows([4]), sink)


def test_no_fed_back_token_means_nothing_to_speak_and_drop_forgets():
    bridge, sink = ThinkerToTalker(IDS), Sink()
    bridge.add_request("a", {"num_prompt": 3, "voice": "Ethan"})
    bridge.on_input("a", _rows([0, 1, 2]), sink)
    bridge.on_end("a", sink)  # the Thinker stopped after one token
    assert sink.finished == {"a": "stop"} and sink.tokens == []
    bridge.add_request("b", {"num_prompt": 3, "voice": "Ethan"})
    bridge.drop("b")
    bridge.on_input("b", _rows([0, 1, 2, 3]), sink)
    assert len(bridge) == 0 and sink.tokens == []


def test_codes_to_windows_per_request():
    block, repeats, mel = 8, 2, 80
    bridge, sink = TalkerToToken2Wav(ChunkPlan(chunk_blocks=2, past_blocks=1, future_blocks=1), block, repeats, mel), Sink()
    bridge.add_request("a", {"voice": "Ethan", "seed": 3})
    bridge.add_request("b", {"voice": "Chelsie", "seed": 4})
    # a: 12 codes (24 frames) = chunk (16) + look-ahead (8): its first window is ready.
    for c in range(20, 32):
        bridge.on_input("a", {"codes": torch.tensor([c])}, sink)
    assert len(sink.payloads) == 1
    _, window, finished = sink.payloads[0]
    assert not finished and window.keep_start == 0 and window.keep_frames == 16
    assert window.voice == "Ethan" and window.codes.tolist() == list(range(20, 32))
    assert torch.equal(window.noise, NoiseStream(torch.Generator().manual_seed(3), mel).take(24))
    bridge.on_input("b", {"codes": torch.tensor([1, 2, 3])}, sink)
    assert len(sink.payloads) == 1
    bridge.on_input("a", {"codes": torch.tensor([40, 41])}, sink)
    bridge.on_end("a", sink)
    rest = [p for p in sink.payloads[1:] if p[0] == "a"]
    assert [f for _, _, f in rest] == [False] * (len(rest) - 1) + [True]
    assert sum(w.keep_frames for _, w, _ in sink.payloads) == 14 * repeats
    assert rest[-1][1].codes[-2:].tolist() == [40, 41]
    bridge.drop("b")
    assert len(bridge) == 0


def test_end_with_every_window_out_is_a_bare_end_of_input():
    bridge, sink = TalkerToToken2Wav(ChunkPlan(chunk_blocks=1, past_blocks=0, future_blocks=0), 4, 2, 80), Sink()
    bridge.add_request("a", {"voice": "Ethan", "seed": None})
    bridge.on_input("a", {"codes": torch.arange(4)}, sink)  # 8 frames = two whole chunks
    bridge.on_end("a", sink)
    assert [(w is None, f) for _, w, f in sink.payloads] == [(False, False), (False, False), (True, True)]


def test_with_a_vocoder_tail_the_last_chunk_waits_for_the_end():
    """A vocoder making samples past the last frame: without look-ahead the chunk that reaches the last code waits
    for the end, so the last window (the one carrying them) ends the request."""
    bridge = TalkerToToken2Wav(ChunkPlan(chunk_blocks=1, past_blocks=0, future_blocks=0), 4, 2, 80, tail=True)
    sink = Sink()
    bridge.add_request("a", {"voice": "Ethan", "seed": None})
    bridge.on_input("a", {"codes": torch.arange(4)}, sink)  # 8 frames: the first chunk goes, the second waits
    assert [(w.keep_frames, w.last, f) for _, w, f in sink.payloads] == [(4, False, False)]
    bridge.on_end("a", sink)
    assert [(w.keep_frames, w.last, f) for _, w, f in sink.payloads[1:]] == [(4, True, True)]


def test_bridge_args_are_validated():
    assert dict(talker2token2wav_args({"future_blocks": 0})) == {"chunk_blocks": 3, "past_blocks": 2, "future_blocks": 0,
                                                                 "max_chunk_blocks": 24}
    assert talker2token2wav_args({"max_chunk_blocks": None})["max_chunk_blocks"] is None  # fixed chunks
    with pytest.raises(ValueError, match="max_chunk_blocks must be an int >= 1"):
        talker2token2wav_args({"max_chunk_blocks": 0})
    with pytest.raises(ValueError, match="max_chunk_blocks must be an int"):
        talker2token2wav_args({"max_chunk_blocks": "24"})
    with pytest.raises(ValueError, match="unknown key"):
        talker2token2wav_args({"chunk_frames": 3})
    with pytest.raises(ValueError, match="chunk_blocks must be an int >= 1"):
        talker2token2wav_args({"chunk_blocks": 0})
