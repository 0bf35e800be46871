"""The CUDA-graph AR runner (the seed's "v2"): decode steps over persistent static buffers, full-graph
captured per batch bucket.

What runs how:
- A decode-only step (every scheduled request decodes exactly one token) with at most
  ``max(decode_buckets)`` requests runs on the static path: this step's token ids, positions, block table
  and sequence lengths are copied into persistent buffers, padded up to the smallest bucket (padded rows
  get token 0, position 0, an all-scratch block table and length 0, so they write their K/V to the scratch
  slot and read only scratch), the model's row-aligned keyword tensors (e.g. ``inputs_embeds``) are copied
  into persistent buffers too, and the model runs on views of bucket size.
- If the model declares ``supports_full_graph_aux_outputs`` (and the config allows graphs), the forward on
  those views is captured once per bucket (a CUDA graph on CUDA, `EagerStepGraph` elsewhere) and replayed
  afterwards; its output is flattened (`flatten_output`, which enforces the aux contract: declared but
  invalid raises) and rebuilt after every replay. An undeclared model runs the static path eagerly and the
  runner logs that choice once.
- Every other step (prefill, chunked prefill, mixed, larger batches) runs the eager path.

The hooks that build per-request results (`postprocess`, `stage_outputs`) are called after the forward with
this step's live `StepContext`; the captured function only ever sees static buffers. Anything the runner
hands out beyond the step (stage outputs, intermediate-buffer updates) that aliases a persistent buffer or
a graph output is snapshotted; a tensor the model wraps in `OwnedBatchTensor` is handed over without a copy.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from omnistage.attention.backend import AttentionGroup, AttentionMetadata, scratch_slot
from omnistage.core.sched_output import Phase, SchedulerOutput
from omnistage.runner.ar_runner import ARRunner, StepOrderError
from omnistage.runner.aux_tree import AuxOutputError, AuxSpec
from omnistage.runner.cuda_graph import (
    GraphCaptureError,
    StepGraph,
    flatten_output,
    make_step_graph,
    rebuild_output,
)
from omnistage.runner.outputs import ARStageModel, OmniOutput
from omnistage.runner.ownership import OwnedBatchTensor, snapshot

logger = logging.getLogger("omnistage.runner")

DEFAULT_DECODE_BUCKETS = (1, 2, 4, 8, 16, 32)


class OwnershipError(RuntimeError):
    """A tensor marked as owned (`OwnedBatchTensor`) aliases a buffer the runner reuses."""


@dataclass(frozen=True)
class GraphRunnerConfig:
    """decode_buckets: batch sizes decode steps are padded to (one graph each).
    max_model_len: longest sequence a static decode step serves; sets the fixed KV gather width
    (rounded up to the block size). None = the whole KV pool.
    full_graph: capture declared models; False runs the static path eagerly for every model.
    """

    decode_buckets: tuple[int, ...] = DEFAULT_DECODE_BUCKETS
    max_model_len: int | None = None
    full_graph: bool = True

    def __post_init__(self) -> None:
        b = self.decode_buckets
        if not isinstance(b, tuple) or not b:
            raise ValueError(f"decode_buckets must be a non-empty tuple, got {b!r}")
        if any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in b):
            raise ValueError(f"decode_buckets must be positive ints, got {b!r}")
        if list(b) != sorted(set(b)):
            raise ValueError(f"decode_buckets must be strictly increasing, got {b!r}")
        m = self.max_model_len
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ValueError(f"max_model_len must be a positive int or None, got {m!r}")
        if not isinstance(self.full_graph, bool):
            raise ValueError(f"full_graph must be a bool, got {self.full_graph!r}")


@dataclass
class GraphRunnerStats:
    """Counters of what ran how (for tests and metrics)."""

    eager_steps: int = 0
    static_steps: int = 0
    captures: int = 0
    replays: int = 0


@dataclass(frozen=True)
class _InputLayout:
    """How a step's model kwargs map onto static buffers; a captured graph needs the same layout each step.

    entries: (name, kind, key) with kind "ids" / "positions" (the runner's own buffers), "static" (a
    persistent kwarg buffer, key = (name, dtype, trailing shape)) or "const" (key = the value itself).
    """

    entries: tuple[tuple[str, str, Any], ...]


@dataclass
class _SpecHolder:
    spec: AuxSpec | None = None


@dataclass
class _BucketGraph:
    graph: StepGraph
    layout: _InputLayout
    holder: _SpecHolder
    leaves: list[torch.Tensor] = field(default_factory=list)


def bucket_for(num_rows: int, buckets: tuple[int, ...]) -> int | None:
    """Smallest bucket >= num_rows, or None if the step is larger than every bucket."""
    for b in buckets:
        if b >= num_rows:
            return b
    return None


def decode_attention_metadata(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    positions: torch.Tensor,
    kv_block: torch.Tensor,
    kv_offset: torch.Tensor,
    rows: torch.Tensor,
    zeros: torch.Tensor,
    block_size: int,
    num_blocks: int,
) -> AttentionMetadata:
    """Decode-only metadata with fixed shapes, computed with tensor ops only (so it can live in a graph).

    Every row (padded ones included) is its own one-token request; the key axis is the fixed width
    ``W = kv_block.numel()``. block_table [B, W / block_size] (padded rows: the scratch block),
    seq_lens [B] (padded rows: 0), positions [B]; kv_block / kv_offset [W] = key position // and % block
    size; rows = arange(B), zeros [B]. Padded rows write K/V to the scratch slot and read only key 0.
    """
    scratch = scratch_slot(num_blocks, block_size)
    b = block_table.shape[0]
    slots = block_table[:, kv_block] * block_size + kv_offset  # [B, W]
    key_pos = kv_block * block_size + kv_offset
    valid = key_pos[None, :] < seq_lens[:, None]
    kv_slots = torch.where(valid, slots, torch.full_like(slots, scratch))
    mask = valid.clone()
    mask[:, 0] = True  # a padded row has no valid key; key 0 keeps its softmax finite (its output is unused)
    slot_mapping = block_table.gather(1, (positions // block_size)[:, None])[:, 0] * block_size
    slot_mapping = slot_mapping + positions % block_size
    group = AttentionGroup(
        token_rows=rows, token_req=rows, token_qpos=zeros, kv_slots=kv_slots, seq_lens=seq_lens,
        mask=mask[:, None, None, :], query_pos=positions[:, None], max_q=1,
    )
    return AttentionMetadata(
        num_reqs=b,
        num_tokens=b,
        num_padded_tokens=b,
        query_start_loc=torch.cat([rows, rows[-1:] + 1]),
        seq_lens=seq_lens,
        slot_mapping=slot_mapping,
        groups=[group],
    )


class CUDAGraphARRunner(ARRunner):
    def __init__(
        self,
        model: ARStageModel,
        *,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        pad_buckets: tuple[int, ...] | None = None,
        graph_config: GraphRunnerConfig | None = None,
    ) -> None:
        super().__init__(
            model, num_blocks=num_blocks, block_size=block_size, dtype=dtype, device=device, pad_buckets=pad_buckets
        )
        self.graph_config = graph_config or GraphRunnerConfig()
        self.stats = GraphRunnerStats()
        self.declares_full_graph = getattr(model, "supports_full_graph_aux_outputs", False) is True
        self.use_graphs = self.declares_full_graph and self.graph_config.full_graph
        max_len = self.graph_config.max_model_len or num_blocks * block_size
        self.max_blocks_per_req = min(math.ceil(max_len / block_size), num_blocks)
        self.kv_width = self.max_blocks_per_req * block_size
        rows = max(self.graph_config.decode_buckets)
        dev = self.device
        # Persistent inputs of the static path (sized for the largest bucket; a step uses a prefix view).
        self._ids = torch.zeros(rows, dtype=torch.long, device=dev)
        self._pos = torch.zeros(rows, dtype=torch.long, device=dev)
        self._seq_lens = torch.zeros(rows, dtype=torch.long, device=dev)
        self._block_table = torch.full((rows, self.max_blocks_per_req), num_blocks, dtype=torch.long, device=dev)
        key_pos = torch.arange(self.kv_width, device=dev)
        self._kv_block, self._kv_offset = key_pos // block_size, key_pos % block_size
        self._rows = torch.arange(rows, device=dev)
        self._zeros = torch.zeros(rows, dtype=torch.long, device=dev)
        self._kw_buffers: dict[tuple[str, torch.dtype, tuple[int, ...]], torch.Tensor] = {}
        self._graphs: dict[int, _BucketGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs and dev.type == "cuda" else None
        self._persistent: set[int] = set()
        for t in (*self.kv_caches, self._ids, self._pos, self._seq_lens, self._block_table):
            self._register(t)
        self._logged_mode = False

    # ---- bookkeeping -------------------------------------------------------------------------------
    @property
    def captured_buckets(self) -> list[int]:
        return sorted(self._graphs)

    def _register(self, t: torch.Tensor) -> None:
        if t.numel():
            self._persistent.add(t.untyped_storage().data_ptr())

    def _aliases_persistent(self, t: torch.Tensor) -> bool:
        return t.numel() > 0 and t.untyped_storage().data_ptr() in self._persistent

    def _hand_over(self, tree: Any) -> Any:
        """Make a result safe to keep past this step: copy what aliases reused storage, unwrap owned tensors."""
        if isinstance(tree, OwnedBatchTensor):
            if self._aliases_persistent(tree.tensor):
                raise OwnershipError("a tensor marked OwnedBatchTensor aliases a persistent/graph buffer")
            return tree.tensor
        if isinstance(tree, torch.Tensor):
            return snapshot(tree) if self._aliases_persistent(tree) else tree
        if isinstance(tree, Mapping):
            return {k: self._hand_over(v) for k, v in tree.items()}
        if type(tree) is list:
            return [self._hand_over(v) for v in tree]
        if type(tree) is tuple:
            return tuple(self._hand_over(v) for v in tree)
        return tree

    def _log_mode_once(self, output: OmniOutput | None, rows: int) -> None:
        if self._logged_mode:
            return
        self._logged_mode = True
        name = type(self.model).__name__
        if self.use_graphs:
            logger.info("%s: decode steps are full-graph captured per bucket %s", name, self.graph_config.decode_buckets)
        elif self.declares_full_graph:
            logger.info("%s: full-graph capture disabled by config; decode steps run eagerly on static buffers", name)
        else:
            try:
                flatten_output(output, rows)
                why = "declare it to enable capture"
            except AuxOutputError as exc:
                why = f"its output does not conform either: {exc}"
            logger.info(
                "%s does not declare supports_full_graph_aux_outputs: not full-graph captured, decode steps "
                "run eagerly on static buffers (%s)", name, why,
            )

    # ---- one step ----------------------------------------------------------------------------------
    def _is_static_step(self, so: SchedulerOutput) -> bool:
        counts = so.num_scheduled_tokens
        scheduled = [r for r, n in counts.items() if n > 0]
        return (
            0 < len(scheduled) <= self.graph_config.decode_buckets[-1]
            and all(counts[r] == 1 and so.phases.get(r) is Phase.DECODE for r in scheduled)
        )

    def execute_model(self, so: SchedulerOutput) -> None:
        if self._pending is not None:
            raise StepOrderError("execute_model called again before sample_tokens consumed the previous step")
        if not self._is_static_step(so):
            self.stats.eager_steps += 1
            super().execute_model(so)
            return
        self.stats.static_steps += 1
        self._execute_static(so)

    def _execute_static(self, so: SchedulerOutput) -> None:
        order, spans = self._prepare_step(so)
        n = len(order)
        b = bucket_for(n, self.graph_config.decode_buckets)
        assert b is not None  # guaranteed by _is_static_step
        ids, ctx_lens = [], []
        table = torch.full((b, self.max_blocks_per_req), self.num_blocks, dtype=torch.long)
        for i, req_id in enumerate(order):
            start = so.num_computed_tokens[req_id]
            tokens = self.records[req_id].request.all_token_ids
            if start >= len(tokens):
                raise ValueError(f"request {req_id!r}: 1 token scheduled but only {len(tokens) - start} known")
            if start + 1 > self.kv_width:
                raise ValueError(
                    f"request {req_id!r}: sequence length {start + 1} exceeds the runner's static KV width "
                    f"{self.kv_width} (GraphRunnerConfig.max_model_len must cover the scheduler's)"
                )
            ids.append(tokens[start])
            ctx_lens.append(start)
            blocks = so.block_tables[req_id][: self.max_blocks_per_req]
            table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.long)
        with torch.no_grad():
            _fill(self._ids, ids, b)
            _fill(self._pos, ctx_lens, b)
            _fill(self._seq_lens, [c + 1 for c in ctx_lens], b)
            self._block_table[:b].copy_(table)
        meta = self._decode_meta(b)
        ctx = self._make_context(so, order, spans, n, b, meta)
        kwargs, updates = self.model.prepare_inputs(ctx, self._ids[:b], self._pos[:b])
        staged = self._stage_updates(ctx, updates)
        layout, passthrough = self._bind_inputs(kwargs, b)
        if self.use_graphs:
            if passthrough:
                raise GraphCaptureError(
                    f"{type(self.model).__name__} declares supports_full_graph_aux_outputs but passes "
                    f"non-row-aligned tensors {sorted(passthrough)} to forward; a graph cannot refresh them"
                )
            output = self._run_graph(b, layout)
            self._log_mode_once(output, b)
            output = _real_rows(output, b, n, all_leaves=True)
        else:
            with torch.no_grad():
                output = self.model.forward(self.kv_caches, meta, **self._materialize(layout, b, passthrough))
            self._log_mode_once(output, b)
            output = _real_rows(output, b, n, all_leaves=False)
        self._pending = (ctx, output, so, staged)

    def _decode_meta(self, b: int) -> AttentionMetadata:
        return decode_attention_metadata(
            self._block_table[:b], self._seq_lens[:b], self._pos[:b], self._kv_block, self._kv_offset,
            self._rows[:b], self._zeros[:b], self.block_size, self.num_blocks,
        )

    def _bind_inputs(self, kwargs: Mapping[str, Any], b: int) -> tuple[_InputLayout, dict[str, Any]]:
        """Copy row-aligned kwarg tensors into persistent buffers; describe the result as a layout."""
        entries: list[tuple[str, str, Any]] = []
        passthrough: dict[str, Any] = {}
        for name in sorted(kwargs):
            value = kwargs[name]
            if isinstance(value, torch.Tensor):
                if _same_view(value, self._ids[:b]):
                    entries.append((name, "ids", None))
                elif _same_view(value, self._pos[:b]):
                    entries.append((name, "positions", None))
                elif value.dim() >= 1 and value.shape[0] == b:
                    key = (name, value.dtype, tuple(value.shape[1:]))
                    buf = self._kw_buffers.get(key)
                    if buf is None:
                        rows = self._ids.shape[0]
                        buf = torch.zeros((rows, *key[2]), dtype=value.dtype, device=self.device)
                        self._kw_buffers[key] = buf
                        self._register(buf)
                    with torch.no_grad():
                        buf[:b].copy_(value)
                    entries.append((name, "static", key))
                else:
                    passthrough[name] = value
            else:
                entries.append((name, "const", value))
        return _InputLayout(tuple(entries)), passthrough

    def _materialize(self, layout: _InputLayout, b: int, passthrough: Mapping[str, Any]) -> dict[str, Any]:
        kwargs: dict[str, Any] = dict(passthrough)
        for name, kind, key in layout.entries:
            if kind == "ids":
                kwargs[name] = self._ids[:b]
            elif kind == "positions":
                kwargs[name] = self._pos[:b]
            elif kind == "static":
                kwargs[name] = self._kw_buffers[key][:b]
            else:
                kwargs[name] = key
        return kwargs

    def _run_graph(self, b: int, layout: _InputLayout) -> OmniOutput:
        entry = self._graphs.get(b)
        if entry is None:
            holder = _SpecHolder()
            graph = make_step_graph(self.device, self._pool)
            leaves = graph.capture(self._graph_fn(b, layout, holder))
            entry = _BucketGraph(graph, layout, holder, leaves)
            self._graphs[b] = entry
            for leaf in leaves:
                self._register(leaf)
            self.stats.captures += 1
            logger.info("captured decode step for bucket %d (%d output leaves)", b, len(leaves))
        else:
            if layout != entry.layout:
                raise GraphCaptureError(
                    f"model inputs for bucket {b} changed since capture: {layout.entries} vs {entry.layout.entries}"
                )
            entry.graph.replay()
            self.stats.replays += 1
        assert entry.holder.spec is not None
        return rebuild_output(entry.leaves, entry.holder.spec)

    def _graph_fn(self, b: int, layout: _InputLayout, holder: _SpecHolder):
        """The captured step: a function of static buffers only (no step context, no request state)."""

        def step() -> list[torch.Tensor]:
            with torch.no_grad():
                out = self.model.forward(self.kv_caches, self._decode_meta(b), **self._materialize(layout, b, {}))
            leaves, spec = flatten_output(out, b, holder.spec)
            holder.spec = spec
            return leaves

        return step


def _fill(buf: torch.Tensor, values: list[int], b: int) -> None:
    n = len(values)
    buf[:n].copy_(torch.tensor(values, dtype=buf.dtype))
    buf[n:b].zero_()


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


def _trim(tree: Any, b: int, n: int) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree[:n] if tree.dim() >= 1 and tree.shape[0] == b else tree
    if isinstance(tree, dict):
        return {k: _trim(v, b, n) for k, v in tree.items()}
    if type(tree) is list:
        return [_trim(v, b, n) for v in tree]
    if type(tree) is tuple:
        return tuple(_trim(v, b, n) for v in tree)
    return tree


def _real_rows(output: OmniOutput, b: int, n: int, *, all_leaves: bool) -> OmniOutput:
    """Views of the real rows only, so hooks never read padding.

    Row-aligned leaves are only known for a declared (validated) output; otherwise only the hidden states
    are cut, and multimodal fields that are already unpadded stay as they are.
    """
    if b == n:
        return output
    hidden = output.hidden_states
    if isinstance(hidden, torch.Tensor) and hidden.dim() >= 1 and hidden.shape[0] == b:
        hidden = hidden[:n]
    if not all_leaves:
        return OmniOutput(hidden, output.multimodal_outputs, output.intermediate)
    return OmniOutput(hidden, _trim(output.multimodal_outputs, b, n), _trim(output.intermediate, b, n))
