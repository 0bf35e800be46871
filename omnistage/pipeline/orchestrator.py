"""Routes requests through the stages, streams per-request deltas, and aborts across every stage.

The stages a request visits follow from its modalities: text only -> the Thinker alone; text+audio ->
Thinker, Talker and Code2Wav, all running at once (the Talker waits for the Thinker's first answer
token, Code2Wav for the first chunk of frames). Inter-stage payloads travel through the connector,
end-of-stream markers included, so a request's data and its "finished" arrive in order.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from omnistage.core.request import Request
from omnistage.core.sampling_params import SamplingParams
from omnistage.pipeline.connector import InProcConnector
from omnistage.pipeline.stage_engine import ARStageEngine, GenerationStageEngine, StageEvents
from omnistage.pipeline.talker2code2wav import Talker2Code2Wav
from omnistage.pipeline.thinker2talker import Thinker2Talker

_END = "__end__"  # connector payload marking the end of an upstream stream


@dataclass
class RequestDelta:
    """What one request gained in one engine step (streamed to the client)."""

    req_id: str
    new_token_ids: list[int] = field(default_factory=list)
    audio: torch.Tensor | None = None  # float32 mono samples of one chunk
    codes: torch.Tensor | None = None  # [Q, k] new codec frames
    finished: bool = False
    finish_reason: str | None = None


@dataclass
class _Tracked:
    req_id: str
    wants_audio: bool
    pending_stages: set[str]
    arrival: float = field(default_factory=time.monotonic)
    finish_reason: str | None = None
    first_token_time: float | None = None
    first_audio_time: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    audio_samples: int = 0


@dataclass
class StageNames:
    thinker: str = "thinker"
    talker: str = "talker"
    code2wav: str = "code2wav"


class Orchestrator:
    def __init__(
        self,
        thinker: ARStageEngine,
        talker: ARStageEngine | None,
        code2wav: GenerationStageEngine | None,
        thinker2talker: Thinker2Talker | None,
        talker2code2wav: Talker2Code2Wav | None,
        eos_token_ids: tuple[int, ...],
        sink: Callable[[RequestDelta], None],
        on_step: Callable[[StageEvents], None] | None = None,
        on_finish: Callable[[_Tracked], None] | None = None,
    ) -> None:
        self.thinker = thinker
        self.talker = talker
        self.code2wav = code2wav
        self.t2t = thinker2talker
        self.t2c = talker2code2wav
        self.eos_token_ids = eos_token_ids
        self.sink = sink
        self.on_step = on_step
        self.on_finish = on_finish
        self.connector = InProcConnector()
        self.requests: dict[str, _Tracked] = {}
        self.names = StageNames(thinker.name, talker.name if talker else "talker",
                                code2wav.name if code2wav else "code2wav")

    @property
    def supports_audio(self) -> bool:
        return self.talker is not None and self.code2wav is not None

    # ---- requests ----------------------------------------------------------------------------------
    def add_request(
        self,
        req_id: str,
        prompt_ids: list[int],
        modalities: tuple[str, ...],
        thinker_params: SamplingParams,
        talker_params: SamplingParams | None = None,
        speaker_id: int | None = None,
        talker_rows: torch.Tensor | None = None,
    ) -> None:
        if req_id in self.requests:
            raise ValueError(f"request id {req_id!r} is already in flight")
        wants_audio = "audio" in modalities
        if wants_audio and not self.supports_audio:
            raise ValueError("this pipeline has no audio stages; request modalities ['text'] only")
        extra = {"talker_rows": talker_rows} if wants_audio else {}
        req = Request(req_id, prompt_ids, thinker_params, eos_token_ids=self.eos_token_ids, extra=extra)
        self.thinker.add_request(req)  # validates length etc. before anything else is registered
        stages = {self.names.thinker}
        if wants_audio:
            assert self.t2t is not None and self.t2c is not None and talker_params is not None
            self.t2t.on_request(req_id, prompt_ids, talker_params, speaker_id)
            self.t2c.on_request(req_id)
            stages |= {self.names.talker, self.names.code2wav}
        self.requests[req_id] = _Tracked(req_id, wants_audio, stages, num_prompt_tokens=len(prompt_ids))

    def abort(self, req_id: str) -> bool:
        """Cancel a request in every stage and free all it holds. False if it is not in flight."""
        tracked = self.requests.pop(req_id, None)
        if tracked is None:
            return False
        self.thinker.abort(req_id)
        if tracked.wants_audio:
            self.talker.abort(req_id)
            self.code2wav.abort(req_id)
            self.t2t.abort(req_id)
            self.t2c.abort(req_id)
        self.connector.drop(req_id)
        tracked.finish_reason = "abort"
        self.sink(RequestDelta(req_id, finished=True, finish_reason="abort"))
        return True

    def has_work(self) -> bool:
        stages = [self.thinker, self.talker, self.code2wav]
        return bool(self.requests) or any(s is not None and s.has_work() for s in stages)

    # ---- one engine step ---------------------------------------------------------------------------
    def step(self) -> None:
        """Step every stage that has work, upstream first, and route what each produced."""
        if self.thinker.has_work():
            self._handle_thinker(self._run(self.thinker))
        if self.talker is not None:
            self._deliver(self.names.talker, self.t2t)
            if self.talker.has_work():
                ev = self._run(self.talker)
                self._handle_talker(ev)
                self.t2t.after_talker_step(list(ev.client_outputs))
        if self.code2wav is not None:
            self._deliver(self.names.code2wav, self.t2c)
            if self.code2wav.has_work():
                self._handle_code2wav(self._run(self.code2wav))
            for req_id in self.code2wav.poll_finished():
                self._stage_done(req_id, self.names.code2wav, None)

    def _run(self, stage) -> StageEvents:
        ev = stage.step()
        if self.on_step is not None:
            self.on_step(ev)
        return ev

    def _deliver(self, dst: str, processor) -> None:
        for _src, req_id, payload in self.connector.take_all(dst):
            if payload == _END:
                processor.on_upstream_finished(req_id)
            else:
                processor.on_upstream_output(req_id, payload)

    def _handle_thinker(self, ev: StageEvents) -> None:
        now = time.monotonic()
        for req_id, out in ev.client_outputs.items():
            tracked = self.requests.get(req_id)
            if tracked is None:
                continue
            tokens = out["token_ids"]
            if ev.finished.get(req_id) == "stop" and tokens:
                tokens = tokens[:-1]  # the EOS / stop token that ended the answer is not part of its text
            if tracked.first_token_time is None:
                tracked.first_token_time = now
            tracked.num_output_tokens += len(out["token_ids"])
            self.sink(RequestDelta(req_id, new_token_ids=list(tokens)))
        for req_id, payload in ev.stage_outputs.items():
            tracked = self.requests.get(req_id)
            # A Talker that already stopped (codec_eos or its own limit) needs no more text.
            if tracked is not None and self.names.talker in tracked.pending_stages:
                self.connector.put(self.names.thinker, self.names.talker, req_id, payload)
        for req_id, reason in ev.finished.items():
            tracked = self.requests.get(req_id)
            if tracked is None:
                continue
            tracked.finish_reason = reason
            if self.names.talker in tracked.pending_stages:
                self.connector.put(self.names.thinker, self.names.talker, req_id, _END)
            self._stage_done(req_id, self.names.thinker, reason)

    def _handle_talker(self, ev: StageEvents) -> None:
        for req_id, payload in ev.stage_outputs.items():
            if req_id in self.requests and payload["frames"].shape[0] > 0:
                self.connector.put(self.names.talker, self.names.code2wav, req_id, payload)
                self.sink(RequestDelta(req_id, codes=payload["frames"].T))  # host tensors (talker stage_outputs)
        for req_id in ev.finished:
            if req_id in self.requests:
                self.t2t.on_talker_finished(req_id)
                self.connector.put(self.names.talker, self.names.code2wav, req_id, _END)
                self._stage_done(req_id, self.names.talker, None)

    def _handle_code2wav(self, ev: StageEvents) -> None:
        now = time.monotonic()
        for req_id, out in ev.client_outputs.items():
            tracked = self.requests.get(req_id)
            if tracked is None:
                continue
            if tracked.first_audio_time is None:
                tracked.first_audio_time = now
            tracked.audio_samples += int(out["audio"].numel())
            self.sink(RequestDelta(req_id, audio=out["audio"]))
        for req_id in ev.finished:
            self._stage_done(req_id, self.names.code2wav, None)

    def _stage_done(self, req_id: str, stage: str, reason: str | None) -> None:
        tracked = self.requests.get(req_id)
        if tracked is None:
            return
        tracked.pending_stages.discard(stage)
        if not tracked.pending_stages:
            del self.requests[req_id]
            if self.on_finish is not None:
                self.on_finish(tracked)
            self.sink(RequestDelta(req_id, finished=True, finish_reason=tracked.finish_reason))

    # ---- observability -----------------------------------------------------------------------------
    def resource_stats(self) -> dict[str, object]:
        stats: dict[str, object] = {"thinker": self.thinker.stats(), "connector_pending": self.connector.num_pending}
        if self.talker is not None:
            stats["talker"] = self.talker.stats()
            stats["code2wav"] = self.code2wav.stats()
            stats["thinker2talker_pending"] = self.t2t.num_pending
            stats["talker2code2wav_pending"] = self.t2c.num_pending
        stats["requests"] = len(self.requests)
        return stats
