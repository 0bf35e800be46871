"""omnistage's own CPU kernels (``csrc/cpu_kernels.c``): linear layers and routed experts (one call per MoE
layer) on weights in panel layout, paged decode attention read in place from the cache (both for the ``fast``
option), a vocoder residual unit's tail (SnakeBeta, kernel-1 convolution, residual) in one pass, the vocoder's
last SnakeBeta and few-output convolution in one pass, and the transforms of ``dft_conv``'s wide
convolutions (blocks in, with SnakeBeta; products out, with bias and residual; the weight's planes).

A decode batch gives each expert a few rows. GEMM libraries then stream an expert's weights at a fraction of
the machine's read bandwidth and cost a call per expert (oneDNN: 2 per expert per layer). The expert kernel
sorts the selections by expert, then streams each expert's weights once while all of its rows take their dot
products in registers (SwiGLU in between), and weights and sums each token's slots in top-k order. A linear
layer runs the same tiles over all rows. Work is split over ``torch.get_num_threads()`` OpenMP threads
(torch's own runtime: the library links the ``libgomp.so.1`` torch has loaded). With many rows the tiles run
at the FMA units' pace, so one copy of the weights, in panel layout, serves decode and prefill (measured
against oneDNN's packed GEMMs in ``benchmarks/moe_kernels.py``).

bfloat16 takes AVX512-BF16 dot products where the CPU has them (``vdpbf16ps``: weights in pairs of input
indices; rows and the SwiGLU intermediate in bfloat16). Without them the expert kernel widens bfloat16 weights
to float32 (slower than oneDNN from about 16 rows per expert), and bfloat16 linear layers keep oneDNN (or, where
oneDNN has no bfloat16, take widened panels: ``takes_widened``); the decoder kernels then take bfloat16 rows on
widened panels (``bf16x``) and serve every decoder they take (``widened_bf16_decoders``).

The C code's vectors have the build's native width (16 lanes with AVX-512, 8 with AVX2: GCC lowers wider generic
vectors through the stack); row tiles are 8 rows (AVX-512) or 6 rows over half a panel at a time (AVX2).

Built at first use for the host CPU (``cc -O3 -march=native -fopenmp``, about a second, cached under the
omnistage cache directory; linked with glibc's vector math, libmvec). Without a C compiler the kernels are
unavailable (logged once), and ``OMNISTAGE_CPU_KERNELS=0`` turns them off; layers then keep oneDNN's packed
GEMMs and torch's attention and vocoder passes. Float rounding differs from the GEMMs' (sums in another
order); a row's result does not depend on its batch mates or the thread count.

The panel kernels (linear layers, experts, decoder layers, the vocoder's tail) serve by default wherever they
build (``panels_preferred``): 8-row tiles with AVX-512, 6-row tiles over half a panel with AVX2. Each
``supports_*`` says which dtypes, shapes and devices a kernel serves; a layer outside them keeps the reference
path.

Packed weights of 2 MB or more live in memory advised for 2 MB pages (``in_large_pages``).

A float32 model's weights that are bfloat16 values (checkpoints stored in bfloat16) are kept as bfloat16
(``keeps_float32_as_pairs``; the ``f32p`` tiles): in pairs of inputs with AVX-512 (AMX's layout), plainly with
AVX2; half the bytes, and exactly the float32 panels' bits, each product being the same.

``DecoderPass`` and ``decoder_step`` run every layer of a Qwen3(-MoE) decoder in one call: the code
predictor's passes (15 per frame, on a few rows each) and the paged Thinker's and Talker's decode steps under
``fast``. As separate ops, a layer is 15-30 calls on a few rows, each with its own dispatch and thread fork and
join (measured on the small preset's Talker, 16 rows, bfloat16, 2 threads: 19.2 ms a step layer by layer, 8.6
ms in one call, where its 124 MB of weights take about 5 ms to read). Quantized layers (``KernelWeight`` entries)
run in the same call through ``quant_kernels``' phases, AMX weights (``AmxWeight`` entries: the code predictor's
dense layers on AMX CPUs) through ``amx_kernels``' phase, whatever the row count (float32 rows as three exact
bfloat16 parts, each summed on its own).
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from omnistage.models.layers import amx_kernels, quant_kernels
from omnistage.models.layers.amx_kernels import AmxWeight
from omnistage.models.layers.c_build import LazyLibrary, build_library, scratch
from omnistage.models.layers.quant_kernels import KernelWeight

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.c"
_LIBS = ["-lmvec", "-lm"]  # glibc's vector math (the vocoder's sin)
# Variants by weight type: float32, widened bfloat16, and "bf16dp" (AVX512-BF16 dot products), which is built
# only where the CPU has them.
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_DOT = "bf16dp"
_WIDE = "bf16x"  # bfloat16 rows on widened bfloat16 weights (linear layers, decoder layers without dot products)
# float32 rows on bfloat16 weights (in pairs with AVX-512): a float32 model's weights that are bfloat16 values
_PAIRS = "f32p"
_ROWS_MAX = 8  # the C tiles' row count is at most this (8 with AVX-512, 6 otherwise)
# Panel widths the layout needs: gate/up panels of 16 intermediate columns, down (and linear) panels of 32
# output columns.
UP_PANEL, DOWN_PANEL = 16, 32

# Per Python thread: the C functions by name (scratch buffers: ``c_build.scratch``).
_local = threading.local()


def _build() -> ctypes.CDLL:
    library = build_library(_SOURCE, tuple(_LIBS))
    pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    for suffix in (*_SUFFIX.values(), _DOT, _PAIRS):
        if not hasattr(library, f"moe_experts_{suffix}"):
            continue
        experts = getattr(library, f"moe_experts_{suffix}")
        experts.restype = None
        experts.argtypes = [i64] * 6 + [pointer] * 6 + [i32] + [pointer] * 4 + [i32]
    for suffix in ("f32", _DOT, _WIDE, _PAIRS):
        if hasattr(library, f"linear_{suffix}"):
            linear = getattr(library, f"linear_{suffix}")
            linear.restype = None
            linear.argtypes = [i64] * 3 + [pointer] * 4 + [i32] + [pointer] * 3 + [i32]
    library.residual_draws.restype = None
    library.residual_draws.argtypes = [i64] * 3 + [pointer, i64, pointer, i64] + [pointer] * 2 + [ctypes.c_float,
                                                                                                  pointer, i32]
    library.snake_pointwise_f32.restype = None
    library.snake_pointwise_f32.argtypes = [i64] * 2 + [pointer] * 7 + [i32]
    library.conv_pairs_f32.restype = None
    library.conv_pairs_f32.argtypes = [i64] * 6 + [pointer] * 9 + [i32]
    for suffix in _SUFFIX.values():
        snake_conv = getattr(library, f"snake_conv_{suffix}")
        snake_conv.restype = None
        snake_conv.argtypes = [i64] * 7 + [pointer] * 8 + [i32]
        kept = getattr(library, f"snake_kept_{suffix}")
        kept.restype = None
        kept.argtypes = [i64] * 4 + [pointer] * 6
        rows = getattr(library, f"snake_rows_{suffix}")
        rows.restype = None
        rows.argtypes = [i64] * 4 + [pointer] * 5 + [i32]
    for suffix in ("f32", _DOT, _WIDE, _PAIRS):
        if hasattr(library, f"decoder_layers_{suffix}"):
            layers = getattr(library, f"decoder_layers_{suffix}")
            layers.restype = None
            layers.argtypes = [pointer, pointer, i64, pointer, ctypes.c_float, ctypes.c_float, i32]
    for suffix in _SUFFIX.values():
        attention = getattr(library, f"decode_attention_{suffix}")
        attention.restype = None
        attention.argtypes = [i64] * 4 + [pointer] * 4 + [i64, pointer, pointer, i64, ctypes.c_float, pointer,
                                                          pointer, i32]
    for suffix in _SUFFIX.values():  # the DFT convolutions' transforms (dft_conv)
        forward = getattr(library, f"dft_forward_{suffix}")
        forward.restype, forward.argtypes = None, [i64] * 9 + [pointer] * 6 + [i32]
        inverse = getattr(library, f"dft_inverse_{suffix}")
        inverse.restype, inverse.argtypes = None, [i64] * 7 + [pointer] * 5 + [i32]
        weight = getattr(library, f"dft_weight_{suffix}")
        weight.restype, weight.argtypes = None, [i64] * 4 + [pointer] * 3 + [i32]
    return library


_lazy = LazyLibrary(_build, "CPU kernels", "layers keep oneDNN's packed GEMMs")


def available() -> bool:
    """Whether the kernel is built (building it on the first call); False, logged once, when it cannot be, and
    while ``OMNISTAGE_CPU_KERNELS=0`` (weights packed meanwhile keep oneDNN's layouts)."""
    return _lazy.available()


PANELS_ENV = "OMNISTAGE_PANEL_KERNELS"


def panels_preferred() -> bool:
    """Whether layers take the panel kernels (linear layers, experts, whole decoder layers, the vocoder's
    residual tail): wherever they build, unless ``OMNISTAGE_PANEL_KERNELS=0`` (then oneDNN's GEMMs, compiled
    frames and layer-by-layer decoders serve, as without a compiler). Measured faster than oneDNN with AVX-512
    (8-row tiles) and with AVX2 (6-row half-panel tiles): on AMD EPYC Zen 3, 2 threads, float32 linear layers
    1.5-3x faster at 3-16 rows and within 0.9-1.3x at 64-1024; the small preset end to end 1.7x at 1 request,
    1.2x at 16."""
    choice = os.environ.get(PANELS_ENV, "auto").strip().lower()
    return choice not in ("0", "false", "no", "off") and available()


def _require() -> None:
    _lazy.require()


def dft_function(name: str) -> Callable[..., None]:
    """One of the DFT convolutions' transforms (``dft_forward_*``, ``dft_inverse_*``, ``dft_weight_*``; the
    arguments ``dft_conv`` passes), for ``dft_conv``, which runs them around torch's batched GEMM."""
    _require()
    return _function(name)


def _function(name: str):
    functions = _local.__dict__.setdefault("functions", {})
    fn = functions.get(name)
    if fn is None:
        fn = functions[name] = getattr(_lazy.library, name)
    return fn


_scratch = scratch



_LARGE_PAGE = 2 << 20


def in_large_pages(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` (CPU) in memory that Linux is asked to back with 2 MB pages (``madvise``: transparent
    huge pages in their ``madvise`` or ``always`` mode), for weights the kernels stream on every call: with 4 KB
    pages, every 4 KB of a panel costs a TLB miss. Measured in one process against the same weights in 4 KB
    pages, 16 rows: the float32 linear layers of one code-predictor pass (~36 MB) 3-18% faster, twelve bfloat16
    Thinker expert layers 0-15%. ``t`` itself when smaller than a page or where such memory is unavailable.
    The copy is freed with the tensor."""
    if t.device.type != "cpu":
        return t
    region = _large_pages(t.numel() * t.element_size())
    return t if region is None else region.view(t.dtype).view(t.shape).copy_(t)


def large_pages_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor in memory advised for 2 MB pages (``in_large_pages``; where it is smaller
    than a page or such memory is unavailable, ordinary memory): packing writes its layout straight into it."""
    region = _large_pages(math.prod(shape) * dtype.itemsize)
    return torch.empty(shape, dtype=dtype) if region is None else region.view(dtype).view(shape)


def _large_pages(nbytes: int) -> torch.Tensor | None:
    """``nbytes`` of anonymous memory (uint8) advised for 2 MB pages, or None (too small, or unavailable)."""
    if nbytes < _LARGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    try:
        region = mmap.mmap(-1, nbytes + _LARGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        whole = torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive as long as a view of it
        offset = -whole.data_ptr() % _LARGE_PAGE
        region.madvise(mmap.MADV_HUGEPAGE, offset, nbytes)
    except (OSError, ValueError) as exc:  # no such mapping or advice here: 4 KB pages serve
        log.debug("no large pages for a %d-byte weight: %s", nbytes, exc)
        return None
    return whole[offset : offset + nbytes]


# Packing writes its layout into the packed tensor this many source bytes at a time (a padded piece is a temporary
# of about this size; the rest is read straight from the weight): a load never holds a second copy of a weight.
_PACK_CHUNK_BYTES = 64 << 20


def supports(weight: torch.Tensor) -> bool:
    """Whether stacked expert weights of this dtype and device can take the kernel (CPU, float32/bfloat16)."""
    return weight.device.type == "cpu" and weight.dtype in _SUFFIX and panels_preferred()


def _dot_bf16(dtype: torch.dtype, inputs: int) -> bool:
    """Whether bfloat16 weights take the dot-product variant (pairs of input indices: an even input size)."""
    return dtype == torch.bfloat16 and inputs % 2 == 0 and _has_dot()


def _has_dot() -> bool:
    return hasattr(_lazy.library, f"moe_experts_{_DOT}")


def _suffix(dtype: torch.dtype, inputs: int, weights: torch.dtype | None = None) -> str:
    """The expert kernel's variant for rows of ``dtype`` on panels of ``weights`` (default: the same)."""
    if dtype == torch.float32 and weights == torch.bfloat16:
        return _PAIRS
    return _DOT if _dot_bf16(dtype, inputs) else _SUFFIX[dtype]


def _layers_suffix(dtype: torch.dtype, inputs: int, weights: torch.dtype | None = None) -> str:
    """The linear and decoder-layer kernels' variant for rows of ``dtype`` on panels of ``weights`` (default: the
    same): bfloat16 rows stay bfloat16 on either bfloat16 layout; float32 rows on bfloat16 pairs widen them."""
    if dtype == torch.float32:
        return _PAIRS if weights == torch.bfloat16 else "f32"
    return _DOT if _dot_bf16(dtype, inputs) else _WIDE


def _has_pairs() -> bool:
    return hasattr(_lazy.library, f"linear_{_PAIRS}")


def keeps_float32_as_pairs(weight: torch.Tensor) -> bool:
    """Whether ``pack_linear`` / ``pack_experts`` (asked to) keep this float32 weight as bfloat16 pairs: all its
    values are bfloat16 values (a checkpoint stored in bfloat16), its inputs are even and this build has the
    ``f32p`` tiles (in pairs with AVX-512, plain [K][32] panels with AVX2). Half the bytes to hold and to stream,
    and the float32 panels' bits: each product of a float32 row and such a weight is the same, summed in the same
    order."""
    _require()
    return (weight.dtype == torch.float32 and weight.shape[-1] % 2 == 0 and _has_pairs()
            and amx_kernels.bf16_exact(weight.detach()))


def rows_take(rows: torch.dtype, weights: torch.dtype) -> bool:
    """Whether the kernels take rows of dtype ``rows`` on panels of dtype ``weights``: the same dtype, or float32
    rows on bfloat16 pairs (``keeps_float32_as_pairs``)."""
    return rows == weights or (rows == torch.float32 and weights == torch.bfloat16 and _has_pairs())


def widened_bf16_decoders() -> bool:
    """Whether bfloat16 decoder kernels here read widened bfloat16 panels (the panel kernels serve, the CPU has no
    AVX512-BF16 dot products). The decoders they take then hold their bfloat16 linear layers as such panels
    (``decoder.pack_widened_panels``, the code predictor's ``pack_weights``): quantized ones their routers,
    shared-expert gates and output heads. Other bfloat16 linear layers take these panels too where oneDNN has no
    bfloat16 (``takes_widened``). In one call per step the panels win: small preset, 16 requests, the Talker's
    decode 3.63 -> 2.30 s, the Thinker's 2.07 -> 1.81 s (2 Zen 3 cores), against quant_kernels' dense kernel layer
    by layer."""
    return panels_preferred() and not _has_dot()


def serves_any_batch(dtype: torch.dtype, hidden: int) -> bool:
    """Whether the kernel is at least as fast as oneDNN's per-expert GEMMs at every row count (float32, and
    bfloat16 with dot products); the widened bfloat16 variant loses from about 16 rows per expert."""
    return panels_preferred() and (dtype == torch.float32 or _dot_bf16(dtype, hidden))


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _packed_layout(weight: torch.Tensor, float32_pairs: bool) -> tuple[torch.dtype, bool]:
    """(the packed tensor's dtype, whether its inputs go in pairs) for ``weight`` [..., K]: float32 kept as
    bfloat16 (cast as it is copied in; in pairs where the build's f32p tiles read them so), or the weight's dtype,
    in pairs for the bfloat16 dot products."""
    if float32_pairs:
        return torch.bfloat16, bool(_lazy.library.f32p_in_pairs())  # (AVX2 builds: the plain layout)
    return weight.dtype, _dot_bf16(weight.dtype, weight.shape[-1])


def pack_experts(gate_up: torch.Tensor, down: torch.Tensor,
                 float32_pairs: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked weights gate_up [E, 2I, H], down [E, H, I] -> the kernel's panels: gate/up [E, I'/16, H, 32]
    (16 gate then 16 up columns per hidden index), down [E, H'/32, I', 32], with I and H padded to I', H'
    (multiples of 16 and 32) by zero weights. For the bfloat16 dot-product variant, each panel's rows go in
    pairs of consecutive indices, interleaved per column (``[K/2][32][2]``; same shapes); with
    ``float32_pairs``, float32 weights that ``keeps_float32_as_pairs`` are packed so, as bfloat16."""
    _require()  # the layout depends on the variants built for this CPU
    dtype, pairs = _packed_layout(gate_up, float32_pairs and keeps_float32_as_pairs(gate_up)
                                  and keeps_float32_as_pairs(down))
    experts, hidden, inter = down.shape
    inter_p, hidden_p = _round_up(inter, UP_PANEL), _round_up(hidden, DOWN_PANEL)
    panels_up = large_pages_empty((experts, inter_p // UP_PANEL, hidden, 2 * UP_PANEL), dtype)
    panels_down = large_pages_empty((experts, hidden_p // DOWN_PANEL, inter_p, DOWN_PANEL), dtype)
    gate_up, down = gate_up.contiguous(), down.contiguous()
    step = max(1, _PACK_CHUNK_BYTES // (gate_up[0].numel() * gate_up.element_size()))
    for e0 in range(0, experts, step):
        e1 = min(experts, e0 + step)
        n = e1 - e0
        halves = gate_up[e0:e1].view(n, 2, inter, hidden)
        if inter_p != inter:
            halves = F.pad(halves, (0, 0, 0, inter_p - inter))
        padded = down[e0:e1]
        if (hidden_p, inter_p) != (hidden, inter):
            padded = F.pad(padded, (0, inter_p - inter, 0, hidden_p - hidden))
        up, dn = panels_up[e0:e1], panels_down[e0:e1]
        if pairs:
            up.view(n, inter_p // UP_PANEL, hidden // 2, 2, UP_PANEL, 2).copy_(
                halves.view(n, 2, inter_p // UP_PANEL, UP_PANEL, hidden // 2, 2).permute(0, 2, 4, 1, 3, 5))
            dn.view(n, hidden_p // DOWN_PANEL, inter_p // 2, DOWN_PANEL, 2).copy_(
                padded.view(n, hidden_p // DOWN_PANEL, DOWN_PANEL, inter_p // 2, 2).permute(0, 1, 3, 2, 4))
        else:
            up.view(n, inter_p // UP_PANEL, hidden, 2, UP_PANEL).copy_(
                halves.view(n, 2, inter_p // UP_PANEL, UP_PANEL, hidden).permute(0, 2, 4, 1, 3))
            dn.copy_(padded.view(n, hidden_p // DOWN_PANEL, DOWN_PANEL, inter_p).transpose(2, 3))
    return panels_up, panels_down


def moe_experts(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, panels: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """x [T, H], ids [T, K] selected experts, weights [T, K] routing weights -> [T, H] in x's dtype: each
    token's selected experts' SwiGLU outputs, weighted, summed in slot order. ``panels``: ``pack_experts``'s
    result."""
    _require()
    panels_up, panels_down = panels
    experts, inter, hidden = panels_up.shape[0], panels_up.shape[1] * UP_PANEL, panels_up.shape[2]
    hidden_p = panels_down.shape[1] * DOWN_PANEL
    tokens, top_k = ids.shape
    if x.shape != (tokens, hidden) or x.device.type != "cpu" or not rows_take(x.dtype, panels_up.dtype):
        raise ValueError(f"x must be [{tokens}, {hidden}] {panels_up.dtype} on the CPU, got "
                         f"{tuple(x.shape)} {x.dtype} on {x.device}")
    threads = torch.get_num_threads()
    n = tokens * top_k
    dot = _dot_bf16(x.dtype, hidden)  # rows and intermediates stay bfloat16; else float32
    rows = x.contiguous() if dot else x.float().contiguous()
    ids = ids.to(torch.int64).contiguous()
    weights = weights.float().contiguous()
    out = x.new_empty(tokens, hidden_p)
    h = _scratch(f"h-{rows.dtype}", n * inter, rows.dtype)
    y = _scratch("y", threads * n * DOWN_PANEL, torch.float32)
    sort = _scratch("sort", 2 * n + 2 * experts + 2, torch.int64)
    pointers = _scratch("pointers", threads * 2 * n, torch.int64)
    _function(f"moe_experts_{_suffix(x.dtype, hidden, panels_up.dtype)}")(
        tokens, top_k, experts, hidden, hidden_p, inter, rows.data_ptr(), ids.data_ptr(), weights.data_ptr(),
        panels_up.data_ptr(), panels_down.data_ptr(), out.data_ptr(), int(x.dtype == torch.bfloat16),
        h.data_ptr(), y.data_ptr(), sort.data_ptr(), pointers.data_ptr(), threads,
    )
    return out if hidden_p == hidden else out[:, :hidden]


# -- linear layers -----------------------------------------------------------------------------------------


def takes_widened(weight: torch.Tensor) -> bool:
    """Whether a bfloat16 linear weight [out, in] takes ``panel_linear`` on widened panels (``bf16x``: the panel
    kernels serve, the CPU has no AVX512-BF16 dot products) where ``supports_linear`` leaves it to oneDNN, for
    ``fast_linear`` to choose where oneDNN cannot pack bfloat16."""
    return (weight.device.type == "cpu" and weight.dim() == 2 and weight.dtype == torch.bfloat16
            and widened_bf16_decoders())


def supports_linear(weight: torch.Tensor) -> bool:
    """Whether a linear weight [out, in] takes ``panel_linear``: on the CPU, float32, or bfloat16 with the
    dot-product variant (the widened one is slower than oneDNN at prefill sizes)."""
    return (
        weight.device.type == "cpu"
        and weight.dim() == 2
        and panels_preferred()
        and (weight.dtype == torch.float32 or _dot_bf16(weight.dtype, weight.shape[1]))
    )


def pack_linear(weight: torch.Tensor, float32_pairs: bool = False) -> torch.Tensor:
    """Linear weight [..., N, K] -> panels [..., N'/32, K, 32] (N padded to N' by zero rows; for bfloat16 dot
    products the input indices in pairs per column, ``[K/2][32][2]``, same shape); leading dims stack weights
    (one copy for all of them). ``float32_pairs``: a float32 weight that ``keeps_float32_as_pairs`` is packed
    as bfloat16 pairs (for the callers whose kernels take them: ``linear``, the decoder kernels)."""
    _require()
    dtype, pairs = _packed_layout(weight, float32_pairs and keeps_float32_as_pairs(weight))
    *lead, out_features, in_features = weight.shape
    panels = _round_up(out_features, DOWN_PANEL) // DOWN_PANEL
    packed = large_pages_empty((*lead, panels, in_features, DOWN_PANEL), dtype)
    weight = weight.contiguous()
    step = max(1, _PACK_CHUNK_BYTES // (DOWN_PANEL * in_features * weight.element_size() * math.prod(lead)))
    for p0 in range(0, panels, step):
        p1 = min(panels, p0 + step)
        rows = weight[..., p0 * DOWN_PANEL : p1 * DOWN_PANEL, :]
        if rows.shape[-2] < (p1 - p0) * DOWN_PANEL:  # the last panel's missing outputs: zero weights
            rows = F.pad(rows, (0, 0, 0, (p1 - p0) * DOWN_PANEL - rows.shape[-2]))
        if pairs:
            packed[..., p0:p1, :, :].view(*lead, p1 - p0, in_features // 2, DOWN_PANEL, 2).copy_(
                rows.view(*lead, p1 - p0, DOWN_PANEL, in_features // 2, 2).transpose(-3, -2))
        else:
            packed[..., p0:p1, :, :].copy_(rows.view(*lead, p1 - p0, DOWN_PANEL, in_features).transpose(-2, -1))
    return packed


def pack_bias(bias: torch.Tensor | None, out_features: int) -> torch.Tensor | None:
    """A linear bias as ``panel_linear`` takes it: float32, padded to the panels' width."""
    if bias is None:
        return None
    padded = torch.zeros(_round_up(out_features, DOWN_PANEL), dtype=torch.float32, device=bias.device)
    padded[:out_features] = bias.detach()
    return padded


_DECODE_ROWS = 64  # linear calls up to this many rows reuse a workspace kept per row count


def _linear_workspace(tokens: int, threads: int) -> list[int]:
    """Addresses of this thread's scratch for a linear call: y [threads, tokens, 32] float32, pointers
    [threads, 2 * tokens], ones [tokens] float32. Decode-sized calls (hundreds per step, a few row counts) keep
    theirs per row count; larger ones share the growing buffers."""
    if tokens > _DECODE_ROWS:
        return [_scratch("y", threads * tokens * DOWN_PANEL, torch.float32).data_ptr(),
                _scratch("pointers", threads * 2 * tokens, torch.int64).data_ptr(),
                _scratch("ones", tokens, torch.float32, fill=1.0).data_ptr()]
    return _kept("linear", (tokens, threads), lambda: [
        torch.empty(threads * tokens * DOWN_PANEL), torch.empty(threads * 2 * tokens, dtype=torch.int64),
        torch.ones(tokens)])[1]


def _kept(kind: str, key: tuple, make: Callable[[], list[torch.Tensor]]) -> tuple[list[torch.Tensor], list[int]]:
    """Buffers ``make()`` built for this thread and ``key`` and their addresses, built once and kept: calls of one
    shape (a step's hundreds of small calls) then cost no allocation and no address lookups. At most 64 shapes
    per kind are kept (row counts up to a stage's batch limit, a few tables); a caller that keeps addresses
    beyond its call keeps the buffers too."""
    kept = _local.__dict__.setdefault(f"kept-{kind}", {})
    found = kept.get(key)
    if found is None:
        if len(kept) >= 64:
            kept.clear()
        buffers = make()
        found = kept[key] = (buffers, [t.data_ptr() for t in buffers])
    return found


def _linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    if _lazy.library is None:
        _require()
    in_features = panels.shape[1]
    if x.shape[-1] != in_features or not rows_take(x.dtype, panels.dtype) or x.device.type != "cpu":
        raise ValueError(f"x must be [..., {in_features}] {panels.dtype} on the CPU, got {tuple(x.shape)} "
                         f"{x.dtype} on {x.device}")
    rows = x.reshape(-1, in_features).contiguous()
    tokens, padded = rows.shape[0], panels.shape[0] * DOWN_PANEL
    threads = torch.get_num_threads()
    out, result = _linear_output(x, padded, out_features)
    y, pointers, ones = _linear_workspace(tokens, threads)
    _function(f"linear_{_layers_suffix(x.dtype, in_features, panels.dtype)}")(
        tokens, in_features, padded, rows.data_ptr(), panels.data_ptr(), 0 if bias is None else bias.data_ptr(),
        out.data_ptr(), int(x.dtype == torch.bfloat16), y, pointers, ones, threads,
    )
    return result


def _linear_output(x: torch.Tensor, padded: int, out_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the [tokens, padded] rows the kernel writes, what the op returns: those rows as [..., out_features],
    the padding columns sliced off, not copied). The fake kernels return the same view, so a compiled graph
    sees the real op's sizes and strides (a padded panel's output is not contiguous)."""
    out = x.new_empty(x.numel() // x.shape[-1], padded)
    return out, out[:, :out_features].reshape(*x.shape[:-1], out_features)


def linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """``panel_linear``: the custom op inside ``torch.compile``, a direct call in eager code (the op's dispatch cost
    a one-row call 12 of its 32 us)."""
    if torch.compiler.is_compiling():
        return panel_linear(x, panels, bias, out_features)
    return _linear(x, panels, bias, out_features)


def linear_at(x: torch.Tensor, panels: torch.Tensor, index: torch.Tensor, out_features: int) -> torch.Tensor:
    """``panel_linear_at``, called as ``linear`` calls ``panel_linear``."""
    if torch.compiler.is_compiling():
        return panel_linear_at(x, panels, index, out_features)
    return _linear(x, panels[int(index)], None, out_features)


@torch.library.custom_op("omnistage::panel_linear", mutates_args=())
def panel_linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x [..., K] times a ``pack_linear`` weight, plus a ``pack_bias`` bias -> [..., out_features]. An opaque op to
    ``torch.compile`` (inductor calls it as is)."""
    return _linear(x, panels, bias, out_features)


@panel_linear.register_fake
def _(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return _linear_output(x, panels.shape[0] * DOWN_PANEL, out_features)[1]


@torch.library.custom_op("omnistage::panel_linear_at", mutates_args=())
def panel_linear_at(x: torch.Tensor, panels: torch.Tensor, index: torch.Tensor, out_features: int) -> torch.Tensor:
    """``panel_linear(x, panels[index], None, out_features)`` for stacked panels [G, N'/32, K, 32] and a 0-d
    ``index`` tensor (a loop compiled as ``torch.scan`` walks them by a scanned index, without copying one)."""
    return _linear(x, panels[int(index)], None, out_features)


@panel_linear_at.register_fake
def _(x: torch.Tensor, panels: torch.Tensor, index: torch.Tensor, out_features: int) -> torch.Tensor:
    return _linear_output(x, panels.shape[1] * DOWN_PANEL, out_features)[1]


# -- the code predictor's residual draws ---------------------------------------------------------------------

MAX_DRAW = 256  # residual_draws' candidate bound (MAX_DRAW in cpu_kernels.c)


def residual_draws(logits: torch.Tensor, sampled: torch.Tensor, noise: torch.Tensor, best: torch.Tensor,
                   top_p: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """One code per row [B] int64: where ``sampled`` [B] (bool), a draw among the top k = ``noise.shape[-1]`` of
    ``logits`` [B, V] (larger first, equal ones in index order) cut to the smallest prefix whose softmax mass
    reaches ``top_p``, by the race ``argmax(p / noise)`` (``noise`` [B, k] exponential draws); elsewhere ``best``
    [B]. Into ``out`` where given (contiguous int64 [B]; may be ``best`` itself). ``code_predictor``'s draws on
    CPU."""
    _require()
    batch, vocab = logits.shape
    k = noise.shape[-1]
    if not (noise.shape == (batch, k) and 0 < k <= min(vocab, MAX_DRAW) and sampled.shape == best.shape == (batch,)):
        raise ValueError(f"residual_draws needs logits [B, V], noise [B, k <= {MAX_DRAW}], sampled and best [B]; "
                         f"got {tuple(logits.shape)}, {tuple(noise.shape)}, {tuple(sampled.shape)}, "
                         f"{tuple(best.shape)}")
    logits, noise = (t if t.dtype == torch.float32 and t.stride(-1) == 1 else t.float().contiguous()
                     for t in (logits, noise))
    sampled = sampled.to(torch.bool).contiguous()
    best = best.to(torch.int64).contiguous()
    codes = torch.empty_like(best) if out is None else out
    if not (codes.dtype == torch.int64 and codes.shape == (batch,) and codes.is_contiguous()):
        raise ValueError(f"residual_draws writes a contiguous int64 [{batch}] out, got {codes.dtype} "
                         f"{tuple(codes.shape)}")
    _function("residual_draws")(batch, vocab, k, logits.data_ptr(), logits.stride(0), noise.data_ptr(),
                                noise.stride(0), sampled.data_ptr(), best.data_ptr(), top_p, codes.data_ptr(),
                                torch.get_num_threads())
    return codes


# -- paged decode attention ---------------------------------------------------------------------------------

MAX_HEAD_DIM = 256  # the C kernel's bound (its per-head vectors live in registers / on the stack)


def supports_decode_attention(dtype: torch.dtype, head_dim: int, device: torch.device) -> bool:
    """Whether ``decode_attention`` serves a cache of this dtype, head size and device."""
    return (
        device.type == "cpu" and dtype in _SUFFIX and head_dim % 16 == 0 and head_dim <= MAX_HEAD_DIM
        and available()
    )


def decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    rows: torch.Tensor,
    reqs: torch.Tensor,
    slots: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Single-query attention read in place from a paged cache, into ``out``.

    q, out [tokens, heads, dim] (out contiguous); kv_cache [2, cache_slots, kv_heads, dim] (q's dtype,
    contiguous); query row ``rows[i]`` belongs to request ``reqs[i]``, which attends to its first ``lens[r]``
    keys at cache slots ``slots[r]``. Scores and the softmax in float32.
    """
    _require()
    tokens, heads, dim = q.shape
    kv_heads = kv_cache.shape[2]
    if not (kv_cache.is_contiguous() and out.is_contiguous() and out.shape == q.shape and kv_cache.dtype == q.dtype
            == out.dtype and heads % kv_heads == 0):
        raise ValueError("decode_attention needs a contiguous cache and output of q's dtype and shape")
    q = q.contiguous()
    rows, reqs, slots, lens = (t.to(torch.int64).contiguous() for t in (rows, reqs, slots, lens))
    max_kv, threads = slots.shape[1], torch.get_num_threads()
    scores = _scratch("scores", threads * max_kv, torch.float32)
    _function(f"decode_attention_{_SUFFIX[q.dtype]}")(
        rows.numel(), heads, kv_heads, dim, q.data_ptr(), rows.data_ptr(), reqs.data_ptr(), kv_cache.data_ptr(),
        kv_cache.shape[1], slots.data_ptr(), lens.data_ptr(), max_kv, scale, out.data_ptr(), scores.data_ptr(),
        threads,
    )


# -- vocoder residual units ---------------------------------------------------------------------------------


def supports_snake_pointwise(x: torch.Tensor) -> bool:
    """Whether ``snake_pointwise`` serves these [B, T, C] signals (CPU, float32, C a multiple of 32)."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.shape[-1] % DOWN_PANEL == 0
            and panels_preferred())


def snake_pointwise(
    h: torch.Tensor, alpha: torch.Tensor, scale: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor,
    x: torch.Tensor,
) -> torch.Tensor:
    """``x += bias + snake(h) W^T`` in place, ``snake(h) = h + (sin(alpha h) scale)^2`` per channel: SnakeBeta then
    a kernel-1 convolution (``pack_linear`` panels of its [C, C] weight) and the residual, in one pass over the
    [B, T, C] float32 signals. Returns ``x``."""
    _require()
    channels = x.shape[-1]
    if not (h.shape == x.shape and x.is_contiguous() and h.dtype == x.dtype == torch.float32
            and panels.shape == (channels // DOWN_PANEL, channels, DOWN_PANEL)):
        raise ValueError("snake_pointwise needs float32 h and contiguous x of one [..., C] shape, C x C panels")
    h = h.contiguous()
    threads = torch.get_num_threads()
    buf = _scratch("snake", threads * _ROWS_MAX * channels, torch.float32)
    args = [t.float().contiguous() for t in (alpha, scale, bias)]
    _function("snake_pointwise_f32")(
        h.numel() // channels, channels, h.data_ptr(), args[0].data_ptr(), args[1].data_ptr(), panels.data_ptr(),
        args[2].data_ptr(), x.data_ptr(), buf.data_ptr(), threads,
    )
    return x


def supports_conv_pairs(weight: torch.Tensor, stride: int) -> bool:
    """Whether ``conv_pairs`` serves a transposed convolution with this [C_in, C_out, 2 * stride] weight: CPU,
    float32, ``stride * C_out`` a multiple of 32 (whole panels), the kernels built here."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 3
            and weight.shape[-1] == 2 * stride and (stride * weight.shape[1]) % DOWN_PANEL == 0 and available())


_PAIRS_ROWS_MAX = 96  # PAIRS_ROWS_MAX in cpu_kernels.c
_PAIRS_JOB_BYTES = 96 << 10  # a job's activated inputs: with the panel they read, within a core's L2


def conv_pairs(x: torch.Tensor, left: torch.Tensor | None, start: torch.Tensor | None,
               snake: tuple[torch.Tensor, torch.Tensor] | None, panels: torch.Tensor, bias: torch.Tensor,
               outputs: int) -> torch.Tensor:
    """A transposed convolution with kernel 2 * stride as one GEMM over consecutive input pairs, in one pass:
    [B, outputs, N] float32 rows ``bias + [a_j, a_{j+1}] W`` (N = stride * C_out, columns (sample, channel)),
    where item b's inputs ``a`` are its ``left`` [B, 1, C] row then its ``x`` [B, TX, C] rows (items with
    ``start[b]``, or all without ``left``: x's rows from the first, the last one repeated past the end), each
    through SnakeBeta ``v + (sin(v alpha) scale)^2`` where ``snake`` = (alpha, scale) is given.
    ``panels``: ``pack_linear`` of the pairs GEMM's [N, 2C] weight; ``bias`` [N] float32."""
    _require()
    batch, length, channels = x.shape
    if not (x.dtype == torch.float32 and panels.shape == (panels.shape[0], 2 * channels, DOWN_PANEL)
            and panels.dtype == torch.float32 and bias.shape == (panels.shape[0] * DOWN_PANEL,)
            and (left is None or left.shape == (batch, 1, channels)) and 0 <= outputs <= length + (left is not None)):
        raise ValueError("conv_pairs needs float32 [B, T, C] rows, [N/32, 2C, 32] panels, a [N] bias and a "
                         "[B, 1, C] left row")
    out = x.new_empty(batch, outputs, bias.shape[0])
    if outputs == 0 or batch == 0:
        return out
    threads = torch.get_num_threads()
    job = max(_ROWS_MAX, min(_PAIRS_ROWS_MAX, _PAIRS_JOB_BYTES // (4 * channels) // 24 * 24))
    buf = _scratch("pairs", threads * (job + 1) * channels, torch.float32)
    x = x.contiguous()
    left = None if left is None else left.contiguous()
    start = None if start is None or left is None else start.to(torch.uint8).contiguous()
    alpha, scale = (None, None) if snake is None else (t.detach().float().contiguous() for t in snake)
    _function("conv_pairs_f32")(
        batch, length, outputs, channels, bias.shape[0], job, x.data_ptr(), 0 if left is None else left.data_ptr(),
        0 if start is None else start.data_ptr(), 0 if alpha is None else alpha.data_ptr(),
        0 if scale is None else scale.data_ptr(), panels.data_ptr(), bias.data_ptr(), out.data_ptr(),
        buf.data_ptr(), threads,
    )
    return out


_LANES_MAX = 16  # the C kernels' vector width is at most this (16 lanes with AVX-512, 8 otherwise)
_SNAKE_TILE = 256 + 4  # snake_conv's output rows per job and the rows its sums read past them (SNAKE_TILE and
# SNAKE_ROWS in cpu_kernels.c)


def supports_snake_conv(x: torch.Tensor, out_channels: int) -> bool:
    """Whether ``snake_conv`` serves these [B, T, C] signals (CPU, float32 or bfloat16, C a multiple of 16) for a
    convolution to ``out_channels`` (few: its sums are per output row)."""
    return (x.device.type == "cpu" and x.dtype in _SUFFIX and x.shape[-1] % _LANES_MAX == 0 and out_channels <= 8
            and available())


def snake_conv(x: torch.Tensor, left: torch.Tensor | None, alpha: torch.Tensor, scale: torch.Tensor,
               weight: torch.Tensor, bias: torch.Tensor | None, dilation: int) -> torch.Tensor:
    """A few-output convolution (stride 1) of SnakeBeta'd rows in one pass: the signal [B, H + T, C] that is
    ``left`` [B, H, C] as it is (None: H = 0) followed by ``x + (sin(x alpha) scale)^2`` [B, T, C] (rounded to
    x's dtype), convolved with ``weight`` [O, C, K] at ``dilation``, plus ``bias`` -> [B, H + T - (K - 1) *
    dilation, O] in x's dtype (sums in float32)."""
    _require()
    batch, length, channels = x.shape
    outputs, _, taps = weight.shape
    held = 0 if left is None else left.shape[1]
    out_length = held + length - (taps - 1) * dilation
    if weight.shape[1] != channels or out_length < 1 or (
            left is not None and (left.shape != (batch, held, channels) or left.dtype != x.dtype)):
        raise ValueError(f"snake_conv: {held} + {length} rows of {channels} channels (left context of x's dtype and "
                         f"channels), weight {tuple(weight.shape)} at dilation {dilation}")
    x = x.contiguous()
    left = None if left is None else left.contiguous()
    w = weight.detach().float().permute(0, 2, 1).contiguous()  # [O, K, C]
    alpha, scale = alpha.detach().float().contiguous(), scale.detach().float().contiguous()
    bias = torch.zeros(outputs) if bias is None else bias.detach().float().contiguous()
    threads = torch.get_num_threads()
    buf = _scratch("snake-conv", threads * (_SNAKE_TILE + (taps - 1) * dilation) * channels, torch.float32)
    out = x.new_empty(batch, out_length, outputs)
    _function(f"snake_conv_{_SUFFIX[x.dtype]}")(
        batch, held, length, channels, taps, dilation, outputs, x.data_ptr(), 0 if left is None else left.data_ptr(),
        alpha.data_ptr(), scale.data_ptr(), w.data_ptr(), bias.data_ptr(), out.data_ptr(), buf.data_ptr(), threads)
    return out


def supports_snake(x: torch.Tensor) -> bool:
    """Whether ``snake`` serves these [B, T, C] rows (CPU, float32 or bfloat16, the kernels built here)."""
    return x.device.type == "cpu" and x.dtype in _SUFFIX and x.dim() == 3 and available()


def snake(x: torch.Tensor, alpha: torch.Tensor, scale: torch.Tensor, context: torch.Tensor | None = None
          ) -> torch.Tensor:
    """SnakeBeta ``x + (sin(x alpha) scale)^2`` over [B, T, C] rows (rounded to x's dtype) with ``snake_conv``'s
    arithmetic, after ``context`` [B, H, C] (as it is) where given: [B, H + T, C] in one pass."""
    _require()
    batch, length, channels = x.shape
    held = 0 if context is None else context.shape[1]
    if context is not None and (context.dim() != 3 or context.shape[::2] != (batch, channels)
                                or context.dtype != x.dtype):
        raise ValueError(f"context must be [{batch}, H, {channels}] {x.dtype}, got {tuple(context.shape)} "
                         f"{context.dtype}")
    x = x.contiguous()
    context = None if context is None else context.contiguous()
    alpha, scale = alpha.detach().float().contiguous(), scale.detach().float().contiguous()
    out = x.new_empty(batch, held + length, channels)
    _function(f"snake_rows_{_SUFFIX[x.dtype]}")(batch, held, length, channels,
                                               0 if context is None else context.data_ptr(), x.data_ptr(),
                                               alpha.data_ptr(), scale.data_ptr(), out.data_ptr(),
                                               torch.get_num_threads())
    return out


def snake_kept(left: torch.Tensor, x: torch.Tensor, valid: int | torch.Tensor,
               snake: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """A stream's next left context [B, H, C] for ``snake_conv``: item b's rows ``valid[b]`` .. ``valid[b] + H -
    1`` of [left; SnakeBeta(x)] (left [B, H, C] as it is, x [B, T, C]; ``valid``: one int or a [B] integer
    tensor; ``snake`` = (alpha, scale)), x's rows activated as ``snake_conv`` activates them, so the next chunk reads
    what one-shot decoding reads (``amx_kernels.snake_kept`` for the AMX convolutions)."""
    _require()
    left, x, valid, kept = amx_kernels.kept_arguments(left, x, valid)
    (batch, held, channels), length = kept.shape, x.shape[1]
    alpha, scale = (t.detach().float().contiguous() for t in snake)
    _function(f"snake_kept_{_SUFFIX[x.dtype]}")(batch, held, length, channels, left.data_ptr(), x.data_ptr(),
                                               valid.data_ptr(), alpha.data_ptr(), scale.data_ptr(), kept.data_ptr())
    return kept


# -- Qwen3 decoder layers in one call: the code predictor's passes, the paged decoders' decode steps ----------

_LAYER_WIDTH = 21  # the C table's entries per layer (enum L_* in cpu_kernels.c)
_BUFFERS = 40  # the C kernel's buffer addresses (enum B_*)
_QUANT_BITS = {"qkv": 1, "o": 4, "gate_up": 8, "down": 9, "experts": 12}  # L_QUANT's / L_AMX's bit per entry (L_*)
MAX_EXPERTS = 512  # the C router's bound


EXPERTS_ON_AMX_RATIO = 4  # routed experts on AMX tiles where num_experts <= this x top_k (experts_take_amx)


def experts_take_amx(rows: torch.dtype, experts: tuple[Weight, Weight], hidden: int, num_experts: int,
                     top_k: int) -> bool:
    """Whether a decoder's routed experts run on AMX tiles in the decoder kernels (``amx_phase_experts``): float32
    rows on bfloat16 pair panels (a float32 model whose weights are bfloat16 values), widths a multiple of 32, an
    AMX CPU, and few experts for the selections (num_experts <= EXPERTS_ON_AMX_RATIO x top_k: a 16-token step then
    gives each expert ~4 rows, where the FMA panels are compute-bound; the released 128-expert layers keep them,
    their ~1-row experts memory-bound either way). Decided per layer, never per batch: a row's bits do not depend
    on its batch mates."""
    up = experts[0]
    return (rows == torch.float32 and all(isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 for t in experts)
            and hidden % 32 == 0 and up.shape[1] * UP_PANEL % 32 == 0 and num_experts <= EXPERTS_ON_AMX_RATIO * top_k
            and amx_kernels.available())


def supports_decoder_layers(dtype: torch.dtype, hidden: int, head_dim: int) -> bool:
    """Whether ``DecoderPass`` / ``decoder_step`` serve a Qwen3 decoder of this dtype and shape on the CPU
    (float32 or bfloat16 (see ``widened_bf16_decoders``); hidden size a multiple of 32)."""
    return (
        hidden % DOWN_PANEL == 0 and head_dim % 2 == 0 and head_dim <= MAX_HEAD_DIM and panels_preferred()
        and dtype in _SUFFIX
    )


Weight = torch.Tensor | KernelWeight | AmxWeight  # panels, a quantized weight, or an AMX weight (their words)


@dataclass(frozen=True)
class LayerWeights:
    """One Qwen3 decoder layer as the decoder kernels read it: norm weights float32 ([H], q/k norms [D]),
    panels from ``pack_linear`` (q/k/v stacked; gate rows before up rows) or ``pack_experts``, all contiguous.
    The MLP is ``gate_up``/``down`` (dense, ``intermediate`` wide), or routed ``experts`` chosen by ``router``
    (``top_k`` of ``num_experts``, weights renormalised with ``norm_topk``) plus, where ``gate_up`` is given too, a
    shared expert scaled by the sigmoid of ``shared_gate`` (a 1-output linear layer). q/k/v, o, the MLP's
    gate/up and down and the experts (both or neither) may instead be quantized weights (``KernelWeight``:
    quant_kernels' phases run them); q/k/v, o, gate/up and down may be AMX weights (``AmxWeight``: amx_kernels'
    phase runs them), and the experts' bfloat16 pair panels AMX tiles (``experts_on_amx``); the router and the
    shared gate are panels."""

    input_norm: torch.Tensor
    qkv: Weight
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    o: Weight
    post_norm: torch.Tensor
    gate_up: Weight | None = None
    down: Weight | None = None
    intermediate: int = 0
    router: torch.Tensor | None = None
    experts: tuple[Weight, Weight] | None = None
    num_experts: int = 0
    top_k: int = 0
    norm_topk: bool = False
    shared_gate: torch.Tensor | None = None
    experts_on_amx: bool = False  # the experts' bfloat16 pair panels as AMX tiles (float32 rows; experts_take_amx)

    def __post_init__(self) -> None:
        tensors = [self.input_norm, self.qkv, self.q_norm, self.k_norm, self.o, self.post_norm]
        tensors += [t for t in (self.gate_up, self.down, self.router, self.shared_gate) if t is not None]
        tensors += list(self.experts or ())
        tensors = [t.data if isinstance(t, (KernelWeight, AmxWeight)) else t for t in tensors]
        if not all(t.is_contiguous() and t.device.type == "cpu" for t in tensors):
            raise ValueError("decoder layer weights must be contiguous CPU tensors")
        if self.experts is not None and len({isinstance(t, KernelWeight) for t in self.experts}) != 1:
            raise ValueError("routed experts are quantized both (gate/up and down) or neither")
        if not all(isinstance(t, torch.Tensor) for t in (*(self.experts or ()), self.router, self.shared_gate)
                   if t is not None and not isinstance(t, KernelWeight)):
            raise ValueError("the experts, router and shared gate are panels or quantized weights, not AMX weights")
        if isinstance(self.router, KernelWeight) or isinstance(self.shared_gate, KernelWeight):
            raise ValueError("the router and the shared expert's gate are panels, not quantized weights")
        if (self.gate_up is None) != (self.down is None) or (self.gate_up is not None and self.intermediate <= 0):
            raise ValueError("a dense MLP or shared expert needs gate_up, down and its intermediate size")
        if self.router is None:
            if self.gate_up is None or self.experts is not None:
                raise ValueError("a layer without a router needs a dense MLP and no experts")
        elif self.experts is None or not 0 < self.top_k <= self.num_experts <= MAX_EXPERTS:
            raise ValueError(f"routed experts need their panels and 0 < top_k <= num_experts <= {MAX_EXPERTS}")
        elif (self.shared_gate is None) != (self.gate_up is None):
            raise ValueError("a shared expert needs both its MLP and its gate")
        if self.experts_on_amx and not (self.experts is not None and all(
                isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 for t in self.experts)):
            raise ValueError("experts on AMX tiles are bfloat16 pair panels")

    def quantized(self) -> dict[str, KernelWeight]:
        """The layer's quantized weights by entry (``experts``: the gate/up one, its down beside it)."""
        named = {"qkv": self.qkv, "o": self.o, "gate_up": self.gate_up, "down": self.down,
                 "experts": self.experts[0] if self.experts else None}
        return {name: w for name, w in named.items() if isinstance(w, KernelWeight)}

    def panels(self) -> list[torch.Tensor]:
        """The layer's weights in panel layout (neither quantized nor AMX weights)."""
        weights = (self.qkv, self.o, self.gate_up, self.down, self.router, self.shared_gate, *(self.experts or ()))
        return [w for w in weights if isinstance(w, torch.Tensor)]

    def amx(self) -> dict[str, AmxWeight]:
        """The layer's AMX weights by entry."""
        named = {"qkv": self.qkv, "o": self.o, "gate_up": self.gate_up, "down": self.down}
        return {name: w for name, w in named.items() if isinstance(w, AmxWeight)}

    def entries(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> list[int]:
        def address(t: Weight | None) -> int:
            if t is None:
                return 0
            return t.words.data_ptr() if isinstance(t, (KernelWeight, AmxWeight)) else t.data_ptr()

        up, down = self.experts or (None, None)
        expert_inter = 0 if up is None else down.inputs if isinstance(down, KernelWeight) else up.shape[1] * UP_PANEL
        quant = sum(1 << _QUANT_BITS[name] for name in self.quantized())
        return [address(t) for t in (self.input_norm, self.qkv, self.q_norm, self.k_norm, self.o, self.post_norm,
                                     k_cache, v_cache, self.gate_up, self.down)] + [
            self.intermediate, address(self.router), address(up), address(down), self.num_experts, self.top_k,
            expert_inter, int(self.norm_topk), address(self.shared_gate), quant,
            sum(1 << _QUANT_BITS[name] for name in self.amx()) | int(self.experts_on_amx) << _QUANT_BITS["experts"]]

    def amx_channels(self) -> int:
        """The most (padded) inputs an AMX tile product of this layer reads (0: none): its AMX weights', and with
        the experts on AMX tiles the hidden size and their intermediate."""
        widths = [w.padded_channels for w in self.amx().values()]
        if self.experts_on_amx:
            widths += [self.input_norm.shape[0], self.experts[0].shape[1] * UP_PANEL]
        return max(widths, default=0)


@dataclass(frozen=True)
class LayerTable:
    """``decoder_table``'s result: the kernel's per-layer addresses and the scratch sizes they need. The weights
    and caches it was built from must outlive its use."""

    addresses: torch.Tensor  # [L, _LAYER_WIDTH] int64
    gate_up_width: int  # widest dense / shared gate/up output (padded)
    intermediate: int  # widest dense / shared intermediate
    experts: int  # most routed experts, most selections per row, widest expert intermediate
    top_k: int
    expert_intermediate: int  # widest expert intermediate in panels
    quant_inputs: int = 0  # quantized weights (0: none): the most inputs, outputs (experts: 2I) and expert
    quant_outputs: int = 0  # intermediate among them, which size their phases' scratch
    quant_intermediate: int = 0
    amx_channels: int = 0  # the most (padded) inputs of an AMX weight (0: none), which sizes its phase's scratch
    weights: torch.dtype | None = None  # the panels' dtype (bfloat16 pairs in a float32 model); None: no panels

    def part(self, start: int, stop: int) -> LayerTable:
        """Layers ``start`` .. ``stop - 1`` only."""
        return replace(self, addresses=self.addresses[start:stop])


def decoder_table(layers: list[LayerWeights], caches: list[tuple[torch.Tensor, torch.Tensor]]) -> LayerTable:
    """The kernels' table for ``layers`` over per-layer (K cache, V cache) of the model's dtype, contiguous:
    the code predictor's [B, Q, kv_heads, head_dim] pairs, or a paged cache's ``cache[0]``, ``cache[1]``."""
    if len(layers) != len(caches) or not all(k.is_contiguous() and v.is_contiguous() for k, v in caches):
        raise ValueError("one contiguous (K, V) cache pair per layer")
    rows = [layer.entries(k, v) for layer, (k, v) in zip(layers, caches)]
    dtypes = {t.dtype for layer in layers for t in layer.panels()}
    if len(dtypes) > 1:
        raise ValueError(f"one decoder's panels are of one dtype (the kernel's variant), got {sorted(map(str, dtypes))}")
    return LayerTable(
        addresses=torch.tensor(rows, dtype=torch.int64).reshape(len(layers), _LAYER_WIDTH),
        gate_up_width=max((_round_up(2 * w.intermediate, DOWN_PANEL) for w in layers), default=0),
        intermediate=max((w.intermediate for w in layers), default=0),
        experts=max((w.num_experts for w in layers), default=0),
        top_k=max((w.top_k for w in layers), default=0),
        expert_intermediate=max((w.experts[0].shape[1] * UP_PANEL for w in layers
                                 if w.experts and "experts" not in w.quantized()), default=0),
        **_quant_sizes(layers),
        amx_channels=max((layer.amx_channels() for layer in layers), default=0),
        weights=next(iter(dtypes), None),
    )


def _quant_sizes(layers: list[LayerWeights]) -> dict[str, int]:
    weights = [(name, w) for layer in layers for name, w in layer.quantized().items()]
    return dict(quant_inputs=max((w.inputs for _, w in weights), default=0),
                quant_outputs=max((w.rows for _, w in weights), default=0),
                quant_intermediate=max((w.rows // 2 for name, w in weights if name == "experts"), default=0))


def _layer_workspace(x: torch.Tensor, table: LayerTable, qkv_width: int, attn_width: int, threads: int,
                     rows_max: int) -> tuple[list[torch.Tensor], list[int]]:
    """This thread's scratch for a decoder-kernel call on x's rows (bufs B_GEO..B_ONES) and its addresses, kept
    per shape (building them on every call cost ~0.1 ms of the ~1.4 ms a code-predictor pass takes)."""
    rows, hidden = x.numel() // x.shape[-1], x.shape[-1]
    selections = rows * table.top_k

    def make() -> list[torch.Tensor]:
        typed = [rows * width for width in (hidden, qkv_width, attn_width, max(table.gate_up_width, hidden),
                                            table.intermediate, _round_up(table.experts, DOWN_PANEL), DOWN_PANEL,
                                            hidden)] + [selections * table.expert_intermediate]
        return [torch.empty(4 * rows, dtype=torch.int64), *(torch.empty(n, dtype=x.dtype) for n in typed),
                torch.empty(threads * rows_max * DOWN_PANEL), torch.empty(selections),
                torch.empty(selections, dtype=torch.int64),
                torch.empty(2 * selections + 2 * table.experts + 2, dtype=torch.int64),
                torch.empty(threads * 2 * rows_max, dtype=torch.int64), torch.ones(rows_max)]

    return _kept("layers", (x.dtype, rows, hidden, qkv_width, attn_width, threads, table.gate_up_width,
                            table.intermediate, table.experts, table.top_k, table.expert_intermediate), make)


def _quant_workspace(rows: int, table: LayerTable) -> tuple[list[torch.Tensor], list[int]]:
    """bufs B_QLINEAR..B_QWHERE: quant_kernels' phases and their scratch for rows (zeros: nothing quantized)."""
    if not table.quant_inputs:
        return [], [0] * 7
    inputs, inter, selections = table.quant_inputs, table.quant_intermediate, rows * max(table.top_k, 1)

    def make() -> list[torch.Tensor]:
        most = max(rows, selections)  # (a MoE phase's rows are its selections)
        return [torch.empty(most * (inputs + 2 * (inputs // 32))), torch.empty(most * table.quant_outputs),
                torch.empty(selections * (inter + 2 * (inter // 32))), torch.empty(table.experts + 1, dtype=torch.int64),
                torch.empty(selections, dtype=torch.int64)]

    buffers, addresses = _kept("quant-layers", (rows, inputs, table.quant_outputs, inter, table.top_k, table.experts),
                               make)
    return buffers, [*quant_kernels.phase_addresses(), *addresses]


def _amx_workspace(rows: int, table: LayerTable, threads: int) -> tuple[list[torch.Tensor], list[int]]:
    """bufs B_AMX..B_AMX_EXPERTS: amx_kernels' phases, their scratch and one thread's share (zeros: no AMX)."""
    if not table.amx_channels:
        return [], [0] * 4
    stride = amx_kernels.phase_scratch(rows, table.amx_channels)
    planes = _scratch("amx-phase", threads * stride, torch.bfloat16)
    return [planes], [amx_kernels.phase_address(), planes.data_ptr(), stride, amx_kernels.experts_address()]


@dataclass
class _LayersCall:
    """A ``decoder_layers_*`` call's arguments, kept with every buffer they point to (``call`` runs it)."""

    function: Any
    dims: Any  # ctypes int64[15]
    bufs: Any  # ctypes int64[_BUFFERS]
    layers: int
    args: tuple  # the rest: table addresses, eps, scale, threads
    keep: list[torch.Tensor]

    def call(self) -> None:
        self.function(self.dims, self.args[0], self.layers, self.bufs, *self.args[1:])


_DIM_POSITION = 11  # dims[11]: a frame's first position (geometry[3])
_B_HEAD, _B_PICKS = 25, 27  # bufs' entries B_HEAD (the head's panels) and B_PICKS (enum B_*)


def _layers_call(
    x: torch.Tensor, table: LayerTable, heads: int, kv_heads: int, head_dim: int, rope: tuple[torch.Tensor, ...],
    max_kv: int, geometry: list[int], inputs: list[int], head: list[int], eps: float,
    weights: torch.dtype | None = None,
) -> _LayersCall:
    """The ``decoder_layers_*`` call's arguments; ``geometry``: dims[8:], ``inputs``: bufs B_PUT..B_SLOTS,
    ``head``: the rest; ``weights``: the panels' dtype (the table's, else the head's; default x's)."""
    if not (x.is_contiguous() and x.device.type == "cpu" and heads % kv_heads == 0):
        raise ValueError("the decoder kernel needs contiguous CPU rows and query heads a multiple of kv heads")
    threads, rows = torch.get_num_threads(), x.numel() // x.shape[-1]
    qkv_width = _round_up((heads + 2 * kv_heads) * head_dim, DOWN_PANEL)
    rows_max = max(rows, rows * table.top_k)
    workspace, scratch = _layer_workspace(x, table, qkv_width, heads * head_dim, threads, rows_max)
    scores = _scratch("layers-scores", threads * max_kv, torch.float32)
    cos, sin = (t.float().contiguous() for t in rope)
    quant, quant_addresses = _quant_workspace(rows, table)
    amx, amx_addresses = _amx_workspace(rows, table, threads)
    dims = (ctypes.c_int64 * 15)(rows, x.shape[-1], heads, kv_heads, head_dim, qkv_width, rows_max, max_kv,
                                 *geometry)
    bufs = (ctypes.c_int64 * _BUFFERS)(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), *inputs, *scratch,
                                       scores.data_ptr(), *head, *quant_addresses, *amx_addresses)
    function = _function(f"decoder_layers_{_layers_suffix(x.dtype, x.shape[-1], weights or table.weights)}")
    return _LayersCall(function, dims, bufs, table.addresses.shape[0],
                       (table.addresses.data_ptr(), eps, head_dim**-0.5, threads),
                       [x, cos, sin, table.addresses, *workspace, scores, *quant, *amx])


def _run_layers(*args, **kwargs) -> None:
    """``_layers_call``'s call, run once."""
    _layers_call(*args, **kwargs).call()


class DecoderPass:
    """Every layer of a small Qwen3 decoder (RMSNorm, q/k/v, q/k norms, rotary, causal attention over a
    per-request cache of the frame's positions, o, RMSNorm, MLP, residuals) for a pass, in one call, in place
    on the rows x [B, S, H] (request b's rows at positions first_position .. first_position + S - 1; their keys
    and values are written to the caches). The code predictor makes 15 passes per frame; as separate ops, each
    layer of a pass is ~15 calls on 16 rows, each with its own dispatch and thread fork/join.

    Built once over one row buffer and run for many passes (the call's arguments: ~60 us a pass when built per
    pass, ~7% of a 16-row float32 code-predictor frame); ``run`` sets the pass's position (and head) and runs it,
    the caller writing the pass's rows into ``x`` first. It keeps this thread's scratch buffers: run it on the
    thread that built it.

    ``table``: ``decoder_table``'s over caches [B, Q, kv_heads, head size]; ``shape``: (query heads, key/value
    heads, head size, cache length Q); ``rope``: (cos, sin) [Q, head size], the values the model uses (any
    float dtype); ``eps``: the norms' epsilon. With ``head`` = (final norm weight float32 [H], the heads' panels
    dtype, vocabulary size), each request's last row also takes the final norm and a head (``run``'s panels, from
    ``pack_linear``) in the same call, and ``run`` returns its logits [B, vocabulary] in x's dtype (valid until
    the next run) and writes the argmax picks (int64, the first of equal maxima, as ``torch.argmax``). Where the
    layers have AMX weights, bfloat16 pair panels of a hidden size that is a multiple of 32 are read as AMX
    weights (the same layout) at every batch size: the released code predictor's frame at 16 rows in bfloat16
    0.86x the time, float32 0.99x."""

    def __init__(self, x: torch.Tensor, table: LayerTable, shape: tuple[int, int, int, int],
                 rope: tuple[torch.Tensor, torch.Tensor], eps: float,
                 head: tuple[torch.Tensor, torch.dtype, int] | None = None) -> None:
        _require()
        batch, self.rows_per_request, hidden = x.shape
        heads, kv_heads, head_dim, self.positions = shape
        vocab, head_ptrs, self.logits = 0, [0] * 5, None
        self.head_dtype = None if head is None else head[1]
        if head is not None:
            norm, panels_dtype, vocab = head
            if (norm.dtype != torch.float32 or not rows_take(x.dtype, panels_dtype)
                    or table.weights not in (None, panels_dtype)):
                raise ValueError("the head needs a float32 norm weight and panels of the layers' dtype (x's, or "
                                 "bfloat16 pairs for float32 rows)")
            padded = _round_up(vocab, DOWN_PANEL)
            logits = x.new_empty(batch, padded)
            last = _scratch(f"pass-last-{x.dtype}", batch * hidden, x.dtype)
            head_ptrs = [norm.data_ptr(), 0, logits.data_ptr(), 0, last.data_ptr()]
            self.logits, self._head = logits[:, :vocab], [norm, logits, last]
        geometry = [0, batch, self.rows_per_request, 0, self.positions, vocab, _round_up(vocab, DOWN_PANEL)]
        self.x, self.hidden = x, hidden
        self._call = _layers_call(x, table, heads, kv_heads, head_dim, rope, self.positions, geometry, [0] * 4,
                                  head_ptrs, eps, self.head_dtype)

    def run(self, first_position: int, panels: torch.Tensor | None = None,
            picks: torch.Tensor | None = None) -> torch.Tensor | None:
        """The pass over ``x``'s rows at ``first_position``; with a head, its ``pack_linear`` panels and the
        picks' destination (int64 [B], contiguous). Returns the head's logits (None without a head)."""
        if first_position + self.rows_per_request > self.positions:
            raise ValueError("a pass's rows must lie within the cache's positions")
        self._call.dims[_DIM_POSITION] = first_position
        if self.logits is not None:
            if (panels is None or panels.dim() != 3 or panels.dtype != self.head_dtype
                    or panels.shape[1] != self.hidden or panels.shape[0] * DOWN_PANEL != self._head[1].shape[1]):
                raise ValueError("the head's panels are pack_linear's of the pass's dtype over the hidden size, "
                                 "for the vocabulary it was built for")
            if picks is None or picks.dtype != torch.int64 or picks.shape != (self.x.shape[0],) \
                    or not picks.is_contiguous():
                raise ValueError("the picks go to a contiguous int64 tensor of one entry per request")
            self._call.bufs[_B_HEAD] = panels.data_ptr()
            self._call.bufs[_B_PICKS] = picks.data_ptr()
        self._call.call()
        return self.logits


def decoder_step(
    x: torch.Tensor, table: LayerTable, shape: tuple[int, int, int], rope: tuple[torch.Tensor, torch.Tensor],
    slot_mapping: torch.Tensor, row_request: torch.Tensor, seq_lens: torch.Tensor, kv_slots: torch.Tensor,
    eps: float, final_norm: torch.Tensor | None = None, head: tuple[torch.Tensor, int] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Every layer of a paged Qwen3(-MoE) decoder for a decode step, in one call, in place on x [R, H]: row r
    (one query each) writes its key and value at cache slot ``slot_mapping[r]`` and attends to the first
    ``seq_lens[q]`` slots of ``kv_slots[q]``, q = ``row_request[r]`` (``AttentionMetadata``'s decode group).
    ``table``: ``decoder_table``'s over the paged caches' K and V halves; ``shape``: (query heads, key/value
    heads, head size); ``rope``: (cos, sin) [R, head size] of the rows. Returns x: the last layer's output, or
    with ``final_norm`` (float32 [H], the decoder's final RMSNorm weight) that output normed, in the same call
    (as separate ops, a 1-row step's norm cost 0.15 ms after the layers had streamed their weights). With
    ``head`` = (``pack_linear`` panels of an output head that ``head_takes``, vocabulary size) too, every row's
    logits in the same call, with ``linear``'s bits on those panels: returns (x, logits [R, vocabulary] in x's
    dtype)."""
    _require()
    heads, kv_heads, head_dim = shape
    rows = x.shape[0]
    if not (slot_mapping.numel() >= rows and row_request.numel() == rows and rope[0].shape[0] == rows):
        raise ValueError("decoder_step needs a slot, a request and rotary values for every row")
    if final_norm is not None and not (final_norm.dtype == torch.float32 and final_norm.shape == (x.shape[-1],)
                                       and final_norm.is_contiguous()):
        raise ValueError("decoder_step's final norm weight is float32 [hidden], contiguous")
    if head is not None and (final_norm is None or not head_takes(table, x.dtype, head[0])
                             or head[0].shape[1] != x.shape[-1]):
        raise ValueError("decoder_step's head follows the final norm, on panels the layers' kernel reads")
    inputs = [t.to(torch.int64).contiguous() for t in (slot_mapping, row_request, seq_lens, kv_slots)]
    head_ptrs, vocab, out = [0] * 5, 0, None
    if final_norm is not None:
        head_ptrs[0] = final_norm.data_ptr()
    if head is not None:
        panels, vocab = head
        logits = x.new_empty(rows, panels.shape[0] * DOWN_PANEL)
        head_ptrs[1:3] = [panels.data_ptr(), logits.data_ptr()]
        out = logits[:, :vocab]
    geometry = [1, 0, 0, 0, 0, vocab, 0 if head is None else head[0].shape[0] * DOWN_PANEL]
    _run_layers(x, table, heads, kv_heads, head_dim, rope, kv_slots.shape[1], geometry,
                [t.data_ptr() for t in inputs], head_ptrs, eps, None if head is None else head[0].dtype)
    return x if out is None else (x, out)


def head_takes(table: LayerTable, rows: torch.dtype, panels: torch.Tensor) -> bool:
    """Whether ``decoder_step`` can run an output head on these ``pack_linear`` panels after the table's layers:
    the layers' kernel variant reads them (panels of the layers' dtype, or any the rows take where the layers
    have none) over the hidden size."""
    return (panels.dim() == 3 and rows_take(rows, panels.dtype) and table.weights in (None, panels.dtype)
            and int(table.addresses.shape[0]) > 0)
