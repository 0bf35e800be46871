"""The machine's measured peaks and a work model of each pipeline component, for achieved-vs-bound tables.

Peaks are measured here, at the benchmark's thread count: GEMM GFLOP/s (a large square matmul in the
serving dtype, best of several) and memory read GB/s (a sum over a buffer far larger than the caches, best
of several). A component's bound is max(flops / GEMM peak, bytes / read peak): the time it would take if it
only did its matmul work at full speed, or only streamed the weights and KV it must read at full bandwidth.
Work per call is estimated from the call's shapes and the model config (what a call must do, not what a
kernel happens to do), so the bound does not depend on how omnistage computes it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# work(args, kwargs, result) -> (flops, bytes) of one call (see stage_timers.StageTimers.attach)
WorkFn = Callable[[tuple, dict, Any], tuple[float, float]]


@dataclass(frozen=True)
class Peaks:
    gemm_gflops: float
    read_gbps: float

    def best(self, other: Peaks) -> Peaks:
        return Peaks(max(self.gemm_gflops, other.gemm_gflops), max(self.read_gbps, other.read_gbps))

    def bound_seconds(self, flops: float, bytes_: float) -> float:
        return max(flops / (self.gemm_gflops * 1e9), bytes_ / (self.read_gbps * 1e9))


def _best_seconds(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # first call: allocation, thread pool start
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_peaks(dtype: torch.dtype, repeats: int = 10, gemm_size: int = 2048, read_mib: int = 256) -> Peaks:
    """GEMM GFLOP/s in ``dtype`` and read GB/s, at the current ``torch.get_num_threads()``."""
    a = torch.randn(gemm_size, gemm_size).to(dtype)
    b = torch.randn(gemm_size, gemm_size).to(dtype)
    gemm = 2 * gemm_size**3 / _best_seconds(lambda: torch.mm(a, b), repeats) / 1e9
    buf = torch.ones(read_mib * 1024 * 1024 // 4)  # float32: the read rate does not depend on the dtype
    read = buf.numel() * 4 / _best_seconds(buf.sum, repeats) / 1e9
    return Peaks(gemm_gflops=gemm, read_gbps=read)


@dataclass(frozen=True)
class DecoderShape:
    """What a decoder stack costs: parameters read for any row, per expert, and attention geometry."""

    layers: int
    sparse_layers: int
    heads: int
    kv_heads: int
    head_dim: int
    dense_params: int  # summed over layers: attention, norms, dense MLPs, routers, shared experts
    expert_params: int  # one expert of one sparse layer
    num_experts: int
    top_k: int
    dtype_bytes: int

    @classmethod
    def from_config(cls, cfg: Any, dtype: torch.dtype) -> DecoderShape:
        """``cfg``: omnistage's DecoderConfig (``models/layers/decoder.py``)."""
        h, d = cfg.hidden_size, cfg.head_dim
        attn = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * d + cfg.num_heads * d * h
        sparse = len(cfg.sparse_layers)
        dense_mlp = 3 * h * cfg.intermediate_size
        sparse_fixed = h * cfg.num_experts  # router
        if cfg.shared_expert_intermediate_size:
            sparse_fixed += 3 * h * cfg.shared_expert_intermediate_size + h  # shared expert and its gate
        return cls(
            layers=cfg.num_layers, sparse_layers=sparse, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
            head_dim=d,
            dense_params=cfg.num_layers * attn + (cfg.num_layers - sparse) * dense_mlp + sparse * sparse_fixed,
            expert_params=3 * h * cfg.moe_intermediate_size if sparse else 0,
            num_experts=cfg.num_experts if sparse else 0, top_k=cfg.num_experts_per_tok if sparse else 0,
            dtype_bytes=torch.finfo(dtype).bits // 8,
        )

    def forward_work(self, rows: int, attended: float, kv_positions: float) -> tuple[float, float]:
        """(flops, bytes) of ``rows`` rows that attend to ``attended`` positions in all (summed over rows)
        and whose requests' caches hold ``kv_positions`` positions in all (each read once)."""
        flops = 2 * rows * (self.dense_params + self.sparse_layers * self.top_k * self.expert_params)
        flops += self.layers * 4 * attended * self.heads * self.head_dim  # q.k and p.v
        # Experts a step must read: the expected number of distinct experts ``rows`` rows route to.
        touched = self.num_experts * (1 - (1 - self.top_k / self.num_experts) ** rows) if self.num_experts else 0.0
        weights = self.dense_params + self.sparse_layers * touched * self.expert_params
        kv = self.layers * 2 * kv_positions * self.kv_heads * self.head_dim
        return flops, (weights + kv) * self.dtype_bytes


def decoder_forward_work(shape: DecoderShape) -> WorkFn:
    """Work of a stage model's ``forward(kv_caches, attn_meta, ...)`` from the step's attention metadata."""

    def work(args: tuple, kwargs: dict, _out: Any) -> tuple[float, float]:
        meta = args[1] if len(args) > 1 else kwargs["attn_meta"]
        seq = meta.seq_lens.double()
        q = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).double()
        attended = float((q * (seq - q) + q * (q + 1) / 2).sum())  # row i of a span sees context + i + 1
        return shape.forward_work(meta.num_tokens, attended, float(seq.sum()))

    return work


def logits_work(hidden: int, vocab: int, dtype: torch.dtype) -> WorkFn:
    """``compute_logits(hidden [M, H])``: one [H, vocab] head over M rows."""
    size = torch.finfo(dtype).bits // 8

    def work(args: tuple, kwargs: dict, _out: Any) -> tuple[float, float]:
        rows = args[0].shape[0]
        return 2 * rows * hidden * vocab, hidden * vocab * size

    return work


def code_predictor_work(shape: DecoderShape, vocab: int, groups: int) -> WorkFn:
    """A frame for B rows (``args[0]`` is [B, H]): a 2-row pass, then groups-2 one-row passes; every pass
    re-reads the layers and one output head."""
    def work(args: tuple, kwargs: dict, _out: Any) -> tuple[float, float]:
        rows = args[0].shape[0]
        hidden = args[0].shape[1]
        head = hidden * vocab
        flops = bytes_ = 0.0
        for p in range(groups - 1):
            new = 2 if p == 0 else 1
            first = 0 if p == 0 else p + 1  # position of this pass's first row
            attended = rows * sum(first + i + 1 for i in range(new))
            f, b = shape.forward_work(rows * new, attended, rows * (first + new))
            flops += f + 2 * rows * head
            bytes_ += b + head * shape.dtype_bytes
        return flops, bytes_

    return work


def code2wav_work(flops_per_frame: float, weight_bytes: float) -> WorkFn:
    """``forward_batch(payloads, states)``: new frames decoded (streaming recomputes nothing) times the
    counted flops of one frame; the weights are read once per call."""

    def work(args: tuple, kwargs: dict, _out: Any) -> tuple[float, float]:
        frames = sum(p.shape[1] for p in args[0])
        return frames * flops_per_frame, weight_bytes

    return work


def count_flops(fn: Callable[..., Any], *args: Any) -> float:
    """Matmul/conv flops of one call, counted by torch (elementwise work is not counted)."""
    from torch.utils.flop_counter import FlopCounterMode

    # Compiled parts run their eager functions here: a dispatch mode cannot enter a compiled graph.
    with torch.compiler.set_stance("force_eager"), FlopCounterMode(display=False) as counter, torch.inference_mode():
        fn(*args)
    return float(counter.get_total_flops())
