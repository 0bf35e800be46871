"""Thinker -> Talker: turn streamed Thinker rows into Talker input, and keep the Talker behind its text.

The Thinker sends, per request and step, only the rows the Talker uses: layer-0 embeddings of user-turn
prompt rows, of the final ``<|im_start|>assistant\\n`` header, and of every answer token it feeds back.
The Talker request is registered with the Thinker request and waits (``WAITING_FOR_INPUT``) until the
first answer token has been fed; then its prefill is built. Decode step ``j`` needs trailing text row
``j`` (answer token ``j+1``, or tts_eos/tts_pad once the Thinker is done); a request whose row is not
there yet is paused — keeping its KV — until the row arrives.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from omnistage.core.request import Request
from omnistage.core.sampling_params import SamplingParams
from omnistage.pipeline.stage_engine import ARStageEngine


@dataclass
class _TextState:
    prompt_ids: list[int]
    speaker_id: int
    prompt_rows: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> thinker embed row
    answer_rows: list[torch.Tensor] = field(default_factory=list)  # thinker embeds of fed answer tokens
    started: bool = False  # talker prefill handed over


class Thinker2Talker:
    def __init__(self, talker: ARStageEngine, talker_model) -> None:
        self.talker = talker
        self.model = talker_model  # TalkerStageModel: builds prefill, projects text, knows codec ids
        self._states: dict[str, _TextState] = {}

    def on_request(self, req_id: str, prompt_ids: list[int], params: SamplingParams, speaker_id: int) -> None:
        self._states[req_id] = _TextState(list(prompt_ids), speaker_id)
        req = Request(req_id, [], params, eos_token_ids=(self.model.codec_eos_id,), input_finished=False)
        self.talker.add_request(req, wait_for_input=True)

    def on_upstream_output(self, req_id: str, payload: dict) -> None:
        st = self._states.get(req_id)
        if st is None:
            return
        num_prompt = len(st.prompt_ids)
        new_answers = []
        for pos, row in zip(payload["positions"].tolist(), payload["embeds"].unbind(0)):
            if pos < num_prompt:
                st.prompt_rows[pos] = row
            else:
                new_answers.append(row)
        if not new_answers:
            return
        if not st.started:
            st.answer_rows.extend(new_answers)
            self._start(req_id, st)
        else:
            self._append_text(req_id, torch.stack(new_answers))

    def _start(self, req_id: str, st: _TextState) -> None:
        embeds, ids = self.model.build_prefill(st.prompt_ids, st.prompt_rows, st.answer_rows[0], st.speaker_id)
        texts = self.model.project_text(torch.stack(st.answer_rows))  # row 0 = first answer token
        self.talker.runner.buffer.merge(req_id, {"prefill_embeds": embeds, "text_rows": texts})
        st.prompt_rows.clear()
        st.answer_rows.clear()
        st.started = True
        self.talker.scheduler.add_input(req_id, ids, finished=True)

    def _append_text(self, req_id: str, rows: torch.Tensor) -> None:
        projected = self.model.project_text(rows)
        old = self.talker.runner.buffer.get(req_id).get("text_rows")
        merged = projected if old is None else torch.cat([old, projected])
        self.talker.runner.buffer.merge(req_id, {"text_rows": merged})
        self._resume(req_id)

    def on_upstream_finished(self, req_id: str) -> None:
        st = self._states.pop(req_id, None)
        if st is None:
            return
        if not st.started:
            # The Thinker fed no answer token back (it stopped after one token): nothing to speak.
            self.talker.finish(req_id, "stop")
            return
        self.talker.runner.buffer.merge(req_id, {"text_done": True})
        self._resume(req_id)

    def _resume(self, req_id: str) -> None:
        if self.talker.scheduler.is_paused(req_id):
            self.talker.scheduler.resume(req_id)

    def after_talker_step(self, stepped: list[str]) -> None:
        """Pause Talker requests whose next decode step has no text row yet."""
        sched = self.talker.scheduler
        for req_id in stepped:
            req = sched.get_request(req_id)
            if req is None or req.is_finished or sched.is_paused(req_id) or not req.output_token_ids:
                continue
            if not self.model.text_ready(self.talker.runner.buffer.get(req_id), req.num_output_tokens - 1):
                sched.pause_for_input(req_id)

    def abort(self, req_id: str) -> None:
        self._states.pop(req_id, None)

    def on_talker_finished(self, req_id: str) -> None:
        """The Talker stopped before the Thinker did: later text for this request is dropped."""
        self._states.pop(req_id, None)

    @property
    def num_pending(self) -> int:
        return len(self._states)
