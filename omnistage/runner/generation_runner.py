"""The generation runner (e.g. Code2Wav): one batched model call over the step's requests, no logits, no
sampler.

It keeps the contract of every runner: the step's row order comes from the scheduler output, every output
row goes back to the request in that row, and results are read on the host only after the batch copy has
been waited on. Per-request model state (e.g. a streaming decoder's carried activations) lives in one
record per request, created when the stage admits it and freed once; a step's state updates are committed
only after the whole step succeeded, so a failed step can run again unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

from omnistage.core.generation_scheduler import GenerationSchedulerOutput
from omnistage.runner.host_copy import HostCopyBatch
from omnistage.runner.outputs import GenerationStageModel
from omnistage.runner.request_state import merge_nested


class GenerationRunner:
    def __init__(self, model: GenerationStageModel) -> None:
        self.model = model
        self.records: dict[str, dict[str, Any]] = {}  # req_id -> model state

    def add_request(self, req_id: str) -> None:
        if req_id in self.records:
            raise ValueError(f"request {req_id!r} already has a runner record")
        self.records[req_id] = {}

    def free(self, req_id: str) -> bool:
        return self.records.pop(req_id, None) is not None

    def execute(self, so: GenerationSchedulerOutput) -> dict[str, dict[str, Any]]:
        order = list(so.req_ids)
        missing = [r for r in order if r not in self.records]
        if missing:
            raise KeyError(f"scheduled requests without a runner record: {missing}")
        with torch.inference_mode():
            out, updates = self.model.forward_batch([so.payloads[r] for r in order],
                                                    [self.records[r] for r in order])
        audio, lengths = out["audio"], out["audio_lengths"]
        if audio.shape[0] != len(order) or lengths.shape[0] != len(order) or len(updates) != len(order):
            raise RuntimeError(f"model returned {audio.shape[0]} rows for {len(order)} requests")
        copies = HostCopyBatch()
        audio_h, lengths_h = copies.copy(audio.float()), copies.copy(lengths)
        copies.wait()
        host, lens = audio_h.value, lengths_h.value.tolist()
        for r, update in zip(order, updates):
            if update:
                self.records[r] = merge_nested(self.records[r], update)
        # Each request owns its samples (a clone), not a view that would pin the whole batch tensor.
        return {r: {"audio": host[i, : lens[i]].clone()} for i, r in enumerate(order)}
