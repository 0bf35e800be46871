"""Qwen3-Omni's two edges: Thinker -> Talker and Talker -> Code2Wav.

Each bridge lives with its downstream stage and talks to it only through the stage's input interface
(``ARStageInputs`` / ``GenerationStageInputs`` in ``omnistage.models.family``).

Thinker -> Talker: the Thinker sends, per request and step, only the rows the Talker uses: layer-0
embeddings of user-turn text rows, of the final ``<|im_start|>assistant\\n`` header, and of every answer
token it feeds back; accept-layer hidden states of user-turn audio/image/video rows. The Talker request
waits for input until the first answer token has been fed; then its prefill (and, for prompts with images
or videos, its 3-D positions) is built. Decode step ``j`` needs trailing text row ``j`` (answer token ``j+1``, or
tts_eos/tts_pad once the Thinker is done); the Talker model's ``input_ready`` tells the stage to pause a
request whose row is not there yet.

Talker -> Code2Wav: one Talker step yields at most one frame per request; the streaming Code2Wav decodes
chunks of new frames of any size (its per-request state carries what earlier frames contribute, so the
stream equals one-shot decoding and no context is recomputed). The chunk policy only trades latency for
per-call overhead: a small first chunk (``first_chunk_frames``) so sound starts early, then
``chunk_frames`` per chunk; when the Talker finishes, the remainder goes out as the last chunk.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from omnistage.models.family import ARStageInputs, GenerationStageInputs
from omnistage.models.qwen3_omni.mrope import MediaSpan


@dataclass
class _TextState:
    prompt_ids: list[int]
    speaker_id: int
    media_spans: tuple[MediaSpan, ...]  # the Talker prompt's media spans (its 3-D positions)
    prompt_rows: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> thinker embed row
    hidden_rows: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> accept-layer row (media)
    answer_rows: list[torch.Tensor] = field(default_factory=list)  # thinker embeds of fed answer tokens
    num_answers: int = 0  # answer rows received so far (a recomputing Thinker sends old rows again)
    started: bool = False  # talker prefill handed over
    answer_buffer: torch.Tensor | None = None  # the rows handed over, [capacity, E] (the Talker holds a view)

    def handed_answers(self, new: list[torch.Tensor]) -> torch.Tensor:
        """Every answer row so far, [num_answers, E], after the ``new`` ones (the last of them): a view of a buffer
        that doubles as it fills, so a long answer's rows are copied O(n) times in all (a concatenation per
        token copied O(n^2) rows: ~4 GB for a 1000-token answer at the released width). Views handed earlier
        keep their rows: later rows go past them, or into a new buffer."""
        held, buffer = self.num_answers - len(new), self.answer_buffer
        if buffer is None or self.num_answers > buffer.shape[0]:
            grown = new[0].new_empty(max(2 * self.num_answers, 64), new[0].shape[-1])
            if held:
                grown[:held] = buffer[:held]
            buffer = self.answer_buffer = grown
        torch.stack(new, out=buffer[held : self.num_answers])
        return buffer[: self.num_answers]


class ThinkerToTalker:
    def __init__(self, talker_model: Any) -> None:
        self.model = talker_model  # TalkerStageModel: builds the prefill
        self._states: dict[str, _TextState] = {}

    def __len__(self) -> int:
        return len(self._states)

    def add_request(self, req_id: str, data: Mapping[str, Any]) -> None:
        self._states[req_id] = _TextState(
            list(data["prompt_ids"]), int(data["speaker_id"]), tuple(data.get("media_spans", ()))
        )

    def drop(self, req_id: str) -> None:
        self._states.pop(req_id, None)

    def on_input(self, req_id: str, payload: Mapping[str, Any], sink: ARStageInputs) -> None:
        st = self._states.get(req_id)
        if st is None:
            return  # the Talker has already been given everything (or the request left)
        num_prompt = len(st.prompt_ids)
        if "hidden" in payload and not st.started:
            st.hidden_rows.update(zip(payload["hidden_positions"].tolist(), payload["hidden"].unbind(0)))
        new_answers = []
        for pos, row in zip(payload["positions"].tolist(), payload["embeds"].unbind(0)):
            if pos < num_prompt:
                if not st.started:
                    st.prompt_rows[pos] = row
            elif pos == num_prompt + st.num_answers:
                new_answers.append(row)
                st.num_answers += 1
            elif pos > num_prompt + st.num_answers:
                raise ValueError(f"answer row at position {pos} arrived before position {num_prompt + st.num_answers}")
            # else: a row the Talker already has, sent again by a Thinker recomputing after preemption
        if not new_answers:
            return
        if st.started:  # (the Talker projects the rows it takes, a step's at once)
            sink.update_state(req_id, {"answer_embeds": st.handed_answers(new_answers)})
            return
        st.answer_rows.extend(new_answers)
        embeds, ids, positions = self.model.build_prefill(
            st.prompt_ids, st.prompt_rows, st.hidden_rows, st.answer_rows[0], st.speaker_id, st.media_spans
        )
        answers = st.handed_answers(st.answer_rows)  # row 0 = first answer token
        st.prompt_rows.clear()
        st.hidden_rows.clear()
        st.answer_rows.clear()
        st.started = True
        sink.update_state(req_id, {"prefill_embeds": embeds, "prefill_positions": positions, "answer_embeds": answers})
        sink.append_tokens(req_id, ids, finished=True)

    def on_end(self, req_id: str, sink: ARStageInputs) -> None:
        st = self._states.pop(req_id, None)
        if st is None:
            return
        if not st.started:
            # The Thinker fed no answer token back (it stopped after one token): nothing to speak.
            sink.finish(req_id, "stop")
            return
        sink.update_state(req_id, {"text_done": True})


# A 4-frame first chunk is 0.3 s of 24 kHz audio (1920 samples per frame, minus the 555 that wait for the
# next frame); 25-frame chunks (2 s) keep the per-call cost low (measured: cheaper per frame than one-shot
# decoding of long answers on CPU).
TALKER2CODE2WAV_DEFAULTS: Mapping[str, int] = MappingProxyType({"first_chunk_frames": 4, "chunk_frames": 25})


def talker2code2wav_args(args: Mapping[str, Any]) -> Mapping[str, Any]:
    unknown = sorted(set(args) - set(TALKER2CODE2WAV_DEFAULTS))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown}; allowed: {sorted(TALKER2CODE2WAV_DEFAULTS)}")
    merged = {**TALKER2CODE2WAV_DEFAULTS, **args}
    for key, value in merged.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key} must be a positive int, got {value!r}")
    return MappingProxyType(merged)


class TalkerToCode2Wav:
    """Frames -> chunks of new frames ``[Q, n]`` (the request's frames in order, each exactly once)."""

    def __init__(self, first_chunk_frames: int, chunk_frames: int) -> None:
        self.first_chunk_frames = first_chunk_frames
        self.chunk_frames = chunk_frames
        self._frames: dict[str, list[torch.Tensor]] = {}  # frames not handed over yet
        self._started: set[str] = set()  # requests whose first chunk went out

    def __len__(self) -> int:
        return len(self._frames)

    def add_request(self, req_id: str, data: Mapping[str, Any]) -> None:
        self._frames[req_id] = []

    def drop(self, req_id: str) -> None:
        self._frames.pop(req_id, None)
        self._started.discard(req_id)

    def on_input(self, req_id: str, payload: Mapping[str, Any], sink: GenerationStageInputs) -> None:
        frames = self._frames.get(req_id)
        if frames is None:
            return
        frames.extend(payload["frames"].unbind(0))
        while True:
            size = self.chunk_frames if req_id in self._started else self.first_chunk_frames
            if len(frames) < size:
                break
            sink.add_payload(req_id, torch.stack(frames[:size], dim=1), False)
            del frames[:size]
            self._started.add(req_id)

    def on_end(self, req_id: str, sink: GenerationStageInputs) -> None:
        frames = self._frames.pop(req_id, None)
        self._started.discard(req_id)
        if frames is None:
            return
        sink.add_payload(req_id, torch.stack(frames, dim=1) if frames else None, True)
