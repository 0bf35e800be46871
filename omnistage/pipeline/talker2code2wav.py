"""Talker -> Code2Wav: accumulate codec frames per request and hand over whole chunks only.

One Talker step yields at most one frame per request; Code2Wav's input contract is a chunk of frames plus
up to ``left_context_frames`` earlier frames as context (transformers' ``chunked_decode``: 300 frames, 25
of context, context = min(25, frames before the chunk)). The first chunk may be shorter so audio starts
early; every later chunk is ``chunk_frames``. When the Talker finishes, the remainder goes out as the last
chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from omnistage.pipeline.stage_engine import GenerationStageEngine


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


class Talker2Code2Wav:
    def __init__(
        self,
        code2wav: GenerationStageEngine,
        first_chunk_frames: int,
        chunk_frames: int,
        left_context_frames: int,
    ) -> None:
        self.code2wav = code2wav
        self.first_chunk_frames = first_chunk_frames
        self.chunk_frames = chunk_frames
        self.left_context_frames = left_context_frames
        self._states: dict[str, _FrameState] = {}

    def on_request(self, req_id: str) -> None:
        self._states[req_id] = _FrameState()
        self.code2wav.add_request(req_id)

    def _emit(self, req_id: str, st: _FrameState, n: int, finished: bool) -> None:
        start = st.emitted
        ctx = min(self.left_context_frames, start)
        lo = start - ctx - st.offset
        frames = st.frames[lo : start - st.offset + n]
        codes = torch.stack(frames, dim=1)  # [Q, ctx + n]
        self.code2wav.add_input(req_id, Code2WavChunk(codes, ctx, start), finished)
        st.emitted += n
        # Keep only what the next chunk can still use as context.
        keep_from = max(0, st.emitted - self.left_context_frames) - st.offset
        if keep_from > 0:
            del st.frames[:keep_from]
            st.offset += keep_from

    def on_upstream_output(self, req_id: str, payload: dict) -> None:
        st = self._states.get(req_id)
        if st is None:
            return  # aborted meanwhile
        st.frames.extend(payload["frames"].unbind(0))
        while True:
            size = self.first_chunk_frames if st.emitted == 0 else self.chunk_frames
            available = st.offset + len(st.frames) - st.emitted
            if available < size:
                break
            self._emit(req_id, st, size, finished=False)

    def on_upstream_finished(self, req_id: str) -> None:
        st = self._states.pop(req_id, None)
        if st is None:
            return
        remaining = st.offset + len(st.frames) - st.emitted
        if remaining > 0:
            self._emit(req_id, st, remaining, finished=True)
        else:
            self.code2wav.add_input(req_id, None, finished=True)

    def abort(self, req_id: str) -> None:
        self._states.pop(req_id, None)

    @property
    def num_pending(self) -> int:
        return len(self._states)
