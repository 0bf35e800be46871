"""Qwen3-Omni's bridges against a recording sink: what reaches the downstream stage, in which order."""

from __future__ import annotations

import random

import pytest
import torch

from omnistage.models.qwen3_omni.bridges import TalkerToCode2Wav, ThinkerToTalker
from omnistage.models.qwen3_omni.mrope import MediaSpan


class Sink:
    """Records what a bridge hands its downstream stage (both stage-input interfaces)."""

    def __init__(self):
        self.payloads, self.tokens, self.states, self.finished = [], [], {}, {}

    def add_payload(self, req_id, payload, finished):
        self.payloads.append((req_id, payload, finished))

    def append_tokens(self, req_id, token_ids, finished):
        self.tokens.append((req_id, list(token_ids), finished))

    def update_state(self, req_id, update):
        self.states.setdefault(req_id, {}).update(update)

    def state(self, req_id):
        return self.states.get(req_id, {})

    def finish(self, req_id, reason):
        self.finished[req_id] = reason


@pytest.mark.parametrize("seed", range(4))
def test_code2wav_chunks_are_the_frame_stream_in_order_each_frame_once(seed):
    rng = random.Random(seed)
    first, chunk = rng.randint(1, 7), rng.randint(1, 9)
    bridge, sink = TalkerToCode2Wav(first, chunk), Sink()
    frames = torch.randint(0, 50, (rng.randint(1, 40), 4))
    bridge.add_request("r", {})
    i = 0
    while i < frames.shape[0]:
        n = rng.randint(1, 3)
        bridge.on_input("r", {"frames": frames[i : i + n]}, sink)
        i += n
    bridge.on_end("r", sink)
    assert len(bridge) == 0
    assert [f for _, _, f in sink.payloads] == [False] * (len(sink.payloads) - 1) + [True]
    chunks = [c for _, c, _ in sink.payloads if c is not None]
    assert all(c is not None for _, c, _ in sink.payloads[:-1])  # only a bare end may carry no frames
    assert torch.equal(torch.cat([c.T for c in chunks]), frames)
    sizes = [c.shape[1] for c in chunks]
    assert sizes[0] == min(first, frames.shape[0])
    assert all(s == chunk for s in sizes[1:-1]) and 1 <= sizes[-1] <= max(first, chunk)


def test_code2wav_bridge_with_no_frames_ends_the_input_without_a_chunk():
    bridge, sink = TalkerToCode2Wav(4, 8), Sink()
    bridge.add_request("r", {})
    bridge.on_end("r", sink)
    assert sink.payloads == [("r", None, True)]


class TalkerDouble:
    """Records the prefill it is asked to build."""

    def __init__(self):
        self.prefills, self.hidden = [], []

    def build_prefill(self, prompt_ids, rows, hidden_rows, first_answer, speaker_id, media_spans):
        self.prefills.append((list(prompt_ids), {p: r.clone() for p, r in rows.items()}, first_answer.clone(),
                              speaker_id))
        self.hidden.append(({p: r.clone() for p, r in hidden_rows.items()}, media_spans))
        return torch.zeros(len(prompt_ids) + 9, 2), [7] * (len(prompt_ids) + 9), None


def rows(positions):
    pos = torch.tensor(positions)
    return {"positions": pos, "embeds": pos[:, None].float().repeat(1, 2)}


