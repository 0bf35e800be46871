"""Weight-only quantized weights: their formats, quantization, and the matrix products that read them.

A weight [N, K] (output channels x inputs) is quantized symmetrically, row by row: int8 with one scale per output
channel or per group of ``group_size`` consecutive inputs of a row, int4 with one scale per group (128 by default,
the group size compressed-tensors' W4A16 uses). Values are ``round(w / scale)`` clamped to [-127, 127] (int8) or
[-8, 7] (int4, scale = amax / 7). Activations stay in the serving dtype; scales are kept in it too.

Quantization is row-local, so the rows of a fused weight (q/k/v, stacked experts) can be quantized as their
checkpoint parts arrive, one tensor at a time (``QuantBuffer.write_rows``), and packed for the kernels once all
rows are in (``QuantBuffer.pack``).

The packed weight (``QuantWeight``, a frozen dataclass) carries its format and layout, and ``quant_matmul``
chooses the kernel by it:

- ``int8``: int8 [.., N, K] + scales [.., N] (per channel) or [.., N, K/g] -> omnistage's kernels where they
  build (float32 activations: float32 sums, within 1e-5 of the float32 GEMM's); where they do not, per channel on
  the CPU ``torch.ops.aten._weight_int8pack_mm`` (float32 accumulation of ``x * q`` in torch's order, times the
  row's scale, rounded once to the activations' dtype; ``tests/models/test_quant.py``), else dequantized per
  call.
- ``int4pack``: torch's CPU int4 layout (``_convert_weight_to_int4pack_for_cpu``: uint8 [.., N, K/2], interleaved
  in blocks of 64 rows) + scales-and-zeros [.., K/g, N, 2] -> ``_weight_int4pack_mm_for_cpu``, which dequantizes
  ``(q + 8 - 8) * scale + 0`` in registers; needs N % 16 == 0 and a group of 32/64/128/256.
- ``nibbles``: two values per byte, even column in the low nibble, offset by 8 (the checkpoint's own bytes) +
  scales [.., N, K/g]: on the CPU, omnistage's kernels (``quant_kernels``: dequantized in registers, no zero
  points, nothing repacked at load) where they build and take the shape, which is the layout int4 weights get
  there first; elsewhere (other devices, odd shapes) dequantized per call, then one GEMM.
- ``int4pack`` serves int4 on the CPU only where omnistage's kernels do not (no C compiler, groups not a
  multiple of 32).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from omnistage.models.layers import quant_kernels

log = logging.getLogger(__name__)

INT8_MAX = 127
INT4_MAX = 7  # symmetric: -8 is representable but a scale of amax / 7 never produces it
INT4_KERNEL_GROUPS = (32, 64, 128, 256)
LAYOUTS = ("int8", "int4pack", "nibbles")


@dataclass(frozen=True)
class QuantFormat:
    """How a weight is quantized: ``bits`` 8 or 4, one scale per ``group_size`` inputs of a row (int8: None, one
    per output channel)."""

    bits: int
    group_size: int | None = None  # required for int4; None for int8 per channel

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits!r}")
        g = self.group_size
        if (self.bits == 4 or g is not None) and not (isinstance(g, int) and not isinstance(g, bool)
                                                       and g >= 2 and g % 2 == 0):
            raise ValueError(f"int{self.bits} needs an even group_size >= 2{' (or None)' if self.bits == 8 else ''}, "
                             f"got {g!r}")

    @property
    def per_channel(self) -> bool:
        return self.group_size is None

    @property
    def name(self) -> str:
        return f"int{self.bits}" if self.per_channel else f"int{self.bits} (groups of {self.group_size})"

    def groups(self, in_features: int) -> int:
        """Scales per row; raises ValueError when ``in_features`` does not divide into whole groups."""
        if self.per_channel:
            return 1
        if in_features % self.group_size:
            raise ValueError(f"{in_features} inputs do not divide into int{self.bits} groups of {self.group_size}")
        return in_features // self.group_size

    def for_inputs(self, in_features: int) -> QuantFormat:
        """This format for a weight with ``in_features`` inputs: a row shorter than one group is one group
        (int8: per channel)."""
        if not self.per_channel and in_features < self.group_size:
            return QuantFormat(8) if self.bits == 8 else QuantFormat(4, in_features)
        self.groups(in_features)
        return self

    def fitting(self, in_features: int) -> QuantFormat:
        """The format online quantization gives a weight with ``in_features`` inputs: ``for_inputs`` where the
        groups divide the row or the row is one group; else int4 in the largest even group, from 32 inputs (or the
        group size, if smaller) up to the group size, that divides the row; else int8 per channel, which fits any
        row; the kernels' own group sizes first. A checkpoint of other widths than the release's then loads
        quantized instead of failing."""
        g = self.group_size
        if self.per_channel or in_features % g == 0 or (in_features < g and (self.bits == 8 or in_features % 2 == 0)):
            return self.for_inputs(in_features)
        if self.bits == 4:
            kernels = [size for size in reversed(INT4_KERNEL_GROUPS) if size <= g]
            for size in [*kernels, *range(g, min(32, g) - 1, -2)]:
                if in_features % size == 0:
                    return _refitted(self, in_features, QuantFormat(4, size))
        return _refitted(self, in_features, QuantFormat(8))

    def weight_bytes(self, rows: int, in_features: int, scale_bytes: int) -> int:
        """Bytes of ``rows`` quantized rows and their scales."""
        return rows * (in_features * self.bits // 8 + self.groups(in_features) * scale_bytes)


@functools.cache
def _refitted(configured: QuantFormat, in_features: int, fitted: QuantFormat) -> QuantFormat:
    """``fitted``, logged once per process for each configured format and row length."""
    log.info("%d inputs do not divide into %s: those weights are quantized as %s", in_features, configured.name,
             fitted.name)
    return fitted


def packed_bytes(fmt: QuantFormat, rows: int, in_features: int, scale_bytes: int, device: torch.device) -> int:
    """Bytes a [rows, in_features] weight takes in the layout ``pack_weight`` chooses on ``device`` (torch's int4
    layout stores a zero point, 0 here, beside each scale)."""
    zeros = rows * fmt.groups(in_features) * scale_bytes if int4_layout(rows, in_features, fmt, device) == "int4pack" else 0
    return fmt.weight_bytes(rows, in_features, scale_bytes) + zeros


def quantize(weight: torch.Tensor, fmt: QuantFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (values, float32 scales): int8 [N, K] and [N] (int8 per channel), or [N, K/g] (grouped;
    int4 values in [-8, 7]). Computed in float32 whatever the weight's dtype."""
    w = weight.detach().float()
    n, k = w.shape
    if fmt.per_channel:
        scales = (w.abs().amax(dim=1) / INT8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
        return torch.round(w / scales[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scales
    top, low = (INT8_MAX, -INT8_MAX) if fmt.bits == 8 else (INT4_MAX, -INT4_MAX - 1)
    grouped = w.view(n, fmt.groups(k), fmt.group_size)
    scales = (grouped.abs().amax(dim=2) / top).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(grouped / scales[..., None]).clamp_(low, top)
    return q.view(n, k).to(torch.int8), scales


def pack_nibbles(values: torch.Tensor) -> torch.Tensor:
    """int4 values [..., K] in [-8, 7] -> uint8 [..., K/2]: even column in the low nibble, each offset by 8."""
    u = (values.to(torch.int16) + 8).to(torch.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """``pack_nibbles``' inverse: uint8 [..., K/2] -> int8 [..., K] in [-8, 7]."""
    low = (packed & 0x0F).to(torch.int8) - 8
    high = (packed >> 4).to(torch.int8) - 8
    return torch.stack((low, high), dim=-1).flatten(-2)


def dequantize(values: torch.Tensor, scales: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """(int8 values [..., N, K], scales [..., N] or [..., N, K/g]) -> float32 weight [..., N, K]."""
    v = values.float()
    if fmt.per_channel:
        return v * scales.float()[..., None]
    shape = v.shape
    return (v.view(*shape[:-1], -1, fmt.group_size) * scales.float()[..., None]).view(shape)


@dataclass(frozen=True)
class QuantWeight:
    """A packed quantized weight: ``data`` and ``scales`` in ``layout`` (see the module docstring), stacked along
    leading dims for experts ([E, N, ...]); ``select(e)`` is expert ``e``'s weight."""

    fmt: QuantFormat
    layout: str
    data: torch.Tensor
    scales: torch.Tensor
    out_features: int
    in_features: int

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if (self.layout == "int8") != (self.fmt.bits == 8):
            raise ValueError(f"layout {self.layout!r} does not hold {self.fmt.name} weights")
        n, k = self.out_features, self.in_features
        width = k if self.layout == "int8" else k // 2
        if tuple(self.data.shape[-2:]) != (n, width):
            raise ValueError(f"{self.layout} data of a [{n}, {k}] weight must end in [{n}, {width}], "
                             f"got {tuple(self.data.shape)}")
        groups = self.fmt.groups(k)
        tail = {"int8": (n,) if self.fmt.per_channel else (n, groups), "nibbles": (n, groups),
                "int4pack": (groups, n, 2)}[self.layout]
        if tuple(self.scales.shape[len(self.scales.shape) - len(tail):]) != tail:
            raise ValueError(f"{self.layout} scales of a [{n}, {k}] weight must end in {list(tail)}, "
                             f"got {tuple(self.scales.shape)}")

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scales.numel() * self.scales.element_size()

    def select(self, index: int) -> QuantWeight:
        return QuantWeight(self.fmt, self.layout, self.data[index], self.scales[index], self.out_features,
                           self.in_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the kernels compute with, [..., N, K] in ``dtype``."""
        if self.layout == "int8":
            values, scales = self.data, self.scales
        elif self.layout == "nibbles":
            values, scales = unpack_nibbles(self.data), self.scales
        else:  # recover the values through the kernel itself: an identity input reads every column once
            return _int4pack_dense(self).to(dtype)
        return dequantize(values, scales, self.fmt).to(dtype)


def int4_kernel_takes(out_features: int, fmt: QuantFormat, device: torch.device) -> bool:
    """Whether torch's CPU int4 kernel takes a [out_features, K] weight of ``fmt``."""
    return (device.type == "cpu" and fmt.bits == 4 and out_features % 16 == 0
            and fmt.group_size in INT4_KERNEL_GROUPS and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"))


def int4_layout(out_features: int, in_features: int, fmt: QuantFormat, device: torch.device) -> str:
    """The layout an int4 [out_features, in_features] weight is packed in on ``device`` (module docstring)."""
    if quant_kernels.takes(4, fmt.group_size, in_features, device):
        return "nibbles"
    return "int4pack" if int4_kernel_takes(out_features, fmt, device) else "nibbles"


def pack_weight(values: torch.Tensor, scales: torch.Tensor, fmt: QuantFormat, dtype: torch.dtype) -> QuantWeight:
    """Quantized (values [..., N, K], float scales) -> the layout its kernel reads, scales in ``dtype`` (the
    activations')."""
    n, k = values.shape[-2:]
    scales = scales.to(dtype)
    if fmt.bits == 8:
        return QuantWeight(fmt, "int8", values.to(torch.int8).contiguous(), scales.contiguous(), n, k)
    if int4_layout(n, k, fmt, values.device) == "nibbles":
        return QuantWeight(fmt, "nibbles", pack_nibbles(values).contiguous(), scales.contiguous(), n, k)
    data = torch.stack([_int4pack(v) for v in values.reshape(-1, n, k)]).view(*values.shape[:-2], n, k // 2)
    return QuantWeight(fmt, "int4pack", data, _scales_and_zeros(scales), n, k)


def _int4pack(values: torch.Tensor) -> torch.Tensor:
    """int4 values [N, K] in [-8, 7] -> torch's CPU int4 layout (which stores them offset by 8)."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(values.to(torch.int32) + 8, 1)


def _scales_and_zeros(scales: torch.Tensor) -> torch.Tensor:
    """Scales [..., N, K/g] -> torch's int4 kernel's [..., K/g, N, 2] (scale, zero point 0: symmetric)."""
    return torch.stack((scales, torch.zeros_like(scales)), dim=-1).transpose(-3, -2).contiguous()


def quant_matmul(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (the serving dtype) times ``weight``'s [N, K] transposed -> [..., N] in x's dtype."""
    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    # omnistage's kernels wherever they take the weight: torch's int8 kernel in float32 (as exact: float32 sums)
    # was 17x slower at one row and 18x at 256 (AMD EPYC Zen 4, 2 threads, 4096 x 2048)
    if own_kernel_takes(x, weight):
        return quant_kernels.linear(rows, *kernel_args(weight), bias).view(*shape[:-1], weight.out_features)
    if weight.layout == "int8" and weight.fmt.per_channel and x.device.type == "cpu" and (
            x.dtype == torch.float32 or weight.in_features % 16 == 0):
        # (torch 2.13's kernel in bfloat16 with rows of inputs not a multiple of its vector (8 on AVX2, 16 on
        # AVX-512): wrong sums, then out-of-bounds reads that crash the process, on AVX-512 from the first row;
        # such rows take the dequantizing path below)
        out = torch.ops.aten._weight_int8pack_mm(rows.contiguous(), weight.data, _in(weight.scales, x.dtype))
    elif weight.layout == "int4pack":
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows.contiguous(), weight.data, weight.fmt.group_size,
                                                         _in(weight.scales, x.dtype))
    else:  # (in float32: a bfloat16 copy of the weight would round int8 values times their scales)
        out = F.linear(rows.float(), weight.dequantize(torch.float32)).to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.view(*shape[:-1], weight.out_features)


def own_kernel_takes(x: torch.Tensor, weight: QuantWeight) -> bool:
    """Whether omnistage's quantized CPU kernels serve ``weight`` for activations ``x``."""
    return _own_kernel_takes(x.dtype, x.device, weight)


def _own_kernel_takes(dtype: torch.dtype, device: torch.device, weight: QuantWeight) -> bool:
    return (dtype in (torch.float32, torch.bfloat16) and weight.scales.dtype in (torch.float32, torch.bfloat16)
            and weight.layout in ("nibbles", "int8") and weight.data.device.type == "cpu"
            and quant_kernels.takes(weight.fmt.bits, weight.fmt.group_size, weight.in_features, device))


def decoder_kernel_weight(weight: QuantWeight, dtype: torch.dtype) -> quant_kernels.KernelWeight | None:
    """``weight`` as the decoder kernels' table points to it, for activations of ``dtype`` on the CPU; None where
    omnistage's quantized kernels do not serve it (the layer then keeps running layer by layer)."""
    if not _own_kernel_takes(dtype, weight.data.device, weight):
        return None
    return quant_kernels.kernel_weight(*kernel_args(weight))


def kernel_args(weight: QuantWeight) -> tuple[int, int | None, torch.Tensor, torch.Tensor]:
    """``weight`` as ``quant_kernels`` takes it: (bits, group size, data, scales)."""
    return weight.fmt.bits, weight.fmt.group_size, weight.data, weight.scales


def _in(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _int4pack_dense(weight: QuantWeight) -> torch.Tensor:
    eye = torch.eye(weight.in_features, dtype=torch.float32, device=weight.data.device)
    lead = weight.data.shape[:-2]
    if not lead:
        return quant_matmul(eye, _float_scales(weight)).T.contiguous()
    flat = [_int4pack_dense(weight.select(i)) for i in range(lead.numel())]
    return torch.stack(flat).view(*lead, weight.out_features, weight.in_features)


def _float_scales(weight: QuantWeight) -> QuantWeight:
    return QuantWeight(weight.fmt, weight.layout, weight.data, weight.scales.float(), weight.out_features,
                       weight.in_features)


class QuantBuffer:
    """Rows of a quantized weight filled as checkpoint tensors arrive (``write_rows``), packed once complete.

    Holds the values as the weight will (int8 [rows, K], int4 as nibbles [rows, K/2]: no wider copy while
    loading) and the scales in ``scale_dtype``, the dtype ``pack`` will be asked for (a float32 copy of every
    layer's scales, freed layer by layer, was 0.9 GiB of load transient at the released widths); ``shape``
    shapes the rows back into stacked experts ([E, N, K])."""

    def __init__(self, shape: tuple[int, ...], fmt: QuantFormat, device: torch.device,
                 scale_dtype: torch.dtype = torch.float32) -> None:
        *lead, n, k = shape
        self.shape, self.fmt = tuple(shape), fmt
        rows = n * (torch.Size(lead).numel() if lead else 1)
        width, dtype = (k, torch.int8) if fmt.bits == 8 else (k // 2, torch.uint8)
        self.values = torch.empty(rows, width, dtype=dtype, device=device)
        self.scales = torch.empty(rows, fmt.groups(k), dtype=scale_dtype, device=device)
        self.filled = torch.zeros(rows, dtype=torch.bool)

    def write_rows(self, start: int, weight: torch.Tensor) -> None:
        """Quantize the float rows ``weight`` [r, K] into rows ``start``.. of the buffer."""
        values, scales = quantize(weight.reshape(-1, self.shape[-1]), self.fmt)
        self.write_quantized(start, values, scales)

    def write_quantized(self, start: int, values: torch.Tensor, scales: torch.Tensor) -> None:
        """Already-quantized rows (int8 values [r, K], int4 ones in [-8, 7]; scales [r, K/g] or [r]) into rows
        ``start``.."""
        end = start + values.shape[0]
        if end > self.values.shape[0] or values.shape[1] != self.shape[-1]:
            raise ValueError(f"rows {start}..{end} x {values.shape[1]} do not fit a {list(self.shape)} weight")
        self.values[start:end] = values if self.fmt.bits == 8 else pack_nibbles(values)
        self.scales[start:end] = scales.reshape(values.shape[0], -1)
        self.filled[start:end] = True

    @property
    def complete(self) -> bool:
        return bool(self.filled.all())

    def pack(self, dtype: torch.dtype) -> QuantWeight:
        """The complete weight in its kernel's layout (scales in ``dtype``)."""
        if not self.complete:
            raise ValueError(f"a {list(self.shape)} weight has {int((~self.filled).sum())} rows not loaded")
        *lead, n, k = self.shape
        scales = self.scales.view(*lead, n, -1)
        if self.fmt.bits == 8:
            return pack_weight(self.values.view(*lead, n, k), scales[..., 0] if self.fmt.per_channel else scales,
                               self.fmt, dtype)
        if int4_layout(n, k, self.fmt, self.values.device) == "nibbles":
            return QuantWeight(self.fmt, "nibbles", self.values.view(*lead, n, k // 2), scales.to(dtype), n, k)
        flat = self.values.view(-1, n, k // 2)
        data = torch.stack([_int4pack(unpack_nibbles(v)) for v in flat]).view(*lead, n, k // 2)
        return QuantWeight(self.fmt, "int4pack", data, _scales_and_zeros(scales.to(dtype)), n, k)
