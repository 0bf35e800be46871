"""The GENERATION runner (Code2Wav): one batched model call over the step's requests, no logits, no sampler.

It still keeps the contract of every runner: the step's row order comes from the scheduler output, every
output row goes back to the request in that row, and results are read on the host only after the batch
copy has been waited on.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from omnistage.core.generation_scheduler import GenerationSchedulerOutput
from omnistage.runner.host_copy import HostCopyBatch
from omnistage.runner.outputs import OmniOutput


class GenerationStageModel(Protocol):
    sample_rate: int

    def forward_batch(self, payloads: list[Any]) -> OmniOutput:
        """multimodal_outputs: ``audio`` [B, S] (row b = payloads[b], zero-padded), ``audio_lengths`` [B]."""


class GenerationRunner:
    def __init__(self, model: GenerationStageModel) -> None:
        self.model = model

    def execute(self, so: GenerationSchedulerOutput) -> dict[str, dict[str, Any]]:
        order = list(so.req_ids)
        with torch.inference_mode():
            out = self.model.forward_batch([so.payloads[r] for r in order])
        audio = out.multimodal_outputs["audio"]
        lengths = out.multimodal_outputs["audio_lengths"]
        if audio.shape[0] != len(order) or lengths.shape[0] != len(order):
            raise RuntimeError(f"model returned {audio.shape[0]} rows for {len(order)} requests")
        copies = HostCopyBatch()
        audio_h, lengths_h = copies.copy(audio.float()), copies.copy(lengths)
        copies.wait()
        host, lens = audio_h.value, lengths_h.value.tolist()
        # Each request owns its samples (a clone), not a view that would pin the whole batch tensor.
        return {
            r: {"audio": host[i, : lens[i]].clone(), "sample_rate": self.model.sample_rate}
            for i, r in enumerate(order)
        }