def test_thinker_rows_become_the_talker_prefill_and_answer_rows_once_each():
    """The answer rows reach the Talker's state as the Thinker's embeddings (the Talker projects the rows a step
    takes, all requests' at once), each once and in order."""
    model, sink = TalkerDouble(), Sink()
    bridge = ThinkerToTalker(model)
    prompt = list(range(10, 16))  # 6 prompt tokens
    bridge.add_request("r", {"prompt_ids": prompt, "speaker_id": 3})
    bridge.on_input("r", rows([0, 1, 2]), sink)  # user rows of a first prefill chunk
    bridge.on_input("r", rows([3, 5]), sink)
    assert not model.prefills and not sink.tokens  # no answer token yet: nothing to start
    bridge.on_input("r", rows([6]), sink)  # the first fed-back answer token
    (ids, got_rows, first, speaker), = model.prefills
    assert ids == prompt and speaker == 3 and sorted(got_rows) == [0, 1, 2, 3, 5] and first[0].item() == 6
    assert sink.tokens == [("r", [7] * 15, True)]
    assert torch.equal(sink.states["r"]["answer_embeds"], torch.tensor([[6.0, 6.0]]))
    bridge.on_input("r", rows([7, 8]), sink)
    # A Thinker recomputing after preemption sends old rows again: the Talker must not see them twice.
    bridge.on_input("r", rows([0, 1, 2, 3, 4, 5, 6, 7, 8, 9]), sink)
    text = sink.states["r"]["answer_embeds"][:, 0].tolist()
    assert text == [6.0, 7.0, 8.0, 9.0]
    with pytest.raises(ValueError, match="position 12 arrived before position 10"):
        bridge.on_input("r", rows([12]), sink)
    bridge.on_end("r", sink)
    assert sink.states["r"]["text_done"] is True and not sink.finished and len(bridge) == 0


def test_a_long_answer_grows_its_rows_without_copying_them_per_token():
    """Each token's hand-over is a view of a buffer that doubles as it fills: the rows equal the Thinker's in order,
    views handed earlier keep theirs, and a 300-token answer reallocates a few times, not once a token."""
    model, sink = TalkerDouble(), Sink()
    bridge = ThinkerToTalker(model)
    bridge.add_request("r", {"prompt_ids": [1, 2], "speaker_id": 0})
    bridge.on_input("r", rows([0, 1]), sink)
    handed, buffers = [], set()
    for pos in range(2, 302):
        bridge.on_input("r", rows([pos]), sink)
        handed.append(sink.states["r"]["answer_embeds"])
        buffers.add(handed[-1].untyped_storage().data_ptr())
    assert handed[-1][:, 0].tolist() == [float(p) for p in range(2, 302)]
    assert all(view[:, 1].tolist() == [float(p) for p in range(2, 3 + i)] for i, view in enumerate(handed))
    assert len(buffers) <= 4


def test_a_thinker_that_feeds_back_no_answer_token_leaves_nothing_to_speak():
    sink = Sink()
    bridge = ThinkerToTalker(TalkerDouble())
    bridge.add_request("r", {"prompt_ids": [1, 2, 3], "speaker_id": 0})
    bridge.on_input("r", rows([0, 1, 2]), sink)
    bridge.on_end("r", sink)
    assert sink.finished == {"r": "stop"} and not sink.tokens


def test_accept_layer_rows_of_media_positions_reach_the_prefill_with_the_media_spans():
    model, sink = TalkerDouble(), Sink()
    bridge = ThinkerToTalker(model)
    spans = (MediaSpan("image", 1, grid_thw=(1, 2, 2)),)
    bridge.add_request("r", {"prompt_ids": list(range(10, 16)), "speaker_id": 3, "media_spans": spans})
    media = {"hidden_positions": torch.tensor([2, 3]), "hidden": torch.tensor([[5.0, 5.0], [6.0, 6.0]])}
    bridge.on_input("r", {**rows([0, 1, 4, 5]), **media}, sink)  # a prefill chunk: text rows and image rows
    bridge.on_input("r", rows([6]), sink)
    (_, got_rows, _, _), = model.prefills
    (hidden, got_spans), = model.hidden
    assert sorted(got_rows) == [0, 1, 4, 5] and got_spans == spans
    assert sorted(hidden) == [2, 3] and hidden[3].tolist() == [6.0, 6.0]
    # Rows sent again by a recomputing Thinker after the prefill was built change nothing.
    bridge.on_input("r", {**rows([0, 1, 4, 5, 6]), **media}, sink)
    assert len(model.prefills) == 1 and len(sink.tokens) == 1
