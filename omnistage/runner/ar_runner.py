"""The eager AR runner: scheduler output -> one batched model call -> per-request results.

One step is ``execute_model`` then ``sample_tokens``, strictly paired (DESIGN §1.4). The runner keeps its
per-request records (``RequestState``: request, random stream, model state) apart from this step's view
(order, spans, phases), which is rebuilt from the scheduler output every step.

A step is atomic for the records: the model's state updates (from ``prepare_inputs`` and
``postprocess``) are committed only when ``sample_tokens`` completes, so a step that fails before then
(``cancel_step``) leaves every record as it was and can simply be scheduled again.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from omnistage.attention.backend import allocate_kv_cache, build_attention_metadata
from omnistage.core.request import Request
from omnistage.core.sched_output import SchedulerOutput
from omnistage.runner.input_batch import InputBatch, pad_to_bucket, request_token_spans
from omnistage.runner.outputs import ARStageModel, OmniOutput, StepContext, StepResult
from omnistage.runner.request_state import RequestState, frozen_view, merge_nested
from omnistage.runner.sampler import SamplingRow, make_generator, sample


class StepOrderError(RuntimeError):
    """execute_model / sample_tokens called out of order."""


class ARRunner:
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
        self.records: dict[str, RequestState] = {}
        self.batch = InputBatch()
        # (context, output, scheduler output, staged state per req_id) of the step awaiting sample_tokens
        self._pending: tuple[StepContext, OmniOutput, SchedulerOutput, dict[str, dict[str, Any]]] | None = None

    # ---- per-request records -----------------------------------------------------------------------
    def add_request(self, request: Request, state: Mapping[str, Any] | None = None) -> None:
        """Create the request's record (its random stream starts here, seeded by its sampling params)."""
        if request.req_id in self.records:
            raise ValueError(f"request {request.req_id!r} already has a runner record")
        generator = make_generator(request.sampling_params.seed, self.device)
        self.records[request.req_id] = RequestState(request.req_id, request, generator, merge_nested({}, state or {}))

    def update_state(self, req_id: str, update: Mapping[str, Any]) -> None:
        """Merge upstream-derived state into a request's model state (e.g. the Talker's prefill rows)."""
        self.records[req_id].merge(update)

    def state(self, req_id: str) -> Mapping[str, Any]:
        return self.records[req_id].view()

    def free(self, req_id: str) -> bool:
        """Drop the request's record and batch slot (finished or aborted). False if it had none."""
        self.batch.remove(req_id)
        return self.records.pop(req_id, None) is not None

    def cancel_step(self) -> None:
        """Forget the step in flight (it failed): records are untouched, the batch keeps its members."""
        self._pending = None

    def _sampling_row(self, record: RequestState) -> SamplingRow:
        req = record.request
        params = req.sampling_params
        banned: tuple[int, ...] = ()
        if req.num_output_tokens < params.min_tokens:
            banned = tuple(params.stop_token_ids) + (() if params.ignore_eos else tuple(req.eos_token_ids))
        # Whose tokens the repetition penalty sees is a model property: the Thinker's prompt is text like
        # its output, the Talker's prompt ids are Thinker ids that mean nothing in the codec vocabulary.
        history = req.all_token_ids if getattr(self.model, "penalty_includes_prompt", True) else req.output_token_ids
        return SamplingRow(params, record.generator, history, banned, output=req.output_token_ids)

    def _prepare_step(self, so: SchedulerOutput) -> tuple[list[str], dict[str, tuple[int, int]]]:
        """Batch membership for this step: preempted requests leave, scheduled ones join. (row order, spans)"""
        if self._pending is not None:
            raise StepOrderError("execute_model called again before sample_tokens consumed the previous step")
        leaked = so.finished_req_ids & self.records.keys()
        if leaked:
            raise RuntimeError(f"finished requests still hold runner records: {sorted(leaked)}")
        for req_id in so.preempted_req_ids:
            self.batch.remove(req_id)  # the record (random stream, model state) lives on
        unknown = [r for r in so.num_scheduled_tokens if r not in self.records]
        if unknown:
            raise KeyError(f"scheduled requests without a runner record: {unknown}")
        order = self.batch.scheduled_order(so.num_scheduled_tokens)
        if not order:
            raise ValueError("scheduler output schedules no tokens")
        return order, request_token_spans(order, so.num_scheduled_tokens)

    def _make_context(self, so: SchedulerOutput, order: list[str], spans: dict[str, tuple[int, int]],
                      num_tokens: int, padded: int, meta) -> StepContext:
        """This step's view: everything row- or order-related is rebuilt here, never carried over."""
        records = [self.records[r] for r in order]
        return StepContext(
            req_ids=order,
            requests=[rec.request for rec in records],
            spans=spans,
            phases={r: so.phases[r] for r in order},
            num_computed=[so.num_computed_tokens[r] for r in order],
            states=[rec.view() for rec in records],
            sampling_rows=[self._sampling_row(rec) for rec in records],
            num_tokens_unpadded=num_tokens,
            num_tokens_padded=padded,
            sample_req_ids=[r for r in order if r in so.sample_req_ids],
            attn_meta=meta,
            num_cached=[so.num_cached_tokens.get(r, 0) for r in order] if so.num_cached_tokens else [],
        )

    def _stage_updates(self, ctx: StepContext, updates: list[Mapping[str, Any] | None]) -> dict[str, dict[str, Any]]:
        """Merge the model's prepare-time updates into copies of the records' state (committed later) and
        give the model read-only views of the result for the rest of the step."""
        staged: dict[str, dict[str, Any]] = {}
        for i, (req_id, update) in enumerate(zip(ctx.req_ids, self._hand_over(updates), strict=True)):
            if update:
                staged[req_id] = merge_nested(self.records[req_id].model_state, update)
                ctx.states[i] = frozen_view(staged[req_id])
        return staged

    # ---- one step ----------------------------------------------------------------------------------
    def execute_model(self, so: SchedulerOutput) -> None:
        order, spans = self._prepare_step(so)
        ids: list[int] = []
        query_lens, context_lens, tables = [], [], []
        for req_id in order:
            n = so.num_scheduled_tokens[req_id]
            start = so.num_computed_tokens[req_id]
            token_ids = self.records[req_id].request.all_token_ids[start : start + n]
            if len(token_ids) != n:
                raise ValueError(f"request {req_id!r}: {n} tokens scheduled but only {len(token_ids)} known")
            ids.extend(token_ids)
            query_lens.append(n)
            context_lens.append(start)
            tables.append(so.block_tables[req_id])
        num_tokens = len(ids)
        padded = pad_to_bucket(num_tokens, self.pad_buckets)
        input_ids = torch.zeros(padded, dtype=torch.long)
        input_ids[:num_tokens] = torch.tensor(ids, dtype=torch.long)
        positions = torch.zeros(padded, dtype=torch.long)
        positions[:num_tokens] = torch.cat([torch.arange(c, c + q) for c, q in zip(context_lens, query_lens)])
        meta = build_attention_metadata(
            query_lens, context_lens, tables, self.block_size, self.num_blocks, padded, self.device
        )
        ctx = self._make_context(so, order, spans, num_tokens, padded, meta)
        kwargs, updates = self.model.prepare_inputs(ctx, input_ids.to(self.device), positions.to(self.device))
        staged = self._stage_updates(ctx, updates)
        output = self.model.forward(self.kv_caches, meta, **kwargs)
        self._pending = (ctx, output, so, staged)

    def sample_tokens(self) -> StepResult:
        if self._pending is None:
            raise StepOrderError("sample_tokens called without a preceding execute_model")
        ctx, output, so, staged = self._pending
        self._pending = None
        sampled: dict[str, int] = {}
        if ctx.sample_req_ids:
            rows = torch.tensor([ctx.spans[r][1] - 1 for r in ctx.sample_req_ids], device=self.device)
            if output.logits is not None:  # (the forward's own, for every row)
                logits = output.logits[rows]
            else:
                logits = self.model.compute_logits(output.hidden_states[rows])
            sampling_rows = [ctx.sampling_rows[ctx.index(r)] for r in ctx.sample_req_ids]
            tokens = sample(logits, sampling_rows).tolist()
            sampled = dict(zip(ctx.sample_req_ids, tokens))
        # The hooks get this step's live context; what they return may outlive the step, so hand it over.
        post = self._hand_over(self.model.postprocess(ctx, output, sampled))
        stage_outputs = self._hand_over(self.model.stage_outputs(ctx, output, sampled))
        client_hook = getattr(self.model, "client_outputs", None)
        client = self._hand_over(client_hook(ctx, output, sampled)) if client_hook is not None else {}
        # Commit: prepare-time updates, then postprocess updates (nothing above changed a record).
        for req_id, update in zip(ctx.req_ids, post, strict=True):
            record = self.records[req_id]
            if req_id in staged:
                record.model_state = staged[req_id]
            record.merge(update)
        return StepResult(sampled={r: [t] for r, t in sampled.items()}, client_outputs=client,
                          stage_outputs=stage_outputs)

    def _hand_over(self, products: Any) -> Any:
        """Make hook products safe to keep past this step. Eager outputs are fresh tensors: nothing to do;
        the CUDA-graph runner overrides this to snapshot anything aliasing its persistent buffers."""
        return products
