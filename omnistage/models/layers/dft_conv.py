"""Wide causal convolutions as products of small DFTs (``csrc/dft_conv.c`` around torch's batched GEMM).

A vocoder's convolutions of 7 taps at hundreds of channels are most of its arithmetic (Qwen3-Omni's Code2Wav at
decoder width 1536: about 44 of its 62 GFLOP per second of audio) and run at the GEMM peak already, so only
fewer multiplications make them faster. Cut into blocks of ``BLOCK`` inputs, a convolution is a product per
frequency of the blocks' transforms (overlap-save; a dilated convolution is ``dilation`` plain ones on
interleaved rows), and the complex products take three real ones each (Gauss), so each output costs 1.8
multiply-adds per weight instead of 7: one batched GEMM of ``planes(BLOCK)`` planes, the blocks' transforms
before it and the inverse transforms after it done by the C kernels (float32 arithmetic).

The weight's transform is made for each call, into a buffer of that call, not kept (at the released widths it is 6.7 times the weight's
bytes: one copy of the weights is held, as everywhere else): where a call has too few rows to pay for it
(``takes``), the direct convolution serves. Results differ from the direct convolution's by float rounding
(~1e-6 relative in float32; bfloat16 planes round the products' inputs, as bfloat16 convolutions do).
"""

from __future__ import annotations

import ctypes
import math
from pathlib import Path

import torch

from omnistage.models.layers.c_build import LazyLibrary, build_library

_SOURCE = Path(__file__).with_name("csrc") / "dft_conv.c"
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
BLOCK = 32  # inputs per block (the C kernels take up to 64); 26 outputs a block for 7 taps
BLOCKS_PER_GEMM = 128  # blocks per batched GEMM: its planes stay a few MB, in the last-level cache from one pass to the next
# Where the transforms pay (measured, AMD EPYC Zen 4, 2 threads: 7 taps; see tests/benchmarks):
MIN_CHANNELS = 96  # fewer input or output channels: the transforms cost more than the GEMM saves
MIN_ROWS = 1024  # fewer outputs in a call: the weight's transform costs more than the GEMM saves


def _build() -> ctypes.CDLL:
    library = build_library(_SOURCE)
    pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    for suffix in _SUFFIX.values():
        forward = getattr(library, f"dft_forward_{suffix}")
        forward.restype, forward.argtypes = None, [i64] * 8 + [pointer] * 3 + [i32]
        inverse = getattr(library, f"dft_inverse_{suffix}")
        inverse.restype, inverse.argtypes = None, [i64] * 7 + [pointer] * 5 + [i32]
        weight = getattr(library, f"dft_weight_{suffix}")
        weight.restype, weight.argtypes = None, [i64] * 4 + [pointer] * 3 + [i32]
    return library


_lazy = LazyLibrary(_build, "DFT convolution kernels", "wide convolutions stay direct")
_TWIDDLES: dict[int, torch.Tensor] = {}


def planes(block: int) -> int:
    """GEMM planes per block of ``block`` inputs: two real frequencies, three products per complex one."""
    return 2 + 3 * (block // 2 - 1)


def _twiddles(block: int) -> torch.Tensor:
    """cos(2 pi q / block) for q < block, then sin: computed in float64, rounded once."""
    if block not in _TWIDDLES:
        angle = 2 * math.pi * torch.arange(block, dtype=torch.float64) / block
        _TWIDDLES[block] = torch.cat((angle.cos(), angle.sin())).float()
    return _TWIDDLES[block]


def takes(padded: torch.Tensor, weight: torch.Tensor, dilation: int, outputs: int) -> bool:
    """Whether this path serves a stride-1, ungrouped convolution of ``weight`` [C_out, C_in, K] over
    ``padded`` [B, T_in, C_in] giving ``outputs`` rows per item: CPU rows of float32 or bfloat16, 2 <= K <=
    BLOCK / 2, at least ``MIN_CHANNELS`` channels in and out, at least ``MIN_ROWS`` outputs in all."""
    taps = weight.shape[-1]
    return (padded.device.type == "cpu" and padded.dtype in _SUFFIX and weight.dtype == padded.dtype
            and 2 <= taps <= BLOCK // 2 and min(weight.shape[0], weight.shape[1]) >= MIN_CHANNELS
            and padded.shape[0] * outputs >= MIN_ROWS and dilation >= 1 and _lazy.available())


def conv(padded: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dilation: int,
         residual: torch.Tensor | None = None) -> torch.Tensor:
    """The causal convolution of ``weight`` [C_out, C_in, K] (``dilation``) over ``padded`` [B, T + (K - 1)
    dilation, C_in] (each item's left context included) -> [B, T, C_out], plus ``bias`` and ``residual`` [B,
    T, C_out] where given."""
    library = _lazy.require()
    suffix = _SUFFIX[padded.dtype]
    out_channels, in_channels, taps = weight.shape
    items, length, _ = padded.shape
    outputs = length - (taps - 1) * dilation
    if outputs < 1:
        raise ValueError(f"{length} rows hold no output of a {taps}-tap convolution at dilation {dilation}")
    padded, weight = padded.contiguous(), weight.detach().contiguous()
    bias = None if bias is None else bias.detach().float().contiguous()
    if residual is not None:
        residual = residual.contiguous()
    threads = torch.get_num_threads()
    count = planes(BLOCK)
    twiddles = _twiddles(BLOCK)
    # The weight's planes, this call's: [P, C_in, C_out]
    # Fresh buffers each call (the allocator keeps freed large blocks for the next): a thread's cached buffer made
    # under inference mode could not be written by a later call outside it.
    weights = padded.new_empty(count, in_channels, out_channels)
    getattr(library, f"dft_weight_{suffix}")(out_channels, in_channels, taps, BLOCK, weight.data_ptr(),
                                             twiddles.data_ptr(), weights.data_ptr(), threads)
    per_block = BLOCK - taps + 1
    # Each item's own blocks (none spans two items): per dilation phase, enough for its outputs
    blocks = items * -(-outputs // (per_block * dilation)) * dilation
    out = padded.new_empty(items, outputs, out_channels)
    forward, inverse = getattr(library, f"dft_forward_{suffix}"), getattr(library, f"dft_inverse_{suffix}")
    step = min(BLOCKS_PER_GEMM, blocks)
    inputs = padded.new_empty(count * step * in_channels)
    products = padded.new_empty(count * step * out_channels)
    for first in range(0, blocks, step):
        n = min(step, blocks - first)
        x = inputs[: count * n * in_channels].view(count, n, in_channels)
        y = products[: count * n * out_channels].view(count, n, out_channels)
        forward(length, outputs, in_channels, first, n, BLOCK, per_block, dilation, padded.data_ptr(),
                twiddles.data_ptr(), x.data_ptr(), threads)
        torch.bmm(x, weights, out=y)
        inverse(outputs, out_channels, first, n, BLOCK, taps, dilation, y.data_ptr(),
                twiddles.data_ptr(), 0 if bias is None else bias.data_ptr(),
                0 if residual is None else residual.data_ptr(), out.data_ptr(), threads)
    return out
