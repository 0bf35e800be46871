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

Talker -> Code2Wav: one Talker step yields at most one frame per request; Code2Wav's input contract is a
chunk of frames plus up to ``left_context_frames`` earlier frames as context (transformers'
``chunked_decode``: 300 frames, 25 of context, context = min(25, frames before the chunk)). The first
chunk may be shorter so audio starts early; every later chunk is ``chunk_frames``. When the Talker
finishes, the remainder goes out as the last chunk.
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


class ThinkerToTalker:
    def __init__(self, talker_model: Any) -> None:
        self.model = talker_model  # TalkerStageModel: builds the prefill and projects text rows
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
        if st.started:
            projected = self.model.project_text(torch.stack(new_answers))
            old = sink.state(req_id).get("text_rows")
            sink.update_state(req_id, {"text_rows": projected if old is None else torch.cat([old, projected])})
            return
        st.answer_rows.extend(new_answers)
        embeds, ids, positions = self.model.build_prefill(
            st.prompt_ids, st.prompt_rows, st.hidden_rows, st.answer_rows[0], st.speaker_id, st.media_spans
        )
        texts = self.model.project_text(torch.stack(st.answer_rows))  # row 0 = first answer token
        st.prompt_rows.clear()
        st.hidden_rows.clear()
        st.answer_rows.clear()
        st.started = True
        sink.update_state(req_id, {"prefill_embeds": embeds, "prefill_positions": positions, "text_rows": texts})
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


@dataclass
class Code2WavChunk:
    codes: torch.Tensor  # [Q, left_context + new_frames]
    left_context: int  # leading frames that are context only (their samples are dropped)
    first_frame: int  # index of the first new frame in the request's frame sequence


@dataclass
class _FrameState:
    frames: list[torch.Tensor] = field(default_factory=list)  # every frame not yet out of context range
    offset: int = 0  # index (in the request's frame sequence) of frames[0]
    emitted: int = 0  # frames already handed over as new frames


# Reference chunking of transformers' Code2Wav.chunked_decode is 300 frames with 25 frames of left context.
# The first chunk is smaller so the first audio reaches the client early (25 frames = 2 s of 24 kHz audio
# at 1920 samples per frame); set first_chunk_frames == chunk_frames for the reference's boundaries.
TALKER2CODE2WAV_DEFAULTS: Mapping[str, int] = MappingProxyType(
    {"first_chunk_frames": 25, "chunk_frames": 300, "left_context_frames": 25}
)
# Overrides that reproduce the reference's chunk boundaries exactly (for parity tests).
TALKER2CODE2WAV_REFERENCE_ARGS: Mapping[str, int] = MappingProxyType(
    {"first_chunk_frames": 300, "chunk_frames": 300, "left_context_frames": 25}
)


def talker2code2wav_args(args: Mapping[str, Any]) -> Mapping[str, Any]:
    unknown = sorted(set(args) - set(TALKER2CODE2WAV_DEFAULTS))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown}; allowed: {sorted(TALKER2CODE2WAV_DEFAULTS)}")
    merged = {**TALKER2CODE2WAV_DEFAULTS, **args}
    for key, value in merged.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key} must be a positive int, got {value!r}")
    if merged["left_context_frames"] >= merged["chunk_frames"]:
        raise ValueError(
            f"left_context_frames ({merged['left_context_frames']}) must be < chunk_frames ({merged['chunk_frames']})"
        )
    return MappingProxyType(merged)


class TalkerToCode2Wav:
    def __init__(self, first_chunk_frames: int, chunk_frames: int, left_context_frames: int) -> None:
        self.first_chunk_frames = first_chunk_frames
        self.chunk_frames = chunk_frames
        self.left_context_frames = left_context_frames
        self._states: dict[str, _FrameState] = {}

    def __len__(self) -> int:
        return len(self._states)

    def add_request(self, req_id: str, data: Mapping[str, Any]) -> None:
        self._states[req_id] = _FrameState()

    def drop(self, req_id: str) -> None:
        self._states.pop(req_id, None)

    def _emit(self, req_id: str, st: _FrameState, n: int, finished: bool, sink: GenerationStageInputs) -> None:
        start = st.emitted
        ctx = min(self.left_context_frames, start)
        lo = start - ctx - st.offset
        codes = torch.stack(st.frames[lo : start - st.offset + n], dim=1)  # [Q, ctx + n]
        sink.add_payload(req_id, Code2WavChunk(codes, ctx, start), finished)
        st.emitted += n
        # Keep only what the next chunk can still use as context.
        keep_from = max(0, st.emitted - self.left_context_frames) - st.offset
        if keep_from > 0:
            del st.frames[:keep_from]
            st.offset += keep_from

    def on_input(self, req_id: str, payload: Mapping[str, Any], sink: GenerationStageInputs) -> None:
        st = self._states.get(req_id)
        if st is None:
            return
        st.frames.extend(payload["frames"].unbind(0))
        while True:
            size = self.first_chunk_frames if st.emitted == 0 else self.chunk_frames
            if st.offset + len(st.frames) - st.emitted < size:
                break
            self._emit(req_id, st, size, False, sink)

    def on_end(self, req_id: str, sink: GenerationStageInputs) -> None:
        st = self._states.pop(req_id, None)
        if st is None:
            return
        remaining = st.offset + len(st.frames) - st.emitted
        if remaining > 0:
            self._emit(req_id, st, remaining, True, sink)
        else:
            sink.add_payload(req_id, None, True)
