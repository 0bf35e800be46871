"""Types passed between the runner and a stage model: this step's view, model output, step result."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from omnistage.attention.backend import AttentionMetadata
from omnistage.core.request import Request
from omnistage.core.sched_output import Phase
from omnistage.runner.sampler import SamplingRow


@dataclass
class OmniOutput:
    """What a stage model's forward returns. Not the client response (DESIGN §1.5).

    ``text_hidden_states`` feed logits/sampling; ``multimodal_outputs`` feed the next stage. Row-aligned
    tensors share the step's token axis (possibly padded: the real row count decides what is read).
    """

    text_hidden_states: torch.Tensor | None
    multimodal_outputs: dict[str, Any] = field(default_factory=dict)
    intermediate: dict[str, Any] = field(default_factory=dict)


@dataclass
class StepContext:
    """This step's view (DESIGN §1.2): members, order, spans, phases — valid for one step only."""

    req_ids: list[str]  # batch order of the scheduled requests
    requests: list[Request]
    spans: dict[str, tuple[int, int]]  # req_id -> [start, end) rows
    phases: dict[str, Phase]
    states: list[Mapping[str, Any]]  # intermediate-buffer entries gathered in batch order
    sampling_rows: list[SamplingRow]  # one per request in batch order (params + its own generator)
    num_tokens_unpadded: int
    num_tokens_padded: int
    sample_req_ids: list[str]  # requests sampled this step, in batch order (= logits rows)
    attn_meta: AttentionMetadata | None = None

    def index(self, req_id: str) -> int:
        return self.req_ids.index(req_id)


@dataclass
class StepResult:
    """Per-request results of one step, built on two separate paths (client vs next stage)."""

    sampled: dict[str, list[int]]
    client_outputs: dict[str, dict[str, Any]]
    stage_outputs: dict[str, dict[str, Any]]


class ARStageModel(Protocol):
    """What an AR stage model provides to the AR runner."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    # Optional attributes: supports_full_graph_aux_outputs (v2 capture), penalty_includes_prompt (default
    # True: the repetition penalty sees prompt + output ids).

    def prepare_inputs(
        self, ctx: StepContext, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[dict[str, Any], list[Mapping[str, Any] | None]]:
        """Preprocess: model kwargs for this step + per-request state updates (batch order)."""

    def forward(self, kv_caches: list[torch.Tensor], attn_meta: AttentionMetadata, **kwargs: Any) -> OmniOutput: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def postprocess(
        self, ctx: StepContext, output: OmniOutput, sampled: dict[str, int]
    ) -> list[Mapping[str, Any] | None]:
        """State to keep for the next step, per request in batch order (e.g. last hidden)."""

    def stage_outputs(self, ctx: StepContext, output: OmniOutput) -> dict[str, dict[str, Any]]:
        """Per-request payloads for the next stage, sliced by the real spans."""
