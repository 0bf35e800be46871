"""The AR runner (v1, eager): scheduler output -> one batched model call -> per-request results.

One step is ``execute_model`` then ``sample_tokens``, strictly paired (DESIGN §1.4). The runner keeps three
things apart: its per-request records (``CachedRequestState``) and the intermediate buffer (both keyed by
``req_id``), and this step's view (order, spans, phases), rebuilt from scratch every step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from omnistage.attention.backend import allocate_kv_cache, build_attention_metadata
from omnistage.core.sched_output import SchedulerOutput
from omnistage.runner.input_batch import CachedRequestState, InputBatch, pad_to_bucket, request_token_spans
from omnistage.runner.intermediate_buffer import IntermediateBuffer
from omnistage.runner.outputs import ARStageModel, OmniOutput, StepContext, StepResult
from omnistage.runner.sampler import SamplingRow, make_generator, sample


class StepOrderError(RuntimeError):
    """execute_model / sample_tokens called out of order."""


class ARModelRunner:
    def __init__(
        self,
        model: ARStageModel,
        *,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        pad_buckets: tuple[int, ...] | None = None,
    ) -> None:
        self.model = model
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = torch.device(device)
        self.pad_buckets = pad_buckets
        self.kv_caches = allocate_kv_cache(
            model.num_layers, num_blocks, block_size, model.num_kv_heads, model.head_dim, dtype, device
        )
        self.requests: dict[str, CachedRequestState] = {}
        self.batch = InputBatch()
        self.buffer = IntermediateBuffer()
        self._pending: tuple[StepContext, OmniOutput, SchedulerOutput] | None = None

    # ---- per-request state -------------------------------------------------------------------------
    def free(self, req_id: str) -> None:
        """Drop everything the runner holds for a request (finished or aborted)."""
        self.requests.pop(req_id, None)
        self.batch.remove(req_id)
        self.buffer.pop(req_id)

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            state = self.requests.pop(req_id, None)
            self.batch.remove(req_id)
            # A preempted request lives on (it will be recomputed): only a finished one loses its buffer.
            if state is None or state.request.status.is_finished:
                self.buffer.pop(req_id)
        for new in so.new_reqs:
            req = new.request
            old = self.requests.get(req.req_id)
            generator = old.generator if old else make_generator(req.sampling_params.seed, self.device)
            if old is not None:
                self.batch.remove(req.req_id)
            self.requests[req.req_id] = CachedRequestState(
                req.req_id, req, list(new.block_ids), new.num_computed_tokens, generator
            )
            self.batch.add(req.req_id)
        for cached in so.cached_reqs:
            state = self.requests[cached.req_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _sampling_row(self, state: CachedRequestState) -> SamplingRow:
        req = state.request
        params = req.sampling_params
        banned: tuple[int, ...] = ()
        if req.num_output_tokens < params.min_tokens:
            banned = tuple(params.stop_token_ids) + (() if params.ignore_eos else tuple(req.eos_token_ids))
        # Whose tokens the repetition penalty sees is a model property: the Thinker's prompt is text like
        # its output, the Talker's prompt ids are Thinker ids that mean nothing in the codec vocabulary.
        history = req.all_token_ids if getattr(self.model, "penalty_includes_prompt", True) else req.output_token_ids
        return SamplingRow(params, state.generator, history, banned)

    def _make_context(self, so: SchedulerOutput, order: list[str], spans: dict[str, tuple[int, int]],
                      num_tokens: int, padded: int, meta) -> StepContext:
        """This step's view: everything row- or order-related is rebuilt here, never carried over."""
        states = [self.requests[r] for r in order]
        return StepContext(
            req_ids=order,
            requests=[st.request for st in states],
            spans=spans,
            phases={r: so.phases[r] for r in order},
            states=self.buffer.gather(order),
            sampling_rows=[self._sampling_row(st) for st in states],
            num_tokens_unpadded=num_tokens,
            num_tokens_padded=padded,
            sample_req_ids=[r for r in order if r in so.sample_req_ids],
            attn_meta=meta,
        )

    # ---- one step ----------------------------------------------------------------------------------
    def execute_model(self, so: SchedulerOutput) -> None:
        if self._pending is not None:
            raise StepOrderError("execute_model called again before sample_tokens consumed the previous step")
        self._update_states(so)
        order = self.batch.scheduled_order(so.num_scheduled_tokens)
        if not order:
            raise ValueError("scheduler output schedules no tokens")
        spans = request_token_spans(order, so.num_scheduled_tokens)
        states = [self.requests[r] for r in order]

        ids: list[int] = []
        query_lens, context_lens, tables = [], [], []
        for st in states:
            n = so.num_scheduled_tokens[st.req_id]
            start = st.num_computed_tokens
            token_ids = st.request.all_token_ids[start : start + n]
            if len(token_ids) != n:
                raise ValueError(f"request {st.req_id!r}: {n} tokens scheduled but only {len(token_ids)} known")
            ids.extend(token_ids)
            query_lens.append(n)
            context_lens.append(start)
            tables.append(st.block_ids)
        num_tokens = len(ids)
        padded = pad_to_bucket(num_tokens, self.pad_buckets)
        input_ids = torch.zeros(padded, dtype=torch.long)
        input_ids[:num_tokens] = torch.tensor(ids, dtype=torch.long)
        positions = torch.zeros(padded, dtype=torch.long)
        positions[:num_tokens] = torch.cat(
            [torch.arange(c, c + q) for c, q in zip(context_lens, query_lens)]
        )
        meta = build_attention_metadata(
            query_lens, context_lens, tables, self.block_size, self.num_blocks, padded, self.device
        )
        ctx = self._make_context(so, order, spans, num_tokens, padded, meta)
        kwargs, updates = self.model.prepare_inputs(ctx, input_ids.to(self.device), positions.to(self.device))
        self.buffer.scatter(order, updates)
        ctx.states = self.buffer.gather(order)
        output = self.model.forward(self.kv_caches, meta, **kwargs)
        self._pending = (ctx, output, so)

    def sample_tokens(self) -> StepResult:
        if self._pending is None:
            raise StepOrderError("sample_tokens called without a preceding execute_model")
        ctx, output, so = self._pending
        self._pending = None
        sampled: dict[str, int] = {}
        if ctx.sample_req_ids:
            rows = torch.tensor([ctx.spans[r][1] - 1 for r in ctx.sample_req_ids], device=self.device)
            logits = self.model.compute_logits(output.text_hidden_states[rows])
            sampling_rows = [ctx.sampling_rows[ctx.index(r)] for r in ctx.sample_req_ids]
            tokens = sample(logits, sampling_rows).tolist()
            sampled = dict(zip(ctx.sample_req_ids, tokens))
        # The hooks get this step's live context; what they return may outlive the step, so hand it over.
        self.buffer.scatter(ctx.req_ids, self._hand_over(self.model.postprocess(ctx, output, sampled)))
        for r in ctx.req_ids:
            self.requests[r].num_computed_tokens += so.num_scheduled_tokens[r]
        client: dict[str, dict[str, Any]] = {r: {"token_ids": [t]} for r, t in sampled.items()}
        return StepResult(
            sampled={r: [t] for r, t in sampled.items()},
            client_outputs=client,
            stage_outputs=self._hand_over(self.model.stage_outputs(ctx, output)),
        )

    def _hand_over(self, products: Any) -> Any:
        """Make hook products safe to keep past this step. Eager outputs are fresh tensors: nothing to do;
        the graph runner overrides this to snapshot anything aliasing its persistent buffers."""
        return products

    def state_of(self, req_id: str) -> Mapping[str, Any]:
        return self.buffer.get(req_id)
