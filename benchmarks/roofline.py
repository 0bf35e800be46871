"""The machine's measured peaks and a work model of each pipeline component, for achieved-vs-bound tables.

Peaks are measured here, at the benchmark's thread count: GEMM GFLOP/s (a large square matmul in the
serving dtype, best of several) and memory read GB/s (a sum over a buffer far larger than the caches, best
of several). A component's bound is max(flops / GEMM peak, bytes / read peak): the time it would take if it
only did its matmul work at full speed, or only streamed the weights and KV it must read at full bandwidth.
Work per call is estimated from the call's shapes and the model config (what a call must do, not what a
kernel happens to do), so the bound does not depend on how omnistage computes it. Weights count at the
narrower of the serving dtype and the checkpoint's stored one (``stored_dtype``): float32 serving of a
checkpoint stored in bfloat16 must read no more than its bfloat16 values (omnistage holds them so), while
KV entries and activations are in the serving dtype. float32's GEMM peak on a CPU with AMX and weights that
are bfloat16 values is the better of torch's float32 matmul and a third of its bfloat16 one (AMX's exact
three-part products, ``amx_kernels``): the fastest exact float32 arithmetic the machine has for those weights.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from omnistage.models.layers import amx_kernels

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


def _best_seconds(fn: Callable[[], Any], repeats: int, budget_s: float = math.inf) -> float:
    """The best of ``repeats`` timed calls, fewer (at least 2) where they would take more than ``budget_s``."""
    fn()  # first call: allocation, thread pool start
    best = math.inf
    spent = 0.0
    for i in range(repeats):
        start = time.perf_counter()
        fn()
        took = time.perf_counter() - start
        best, spent = min(best, took), spent + took
        if i >= 1 and spent > budget_s:
            break
    return best


def gemm_gflops(dtype: torch.dtype, size: int = 2048, repeats: int = 30, budget_s: float = 4.0) -> float:
    """torch's square-matmul rate in ``dtype``: the best of ``repeats`` at ``size``, or of as many as fit
    ``budget_s`` at the largest power-of-two size (from 256) whose call fits a tenth of it. A dtype the CPU has
    no arithmetic for runs orders of magnitude slower (bfloat16 on AVX2: 1.3 GFLOP/s against float32's 95, 2
    Zen 3 cores); at 2048 its 30 calls would take 7 minutes."""
    n = min(256, size)
    while True:
        a = torch.randn(n, n).to(dtype)
        b = torch.randn(n, n).to(dtype)
        start = time.perf_counter()
        torch.mm(a, b)
        once = time.perf_counter() - start
        if n >= size or once * 8 > budget_s / 10:
            return 2 * n**3 / _best_seconds(partial(torch.mm, a, b), repeats, budget_s) / 1e9
        n *= 2


def measure_peaks(dtype: torch.dtype, repeats: int = 30, gemm_size: int = 2048, read_mib: int | None = None,
                  bf16_weights: bool = False) -> Peaks:
    """GEMM GFLOP/s in ``dtype`` and read GB/s from memory, at the current ``torch.get_num_threads()``, the best
    of ``repeats`` (a shared VM's rate moves: torch's bfloat16 2048^2 matmul measured 529-2258 GFLOP/s in one
    process, Xeon with AMX, 2 threads; 10 repeats often saw only the low mode). The read buffer (default
    ``read_probe_mib()``) outsizes the last-level cache. ``bf16_weights`` (float32 only): the weights are bfloat16
    values, so AMX's three-part products count where the CPU has them: a third of the bfloat16 GEMM rate."""
    gemm = gemm_gflops(dtype, gemm_size, repeats)
    if dtype == torch.bfloat16:
        # A CPU without bfloat16 arithmetic (AVX2) is fastest widening the values to float32, as omnistage's
        # kernels do there: that rate bounds bfloat16 serving too.
        gemm = max(gemm, gemm_gflops(torch.float32, gemm_size, repeats))
    mib = read_probe_mib() if read_mib is None else read_mib
    buf = torch.ones(mib * 1024 * 1024 // 4)  # float32: the read rate does not depend on the dtype
    read = buf.numel() * 4 / _best_seconds(buf.sum, repeats) / 1e9
    del buf
    peaks = Peaks(gemm_gflops=gemm, read_gbps=read)
    if dtype == torch.float32 and bf16_weights and amx_kernels.available():
        peaks = with_three_parts(peaks, Peaks(gemm_gflops(torch.bfloat16, gemm_size, repeats), read))
    return peaks


def read_probe_mib() -> int:
    """The read probe's buffer: four times the largest cache (sysfs), at least 1 GiB. A buffer the cache partly
    holds reads faster than memory: on a Xeon with a 300 MiB L3 (2 threads, one process), 64 MiB read 63 GB/s,
    256 MiB 32-39 GB/s (54 in one run), 1-2 GiB 30 GB/s."""
    return max(1024, 4 * largest_cache_bytes() // (1 << 20))


_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def largest_cache_bytes(caches: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """The largest CPU cache sysfs lists for cpu0 (its last level), in bytes; 0 where sysfs does not say."""
    sizes = []
    for entry in caches.glob("index*/size"):
        text = entry.read_text().strip().upper()
        if text[:-1].isdigit() and text[-1:] in _UNITS:
            sizes.append(int(text[:-1]) * _UNITS[text[-1]])
        elif text.isdigit():
            sizes.append(int(text))
    return max(sizes, default=0)


def with_three_parts(float32: Peaks, bfloat16: Peaks) -> Peaks:
    """float32's peaks for weights that are bfloat16 values: its GEMM the better of its own and a third of the
    bfloat16 rate where the AMX kernels serve (three exact bfloat16 products per float32 one)."""
    if not amx_kernels.available():
        return float32
    return Peaks(max(float32.gemm_gflops, bfloat16.gemm_gflops / 3), float32.read_gbps)


def _bytes(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits // 8


def read_dtype(serving: torch.dtype, stored: torch.dtype | None) -> torch.dtype:
    """The width weights are read at: the narrower of the serving dtype and the stored one (None: unknown)."""
    return stored if stored is not None and stored.is_floating_point and _bytes(stored) < _bytes(serving) else serving


_FLOATS = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def _float_tensors(model_dir: str, prefix: str = "") -> Iterator[tuple[torch.dtype, int]]:
    """(stored dtype, elements) of each floating-point tensor of the checkpoint under ``prefix``, from the
    safetensors headers (no data read)."""
    from safetensors import safe_open

    from omnistage.models.loader import checkpoint_files

    by_file: dict = {}
    for name, path in checkpoint_files(model_dir).items():
        if name.startswith(prefix):
            by_file.setdefault(path, []).append(name)
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for name in names:
                piece = f.get_slice(name)
                if piece.get_dtype() in _FLOATS:
                    yield _FLOATS[piece.get_dtype()], math.prod(piece.get_shape())


def stored_dtype(model_dir: str, prefix: str = "") -> torch.dtype | None:
    """The dtype most of the checkpoint's floating-point tensors under ``prefix`` are stored in (by element
    count); None when it holds none there."""
    counts: Counter = Counter()
    for dtype, elements in _float_tensors(model_dir, prefix):
        counts[dtype] += elements
    return counts.most_common(1)[0][0] if counts else None


def largest_tensor_bytes(model_dir: str, dtype: torch.dtype) -> int:
    """The checkpoint's largest floating-point tensor at ``dtype`` (a load's allowed transient)."""
    return max((elements for _, elements in _float_tensors(model_dir)), default=0) * dtype.itemsize


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
    weight_bytes: int  # per parameter, as read (see the module's note)
    kv_bytes: int  # per cached key or value element

    @classmethod
    def from_config(cls, cfg: Any, dtype: torch.dtype, weight_dtype: torch.dtype | None = None) -> DecoderShape:
        """``cfg``: omnistage's DecoderConfig (``models/layers/decoder.py``); ``dtype``: the serving dtype;
        ``weight_dtype``: the checkpoint's stored one (``read_dtype`` picks the narrower)."""
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
            weight_bytes=_bytes(read_dtype(dtype, weight_dtype)), kv_bytes=_bytes(dtype),
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
        return flops, weights * self.weight_bytes + kv * self.kv_bytes


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
    """``compute_logits(hidden [M, H])``: one [H, vocab] head over M rows; ``dtype``: the head's as read
    (``read_dtype``)."""
    size = _bytes(dtype)

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
            bytes_ += b + head * shape.weight_bytes
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
