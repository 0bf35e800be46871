"""Wide causal convolutions as products of small DFTs (``cpu_kernels``' transforms around torch's batched GEMM).

A vocoder's convolutions of 7 taps at hundreds of channels are most of its arithmetic (Qwen3-Omni's Code2Wav at
decoder width 1536: about 44 of its 62 GFLOP per second of audio) and run at the GEMM peak already, so only
fewer multiplications make them faster. Cut into blocks of ``BLOCK`` inputs, a convolution is a product per
frequency of the blocks' transforms (overlap-save; a dilated convolution is ``dilation`` plain ones on
interleaved rows), and the complex products take three real ones each (Gauss), so each output costs 1.8
multiply-adds per weight instead of 7: one batched GEMM of ``planes(BLOCK)`` planes, the blocks' transforms
before it and the inverse transforms after it done by the CPU kernels (float32 arithmetic). SnakeBeta before
the convolution is applied as the blocks read their rows (``snake``: the activated signal is never stored).

The weight's transform is made for each call, into a buffer of that call, not kept (at the released widths it
is 6.7 times the weight's bytes: one copy of the weights is held, as everywhere else): where a call has too few
rows to pay for it (``takes``), the direct convolution serves. Results differ from the direct convolution's by float rounding
(~1e-6 relative in float32; bfloat16 planes round the products' inputs, as bfloat16 convolutions do).
"""

from __future__ import annotations

import functools
import math

import torch

from omnistage.models.layers import cpu_kernels

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
BLOCK = 32  # inputs per block (the C kernels take up to 64); 26 outputs a block for 7 taps
BLOCKS_PER_GEMM = 512  # blocks per batched GEMM (128 and 256 measured no faster on streamed Code2Wav calls)
# Where the transforms pay (measured, AMD EPYC Zen 4, 2 threads: 7 taps; see tests/benchmarks):
MIN_CHANNELS = 64  # fewer input or output channels: the transforms cost more than the GEMM saves
MIN_ROWS = 1024  # fewer outputs in a call: the weight's transform costs more than the GEMM saves


def planes(block: int) -> int:
    """GEMM planes per block of ``block`` inputs: two real frequencies, three products per complex one."""
    return 2 + 3 * (block // 2 - 1)


@functools.cache
def _twiddles(block: int) -> torch.Tensor:
    """cos(2 pi q / block) for q < block, then sin: computed in float64, rounded once."""
    angle = 2 * math.pi * torch.arange(block, dtype=torch.float64) / block
    return torch.cat((angle.cos(), angle.sin())).float()


def takes(rows: torch.Tensor, weight: torch.Tensor, dilation: int, outputs: int) -> bool:
    """Whether this path serves a stride-1, ungrouped convolution of ``weight`` [C_out, C_in, K] over ``rows``
    [B, T_in, C_in] (with their left context or without: ``conv``'s two forms) giving ``outputs`` rows per item:
    CPU rows of float32 or bfloat16, 2 <= K <= BLOCK / 2, at least ``MIN_CHANNELS`` channels in and out, at least
    ``MIN_ROWS`` outputs in all."""
    taps = weight.shape[-1]
    return (rows.device.type == "cpu" and rows.dtype in _SUFFIX and weight.dtype == rows.dtype
            and 2 <= taps <= BLOCK // 2 and min(weight.shape[0], weight.shape[1]) >= MIN_CHANNELS
            and rows.shape[0] * outputs >= MIN_ROWS and dilation >= 1 and cpu_kernels.available())


def conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dilation: int,
         residual: torch.Tensor | None = None, left: torch.Tensor | None = None,
         snake: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The causal convolution of ``weight`` [C_out, C_in, K] (``dilation``) -> [B, T, C_out], plus ``bias`` and
    ``residual`` [B, T, C_out] where given, over ``x`` [B, T + (K - 1) dilation, C_in] (each item's left context
    included), or with ``left`` [B, (K - 1) dilation, C_in] (the left context, as it is) over [left; x] with x
    [B, T, C_in] through SnakeBeta ``snake`` = (alpha, scale) where given (``cpu_kernels.snake_conv``'s
    arithmetic: ``cpu_kernels.snake_kept`` keeps a stream's next context)."""
    suffix = _SUFFIX[x.dtype]
    out_channels, in_channels, taps = weight.shape
    items, length, _ = x.shape
    held = 0 if left is None else left.shape[1]
    if left is not None and (left.shape != (items, (taps - 1) * dilation, in_channels) or left.dtype != x.dtype):
        raise ValueError(f"left must be [{items}, {(taps - 1) * dilation}, {in_channels}] {x.dtype}, got "
                         f"{tuple(left.shape)} {left.dtype}")
    if snake is not None and left is None:
        raise ValueError("SnakeBeta applies to the rows after a left context: give left")
    outputs = held + length - (taps - 1) * dilation
    if outputs < 1:
        raise ValueError(f"{length} rows hold no output of a {taps}-tap convolution at dilation {dilation}")
    x, weight = x.contiguous(), weight.detach().contiguous()
    left = None if left is None else left.contiguous()
    alpha, scale = (None, None) if snake is None else (t.detach().float().contiguous() for t in snake)
    bias = None if bias is None else bias.detach().float().contiguous()
    if residual is not None:
        residual = residual.contiguous()
    threads = torch.get_num_threads()
    count = planes(BLOCK)
    twiddles = _twiddles(BLOCK)
    # Fresh buffers each call (the allocator keeps freed large blocks for the next): a thread's cached buffer made
    # under inference mode could not be written by a later call outside it.
    weights = x.new_empty(count, in_channels, out_channels)  # the weight's planes, this call's: [P, C_in, C_out]
    cpu_kernels.dft_function(f"dft_weight_{suffix}")(out_channels, in_channels, taps, BLOCK, weight.data_ptr(),
                                                     twiddles.data_ptr(), weights.data_ptr(), threads)
    per_block = BLOCK - taps + 1
    # Each item's own blocks (none spans two items): per dilation phase, enough for its outputs
    blocks = items * -(-outputs // (per_block * dilation)) * dilation
    out = x.new_empty(items, outputs, out_channels)
    forward = cpu_kernels.dft_function(f"dft_forward_{suffix}")
    inverse = cpu_kernels.dft_function(f"dft_inverse_{suffix}")
    step = min(BLOCKS_PER_GEMM, blocks)
    inputs = x.new_empty(count * step * in_channels)
    products = x.new_empty(count * step * out_channels)

    def address(t: torch.Tensor | None) -> int:
        return 0 if t is None else t.data_ptr()

    for first in range(0, blocks, step):
        n = min(step, blocks - first)
        planes_in = inputs[: count * n * in_channels].view(count, n, in_channels)
        planes_out = products[: count * n * out_channels].view(count, n, out_channels)
        forward(held, length, outputs, in_channels, first, n, BLOCK, per_block, dilation, address(left),
                x.data_ptr(), address(alpha), address(scale), twiddles.data_ptr(), planes_in.data_ptr(), threads)
        torch.bmm(planes_in, weights, out=planes_out)
        inverse(outputs, out_channels, first, n, BLOCK, taps, dilation, planes_out.data_ptr(), twiddles.data_ptr(),
                address(bias), address(residual), out.data_ptr(), threads)
    return out
