"""Types passed between the runner and a stage model: this step's view, model output, step result, and the
protocols a stage model implements."""

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

    ``hidden_states`` feed logits/sampling (the Thinker's text states, the Talker's codec states);
    ``multimodal_outputs`` feed the next stage. Row-aligned tensors share the step's token axis (possibly
    padded: the real row count decides what is read).
    """

    hidden_states: torch.Tensor | None
    multimodal_outputs: dict[str, Any] = field(default_factory=dict)
    intermediate: dict[str, Any] = field(default_factory=dict)
    # Every row's logits where the forward computed them itself (a decode step's layers and output head in one
    # kernel call), row-aligned with hidden_states and equal to compute_logits of them: the runner samples from
    # these rows instead of calling compute_logits. None: it calls compute_logits.
    logits: torch.Tensor | None = None


@dataclass
class StepContext:
    """This step's view (DESIGN §1.2): members, order, spans, phases — valid for one step only."""

    req_ids: list[str]  # batch order of the scheduled requests
    requests: list[Request]
    spans: dict[str, tuple[int, int]]  # req_id -> [start, end) rows
    phases: dict[str, Phase]
    # Tokens already in each request's KV cache: the position of its span's first row (batch order).
    num_computed: list[int]
    states: list[Mapping[str, Any]]  # per-request model state in batch order (read-only views)
    sampling_rows: list[SamplingRow]  # one per request in batch order (params + its own generator)
    num_tokens_unpadded: int
    num_tokens_padded: int
    sample_req_ids: list[str]  # requests sampled this step, in batch order (= logits rows)
    attn_meta: AttentionMetadata | None = None
    # Per request in batch order: leading tokens taken from the prefix cache at its admission this step
    # (rows [0, num_cached) are in its KV but the model never saw them for this request); empty = none.
    num_cached: list[int] = field(default_factory=list)

    def index(self, req_id: str) -> int:
        return self.req_ids.index(req_id)


@dataclass
class StepResult:
    """Per-request results of one step, built on two separate paths (client vs next stage)."""

    sampled: dict[str, list[int]]
    client_outputs: dict[str, dict[str, Any]]  # model-specific client outputs (e.g. codec frames)
    stage_outputs: dict[str, dict[str, Any]]


class ARStageModel(Protocol):
    """What an AR stage model provides to the AR runner.

    Optional attributes/methods: ``supports_full_graph_aux_outputs`` (CUDA-graph capture),
    ``penalty_includes_prompt`` (default True: the repetition penalty sees prompt + output ids),
    ``emits_token_ids`` (default True: sampled ids go to the client as text tokens),
    ``client_outputs(ctx, output, sampled)`` (extra per-request client outputs),
    ``input_ready(state, request)`` (default True: False pauses the request, keeping its KV, until more
    upstream input arrives), ``resource_stats()`` (counts of what the model holds per request, e.g. cached
    encoder outputs; merged into the stage's stats). The stage builder keeps prefix caching on for a stage
    only when its model provides ``block_extra_key(state, request, start, end) -> bytes | None`` (everything besides token ids
    that decides the KV of rows [start, end); None: those rows cannot be cached) and optionally
    ``cache_hit_limit(state, request) -> int | None`` (at most that many leading rows may come from the cache).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int

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

    def stage_outputs(
        self, ctx: StepContext, output: OmniOutput, sampled: dict[str, int]
    ) -> dict[str, dict[str, Any]]:
        """Per-request payloads for the next stage, sliced by the real spans (``sampled``: this step's
        tokens, for a stage whose samples are what the next stage consumes)."""


class GenerationStageModel(Protocol):
    """What a generation stage model (e.g. a vocoder) provides to the generation runner."""

    def forward_batch(
        self, payloads: list[Any], states: list[Mapping[str, Any]]
    ) -> tuple[dict[str, torch.Tensor], list[Mapping[str, Any] | None]]:
        """One batched call. Returns (outputs, state updates in batch order).

        outputs: ``audio`` [B, S] (row b = payloads[b], zero-padded) and ``audio_lengths`` [B]."""
