"""Qwen2.5-Omni's two edges: Thinker -> Talker and Talker -> Token2Wav.

Each bridge lives with its downstream stage and talks to it only through the stage's input interface
(``ARStageInputs`` / ``GenerationStageInputs`` in ``omnistage.models.family``); its per-request state is created
by ``add_request`` (with the request's ``StageRequest.data``) and dropped by ``drop``.

``ThinkerToTalker``: the Thinker sends, per step, the Talker rows (embedding + final hidden) of the rows it
processed for requests that speak: every prompt row, then every answer token it feeds back. Once the whole
prompt and the first answer row are there, the Talker request gets its state (``prompt_rows``, ``answer_rows``)
and its prompt ids (``codec_mask`` x P, ``codec_pad``, ``codec_bos``) as complete input, so its prefill can run;
afterwards each new answer row extends ``answer_rows``, and the Thinker's end sets ``text_done``. The Talker's
decode step k needs answer row k+1 (or the end): ``TalkerStageModel.input_ready`` pauses it until then. A Thinker
that fed no answer token back (it stopped after one token) leaves nothing to speak: the Talker request finishes.

``TalkerToToken2Wav``: the Talker's codes feed one ``Token2WavStream`` per request (its voice, its ODE noise
seeded by the request's seed); windows go to Token2Wav as they become ready, the rest when the Talker ends.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from omnistage.models.family import ARStageInputs, GenerationStageInputs
from omnistage.models.qwen2_5_omni.streaming import ChunkPlan, Token2WavStream
from omnistage.models.qwen2_5_omni.talker import TalkerTokenIds
from omnistage.models.qwen2_5_omni.talker_inputs import prefill_ids
from omnistage.models.qwen2_5_omni.token2wav import NoiseStream
from omnistage.runner.sampler import make_generator


@dataclass
class _Text:
    num_prompt: int
    prompt_rows: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> row, until started
    num_answers: int = 0  # answer rows handed to the Talker
    started: bool = False


class ThinkerToTalker:
    def __init__(self, ids: TalkerTokenIds) -> None:
        self.ids = ids
        self._states: dict[str, _Text] = {}

    def __len__(self) -> int:
        return len(self._states)

    def add_request(self, req_id: str, data: Mapping[str, Any]) -> None:
        num_prompt = int(data["num_prompt"])
        if num_prompt <= 0:
            raise ValueError("a Talker request needs a non-empty Thinker prompt")
        self._states[req_id] = _Text(num_prompt)

    def drop(self, req_id: str) -> None:
        self._states.pop(req_id, None)

    def on_input(self, req_id: str, payload: Mapping[str, Any], sink: ARStageInputs) -> None:
        """``payload``: rows [k, E] at Thinker positions [k] (a step's span of this request)."""
        st = self._states.get(req_id)
        if st is None:
            return  # the Thinker already ended for this Talker request
        new_answers = []
        for pos, row in zip(payload["positions"].tolist(), payload["rows"].unbind(0)):
            index = pos - st.num_prompt  # answer row index; < 0: a prompt row
            if index < 0:
                if not st.started:
                    st.prompt_rows[pos] = row
            elif index == st.num_answers + len(new_answers):
                new_answers.append(row)
            elif index > st.num_answers + len(new_answers):
                raise RuntimeError(f"request {req_id!r}: answer row {index} arrived before the rows ahead of it")
            # else: a row sent again by a recompute after preemption; the first copy stands
        if not new_answers:
            return
        st.num_answers += len(new_answers)
        if st.started:
            sink.update_state(req_id, {"answer_rows": (*sink.state(req_id)["answer_rows"], *new_answers)})
            return
        if len(st.prompt_rows) != st.num_prompt:
            raise RuntimeError(f"request {req_id!r}: answer rows arrived before all {st.num_prompt} prompt rows")
        prompt = torch.stack([st.prompt_rows[i] for i in range(st.num_prompt)])
        st.prompt_rows.clear()
        st.started = True
        sink.update_state(req_id, {"prompt_rows": prompt, "answer_rows": tuple(new_answers)})
        sink.append_tokens(req_id, prefill_ids(st.num_prompt, self.ids), finished=True)

    def on_end(self, req_id: str, sink: ARStageInputs) -> None:
        st = self._states.pop(req_id, None)
        if st is None:
            return
        if not st.started:
            sink.finish(req_id, "stop")  # no answer token was fed back: nothing to speak
            return
        sink.update_state(req_id, {"text_done": True})


# Qwen's own streaming geometry (3 new DiT blocks per chunk, 2 blocks of past context, 1 of look-ahead), with
# chunks growing up to 24 new blocks (``streaming.ChunkPlan``: the first audio as early, ~40% less DiT work on long
# answers); ``max_chunk_blocks: null`` (or a cap at or below ``chunk_blocks``) keeps every chunk at
# ``chunk_blocks``. Large past/future give one-shot audio.
TALKER2TOKEN2WAV_DEFAULTS: Mapping[str, int | None] = MappingProxyType(
    {"chunk_blocks": 3, "past_blocks": 2, "future_blocks": 1, "max_chunk_blocks": 24}
)


def talker2token2wav_args(args: Mapping[str, Any]) -> Mapping[str, Any]:
    unknown = sorted(set(args) - set(TALKER2TOKEN2WAV_DEFAULTS))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown}; allowed: {sorted(TALKER2TOKEN2WAV_DEFAULTS)}")
    merged = {**TALKER2TOKEN2WAV_DEFAULTS, **args}
    for key, value in merged.items():
        if key == "max_chunk_blocks" and value is None:
            continue
        low = 0 if key in ("past_blocks", "future_blocks") else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{key} must be an int >= {low}, got {value!r}")
    return MappingProxyType(merged)


class TalkerToToken2Wav:
    def __init__(self, plan: ChunkPlan, block_size: int, repeats: int, mel_dim: int, tail: bool = False) -> None:
        self.plan = plan
        self.block_size = block_size
        self.repeats = repeats
        self.mel_dim = mel_dim
        self.tail = tail  # the vocoder makes samples past the last frame (see Token2WavStream)
        self._streams: dict[str, Token2WavStream] = {}

    def __len__(self) -> int:
        return len(self._streams)

    def add_request(self, req_id: str, data: Mapping[str, Any]) -> None:
        """``data``: ``voice`` (speaker key) and ``seed`` (of the request's ODE noise; None: a random seed)."""
        noise = NoiseStream(make_generator(data.get("seed"), "cpu"), self.mel_dim)
        self._streams[req_id] = Token2WavStream(
            self.plan, self.block_size, self.repeats, data["voice"], noise, self.tail
        )

    def drop(self, req_id: str) -> None:
        self._streams.pop(req_id, None)

    def on_input(self, req_id: str, payload: Mapping[str, Any], sink: GenerationStageInputs) -> None:
        stream = self._streams.get(req_id)
        if stream is None:
            return
        for window in stream.push(payload["codes"]):
            sink.add_payload(req_id, window, finished=False)

    def on_end(self, req_id: str, sink: GenerationStageInputs) -> None:
        stream = self._streams.pop(req_id, None)
        if stream is None:
            return
        windows = stream.finish()
        if not windows:  # everything went out already, or nothing was spoken
            sink.add_payload(req_id, None, finished=True)
        for i, window in enumerate(windows):
            sink.add_payload(req_id, window, finished=i == len(windows) - 1)
