"""The two Qwen2.5-Omni edges as plain classes: per-request data in, plain data out, no engine inside.

``Thinker2TalkerBridge``: the Thinker sends, per step, the Talker rows (embedding + final hidden) of the rows
it processed for requests that want speech: every prompt row, then every answer token it feeds back. Once the
whole prompt and the first answer row are there, the Talker request can start: the bridge returns its prompt
ids (``codec_mask`` x P, ``codec_pad``, ``codec_bos``) and its initial state; afterwards each new answer row
updates the state, and the Thinker's end marks the text complete. The Talker's decode step k needs answer row
k+1 (or the end): ``TalkerStageModel.text_ready`` says whether a request may run its next step.

``Talker2Token2WavBridge``: the Talker's sampled codes (its EOS ids dropped) feed one ``Token2WavStream`` per
request, seeded per request; it returns Token2Wav windows as they become ready and the rest at the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from omnistage.models.qwen2_5_omni.streaming import ChunkPlan, Token2WavStream
from omnistage.models.qwen2_5_omni.talker import TalkerTokenIds
from omnistage.models.qwen2_5_omni.talker_inputs import prefill_ids
from omnistage.models.qwen2_5_omni.token2wav import NoiseStream, Token2WavWindow
from omnistage.runner.sampler import make_generator


@dataclass
class TalkerUpdate:
    """What the Talker stage receives for one request.

    ``prompt_ids`` is set once, on the update that starts the request (its prefill can run from then on);
    ``state`` entries replace the request's state entries of the same name (they are complete values, e.g. the
    whole tuple of answer rows so far).
    """

    state: dict[str, Any]
    prompt_ids: list[int] | None = None


@dataclass
class _Text:
    num_prompt: int
    voice: str
    prompt_rows: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> row, until started
    answer_rows: tuple[torch.Tensor, ...] = ()
    started: bool = False


class Thinker2TalkerBridge:
    def __init__(self, ids: TalkerTokenIds) -> None:
        self.ids = ids
        self._states: dict[str, _Text] = {}

    def add_request(self, req_id: str, num_prompt_tokens: int, voice: str) -> None:
        if num_prompt_tokens <= 0:
            raise ValueError("a Talker request needs a non-empty Thinker prompt")
        self._states[req_id] = _Text(num_prompt_tokens, voice)

    def on_thinker_rows(self, req_id: str, positions: torch.Tensor, rows: torch.Tensor) -> TalkerUpdate | None:
        """Rows [k, E] at Thinker positions [k] (a step's span for this request). None: nothing to do yet."""
        st = self._states.get(req_id)
        if st is None:
            return None  # aborted, or the Talker already finished
        new_answers = []
        for pos, row in zip(positions.tolist(), rows.unbind(0)):
            index = pos - st.num_prompt  # answer row index; < 0: a prompt row
            if index < 0:
                if not st.started:
                    st.prompt_rows[pos] = row
            elif index == len(st.answer_rows) + len(new_answers):
                new_answers.append(row)
            elif index > len(st.answer_rows) + len(new_answers):
                raise RuntimeError(f"request {req_id!r}: answer row {index} arrived before the rows ahead of it")
            # else: a row sent again by a recompute after preemption; the first copy stands
        if not new_answers:
            return None
        st.answer_rows = (*st.answer_rows, *new_answers)
        if st.started:
            return TalkerUpdate({"answer_rows": st.answer_rows})
        if len(st.prompt_rows) != st.num_prompt:
            raise RuntimeError(f"request {req_id!r}: answer rows arrived before all {st.num_prompt} prompt rows")
        prompt = torch.stack([st.prompt_rows[i] for i in range(st.num_prompt)])
        st.prompt_rows.clear()
        st.started = True
        return TalkerUpdate(
            {"prompt_rows": prompt, "answer_rows": st.answer_rows, "voice": st.voice, "text_done": False},
            prompt_ids=prefill_ids(st.num_prompt, self.ids),
        )

    def on_thinker_finished(self, req_id: str) -> TalkerUpdate | None:
        """The Thinker is done. None: it fed no answer token back, so there is nothing to speak (finish the
        Talker request without running it)."""
        st = self._states.pop(req_id, None)
        if st is None or not st.started:
            return None
        return TalkerUpdate({"text_done": True})

    def abort(self, req_id: str) -> None:
        self._states.pop(req_id, None)

    @property
    def num_pending(self) -> int:
        return len(self._states)


class Talker2Token2WavBridge:
    def __init__(self, plan: ChunkPlan, block_size: int, repeats: int, mel_dim: int, eos_ids: tuple[int, ...]) -> None:
        self.plan = plan
        self.block_size = block_size
        self.repeats = repeats
        self.mel_dim = mel_dim
        self.eos_ids = frozenset(eos_ids)
        self._streams: dict[str, Token2WavStream] = {}

    def add_request(self, req_id: str, voice: str, seed: int | None) -> None:
        """``seed`` seeds this request's ODE noise (None: a random seed)."""
        noise = NoiseStream(make_generator(seed, "cpu"), self.mel_dim)
        self._streams[req_id] = Token2WavStream(self.plan, self.block_size, self.repeats, voice, noise)

    def on_talker_tokens(self, req_id: str, token_ids: list[int]) -> list[Token2WavWindow]:
        stream = self._streams.get(req_id)
        if stream is None:
            return []
        codes = [t for t in token_ids if t not in self.eos_ids]
        return stream.push(codes) if codes else []

    def on_talker_finished(self, req_id: str) -> list[Token2WavWindow]:
        """The remaining windows (the last one ends the request's audio); the stream is dropped."""
        stream = self._streams.pop(req_id, None)
        return [] if stream is None else stream.finish()

    def abort(self, req_id: str) -> None:
        self._streams.pop(req_id, None)

    @property
    def num_pending(self) -> int:
        return len(self._streams)
