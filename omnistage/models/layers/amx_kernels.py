"""omnistage's AMX kernels (``csrc/amx_kernels.c``): convolutions over [B, T, C] signals and linear layers as
implicit GEMMs on Intel AMX tiles (Sapphire Rapids and later), for the compute-bound layers with many rows:
Code2Wav's convolutions; and a phase the decoder kernels (``cpu_kernels``) call inside their parallel region
for the code predictor's dense layers in bfloat16 (``phase_address``), whose weights in AMX's layout (pairs of
inputs) the kernels' panel tiles read for float32 rows, and one for routed experts on their bfloat16 pair panels
(``experts_address``; ``cpu_kernels.experts_take_amx``).

A TDPBF16PS instruction takes 16 x 16 x 32 bfloat16 products per 16 cycles, eight times the float32 FMA units'
rate. float32 rows stay float32-accurate: each value is split into three bfloat16 parts whose sum is the value
exactly, and every part's product with a weight that is a bfloat16 value exactly (a checkpoint stored in
bfloat16, as released ones are) is exact in float32, so a row's dot product is the float32 sum of exact
products; it differs from a float32 GEMM's by summation rounding only (measured ~1e-6 relative, like two float32
GEMM libraries). bfloat16 rows take one part. Measured here (Xeon, Emerald Rapids, 2 threads; float32 rows,
three parts, against oneDNN's float32 convolution / GEMM): a 768-channel kernel-7 convolution 722 vs 313
GFLOP/s, 192 channels 917 vs 310, a 1024 x 1024 linear layer over 4096 rows 562 vs 302.

Which weights a kernel takes (``takes``): CPU, float32 holding bfloat16 values exactly, or bfloat16; only where
the CPU has AMX and the build has its intrinsics (``available``); others keep their path.
``OMNISTAGE_CPU_KERNELS=0`` turns these off with the other kernels, ``OMNISTAGE_AMX_KERNELS=0`` alone.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from omnistage.models.layers.c_build import LazyLibrary, build_library, scratch

_SOURCE = Path(__file__).with_name("csrc") / "amx_kernels.c"
_BLOCK = 32  # outputs per weight block, channels per input chunk
_PART_GROUP = 16  # amx_kernels.c's PART_GROUP: float32 rows split part by part, a group's parts in 16-row tiles
_PART_SEG = -(-3 * _PART_GROUP // 16) * 16  # (PART_SEG: plane rows a group)
ROW_CHUNK = 128  # output rows per job at least (a job's planes stay in L2; see row_chunk)
MAX_ROW_CHUNK = 512
PLANES_BYTES = 3 << 19  # a job's planes at most (1.5 MB: L2 is 2 MB a core on AMX CPUs) where its rows allow
ENV = "OMNISTAGE_AMX_KERNELS"


def _build() -> ctypes.CDLL:
    if not torch.cpu._is_amx_tile_supported():
        raise RuntimeError("this CPU has no AMX tiles")
    library = build_library(_SOURCE, ("-lmvec", "-lm"))  # (glibc's vector sinf, for large arguments)
    if not hasattr(library, "amx_conv"):
        raise RuntimeError("the compiler built no AMX code for this CPU")
    if library.amx_init() != 0:
        raise RuntimeError("Linux refused this process AMX tile state")
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    library.amx_conv.restype = None
    library.amx_conv.argtypes = [i64] * 7 + [p, i64, p, i64, p, p, i32, i32, p, i64, p, p, i64, i32, i32, i64, p,
                                             i64, i32]
    library.amx_linear_rows.restype = None
    library.amx_linear_rows.argtypes = [p, i64, p, i32, p, i32, p, i64, i32, i32]
    library.snake_kept.restype = None
    library.snake_kept.argtypes = [i64] * 4 + [p, p, p, p, p, i32, p]
    library.amx_unit.restype = None
    library.amx_unit.argtypes = [i64] * 7 + [p, p, i64, p, p, i32, p, p, p, p, p, p, p, i64, p, i64, i32]
    return library


_lazy = LazyLibrary(_build, "AMX kernels", "convolutions and linear layers keep oneDNN and the panel kernels")


def available() -> bool:
    """Whether the kernels serve here (an AMX CPU, a compiler that builds them; built on the first call)."""
    # (a CPU without AMX is not a failure worth a warning: asked first, quietly)
    return os.environ.get(ENV, "1") != "0" and torch.cpu._is_amx_tile_supported() and _lazy.available()


def phase_address() -> int:
    """``amx_phase_linear``'s address, for the decoder kernels (``cpu_kernels``) to call inside their region."""
    return ctypes.cast(_lazy.require().amx_phase_linear, ctypes.c_void_p).value


def experts_address() -> int:
    """``amx_phase_experts``' address (routed experts on their pair panels), as ``phase_address``."""
    return ctypes.cast(_lazy.require().amx_phase_experts, ctypes.c_void_p).value


def phase_scratch(rows: int, channels: int) -> int:
    """bfloat16 values of scratch one thread's ``amx_phase_linear`` call needs for ``rows`` rows of at most
    ``channels`` padded channels (three parts)."""
    return max(_round_up(rows, _BLOCK) * 3, -(-rows // _PART_GROUP) * _PART_SEG) * (channels + _BLOCK)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class AmxWeight:
    """A convolution weight [N, C, taps] (a linear weight is one tap) packed for ``conv``: ``data`` [N'/32,
    taps * C' / 2, 32, 2] bfloat16, N and C padded to multiples of 32 with zeros."""

    data: torch.Tensor
    outputs: int
    channels: int
    taps: int
    # (data address, N, C', C): how ``amx_phase_linear`` reads a one-tap weight inside the decoder kernels
    words: torch.Tensor = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        words = [self.data.data_ptr(), self.outputs, self.padded_channels, self.channels]
        object.__setattr__(self, "words", torch.tensor(words, dtype=torch.int64))

    @property
    def padded_channels(self) -> int:
        return self.data.shape[1] * 2 // self.taps


def bf16_exact(weight: torch.Tensor) -> bool:
    """Whether every value of ``weight`` is a bfloat16 value (what three-part float32 products need): its low 16
    bits are zero, checked in chunks (no temporary of the weight's size at load)."""
    if weight.dtype == torch.bfloat16:
        return True
    if weight.dtype != torch.float32:
        return False
    bits = weight.detach().reshape(-1).view(torch.int32)
    return all(not bool((chunk & 0xFFFF).any()) for chunk in bits.split(1 << 22))


def takes(weight: torch.Tensor) -> bool:
    """Whether ``pack`` takes this weight: on the CPU, bfloat16 or float32 of bfloat16 values, AMX here."""
    return weight.device.type == "cpu" and available() and bf16_exact(weight.detach())


def pack(weight: torch.Tensor) -> AmxWeight:
    """A convolution weight [N, C, taps] (or a linear weight [N, C]) -> ``AmxWeight``; ``takes(weight)`` must
    hold."""
    if weight.dim() == 2:
        weight = weight[:, :, None]
    outputs, channels, taps = weight.shape
    padded = weight.new_zeros(_round_up(outputs, _BLOCK), taps, _round_up(channels, _BLOCK), dtype=torch.bfloat16)
    padded[:outputs, :, :channels] = weight.detach().permute(0, 2, 1)
    k = padded.shape[1] * padded.shape[2]
    data = padded.view(-1, _BLOCK, k // 2, 2).transpose(1, 2).contiguous()
    return AmxWeight(data, outputs, channels, taps)


def unpack(weight: AmxWeight) -> torch.Tensor:
    """``pack``'s input back, [N, C, taps] float32 (exact: the packed values are bfloat16), for the few calls a
    packed layer serves off the tiles once its unpacked copy is released."""
    taps, padded = weight.taps, weight.padded_channels
    rows = weight.data.transpose(1, 2).reshape(-1, taps, padded)  # [N', taps, C']
    return rows[: weight.outputs, :, : weight.channels].permute(0, 2, 1).float()


def _check_rows(x: torch.Tensor, weight: AmxWeight) -> None:
    if x.shape[-1] != weight.channels or x.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu":
        raise ValueError(f"x must be [..., {weight.channels}] float32 or bfloat16 on the CPU, got "
                         f"{tuple(x.shape)} {x.dtype} on {x.device}")


def _left_context(left: torch.Tensor | None, x: torch.Tensor) -> tuple[torch.Tensor | None, int]:
    """(``left`` contiguous, its rows H): a left context [B, H, C] of x [B, T, C], or None (H = 0)."""
    if left is None:
        return None, 0
    batch, _, channels = x.shape
    if left.dim() != 3 or left.shape[::2] != (batch, channels) or left.dtype != x.dtype:
        raise ValueError(f"left must be [{batch}, H, {channels}] {x.dtype}, got {tuple(left.shape)} {left.dtype}")
    return left.contiguous(), left.shape[1]


def row_chunk(batch: int, rows: int, padded: int, parts: int, halo: int, threads: int) -> int:
    """Output rows per job for ``rows`` output rows of each of ``batch`` items: up to ``MAX_ROW_CHUNK`` while
    a job's planes ((chunk + halo) rows of ``padded`` channels, ``parts`` bfloat16 parts) fit ``PLANES_BYTES`` and
    there are at least four jobs a thread; never under ``ROW_CHUNK``. A longer job splits fewer halo rows twice
    (a dilation-9 kernel-7 convolution reads 54 rows beyond its own) and starts fewer jobs, which shows where
    the channels are few. The chunk does not change any row's sums (the same bits). Released Code2Wav residual
    units, 16 x 25 frames, 2 threads, 128 against 512 rows alternating in one process (medians): bfloat16 96
    channels 540 -> 467 ms, 192 404 -> 390, 384 319 -> 300; float32 192 836 -> 716, 384 860 -> 767, while 768
    float32 channels (2.6 MB of planes) were slower at 512 (647 -> 729) and take 256 (694 -> 557). A whole
    Code2Wav call, 14 alternating pairs: bfloat16 0.93x the time (median ratio), float32 0.99x."""
    chunk = MAX_ROW_CHUNK
    while chunk > ROW_CHUNK and ((chunk + halo) * padded * parts * 2 > PLANES_BYTES
                                 or batch * -(-rows // chunk) < 4 * threads):
        chunk //= 2
    return chunk


def _floats(t: torch.Tensor | None) -> torch.Tensor | None:
    """A per-channel vector as the kernels read it: contiguous float32."""
    return None if t is None else t.detach().float().contiguous()


def conv(
    x: torch.Tensor, weight: AmxWeight, dilation: int = 1, bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None, left: torch.Tensor | None = None,
    snake: tuple[torch.Tensor, torch.Tensor] | None = None, snake_left: bool = False,
) -> torch.Tensor:
    """Convolution at ``dilation``, stride 1, of the signal [B, H + T, C] that is ``left`` [B, H, C] (as it is,
    or through ``snake`` too where ``snake_left``; none: H = 0) followed by x [B, T, C] (through SnakeBeta ``x +
    (sin(x alpha) scale)^2`` where ``snake`` = (alpha, scale) per channel), float32 or bfloat16 -> [B, H + T -
    (taps - 1) * dilation, N] in x's dtype, plus ``bias`` and ``residual`` (contiguous, of the result's shape and
    dtype: the sum is written into it and returned). The activated signal is never stored: each job activates and
    splits the rows it reads."""
    batch, length, channels = x.shape
    _check_rows(x, weight)
    left, held = _left_context(left, x)
    out_length = held + length - (weight.taps - 1) * dilation
    if out_length < 1:
        raise ValueError(f"{held + length} inputs give no output of a {weight.taps}-tap convolution at dilation "
                         f"{dilation}")
    library = _lazy.require()
    threads = torch.get_num_threads()
    parts = 3 if x.dtype == torch.float32 else 1
    cp = weight.padded_channels
    halo = (weight.taps - 1) * dilation
    chunk = row_chunk(batch, out_length, cp, parts, halo, threads)
    stride = (chunk + halo) * cp * parts  # each thread's planes
    planes = scratch("amx-planes", threads * stride, torch.bfloat16)
    rows = x.reshape(batch * length, channels)
    if rows.stride(-1) != 1 or (batch > 1 and rows.stride(0) * length != x.stride(0)):
        rows = rows.contiguous()
    if residual is None:
        out = x.new_empty(batch, out_length, weight.outputs)
    else:
        if residual.shape != (batch, out_length, weight.outputs) or residual.dtype != x.dtype or not residual.is_contiguous():
            raise ValueError("the residual must be a contiguous tensor of the result's shape and dtype")
        out = residual
    bias = _floats(bias)
    alpha, scale = (None, None) if snake is None else map(_floats, snake)
    bf16 = int(x.dtype == torch.bfloat16)
    library.amx_conv(batch, held + length, out_length, channels, cp, weight.taps, dilation, rows.data_ptr(),
                     rows.stride(0), 0 if left is None else left.data_ptr(), held,
                     0 if alpha is None else alpha.data_ptr(), 0 if scale is None else scale.data_ptr(),
                     int(snake_left), bf16, weight.data.data_ptr(), weight.outputs,
                     0 if bias is None else bias.data_ptr(), out.data_ptr(), weight.outputs, bf16,
                     int(residual is not None), chunk, planes.data_ptr(), stride, threads)
    return out


def snake_kept(left: torch.Tensor, x: torch.Tensor, valid: int | torch.Tensor,
               snake: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """A stream's next left context [B, H, C] for a convolution whose kernel activates x (``conv``'s ``snake``,
    ``residual_unit``): item b's rows ``valid[b]`` .. ``valid[b] + H - 1`` of [left; snake(x)] (left [B, H, C]
    as it is, x [B, T, C], float32 or bfloat16; ``valid``: one int for all items or a [B] integer tensor), x's
    rows activated with the kernels' arithmetic, so the next chunk reads what one-shot decoding activates."""
    left, x, valid, kept = kept_arguments(left, x, valid)
    alpha, scale = map(_floats, snake)
    (batch, held, channels), length = kept.shape, x.shape[1]
    _lazy.require().snake_kept(batch, held, length, channels, left.data_ptr(), x.data_ptr(), valid.data_ptr(),
                               alpha.data_ptr(), scale.data_ptr(), int(x.dtype == torch.bfloat16), kept.data_ptr())
    return kept


def kept_arguments(left: torch.Tensor, x: torch.Tensor, valid: int | torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A kept-rows kernel's arguments checked (this module's ``snake_kept``, ``cpu_kernels.snake_kept``): left and
    x contiguous, ``valid`` as a [B] int64 tensor, and the result [B, H, C] to fill."""
    batch, length, channels = x.shape
    if left.dim() != 3 or left.shape[::2] != (batch, channels) or left.dtype != x.dtype:
        raise ValueError(f"left must be [{batch}, H, {channels}] {x.dtype}, got {tuple(left.shape)} {left.dtype}")
    if x.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu":
        raise ValueError(f"x must be float32 or bfloat16 on the CPU, got {x.dtype} on {x.device}")
    valid = torch.as_tensor(valid, dtype=torch.int64).expand(batch).contiguous()
    if bool(((valid < 0) | (valid > length)).any()):
        raise ValueError(f"valid counts must lie in [0, {length}]")
    return left.contiguous(), x.contiguous(), valid, x.new_empty(batch, left.shape[1], channels)


Conv = tuple[AmxWeight, torch.Tensor | None, tuple[torch.Tensor, torch.Tensor]]  # weight, bias, (alpha, scale)


def residual_unit(x: torch.Tensor, left: torch.Tensor | None, dilation: int, first: Conv, second: Conv) -> torch.Tensor:
    """A vocoder residual unit in one pass over x [B, T, C] (float32 or bfloat16) and its left context [B, H, C]
    (H = the first convolution's reach, (taps - 1) * dilation; None where that is 0): x + conv2(snake2(conv1(
    snake1([left; x])))), ``first`` / ``second`` = (weight, bias, (alpha, scale)) of the two C -> C convolutions,
    the second of one tap. The bits of ``conv`` twice (h = ``conv(x, w1, dilation, b1, left=left, snake=s1)``,
    then ``conv(h, w2, 1, b2, residual=x, snake=s2)``) without h going through memory; returns a new tensor."""
    (w1, b1, s1), (w2, b2, s2) = first, second
    batch, length, channels = x.shape
    if not (w1.channels == w1.outputs == w2.channels == w2.outputs == channels and w2.taps == 1):
        raise ValueError(f"a residual unit maps {channels} channels to {channels}, its second convolution with one "
                         f"tap; got {w1.channels} -> {w1.outputs} ({w1.taps} taps) and {w2.channels} -> "
                         f"{w2.outputs} ({w2.taps} taps)")
    if x.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu":
        raise ValueError(f"x must be float32 or bfloat16 on the CPU, got {x.dtype} on {x.device}")
    left, held = _left_context(left, x)
    if held != (w1.taps - 1) * dilation:
        raise ValueError(f"{w1.taps} taps at dilation {dilation} need {(w1.taps - 1) * dilation} rows of left "
                         f"context, got {held}")
    x = x.contiguous()
    library = _lazy.require()
    threads = torch.get_num_threads()
    parts = 3 if x.dtype == torch.float32 else 1
    cp = w1.padded_channels
    chunk = row_chunk(batch, length, cp, parts, held, threads)
    stride = (2 * chunk + held) * cp * parts + chunk * channels * 2  # both planes, h (float32 at most)
    planes = scratch("amx-unit", threads * stride, torch.bfloat16)
    b1, b2 = _floats(b1), _floats(b2)
    (a1, c1), (a2, c2) = map(_floats, s1), map(_floats, s2)
    out = torch.empty_like(x)
    library.amx_unit(batch, held + length, length, channels, cp, w1.taps, dilation, x.data_ptr(),
                     0 if left is None else left.data_ptr(), held, a1.data_ptr(), c1.data_ptr(),
                     int(x.dtype == torch.bfloat16), w1.data.data_ptr(), 0 if b1 is None else b1.data_ptr(),
                     a2.data_ptr(), c2.data_ptr(), w2.data.data_ptr(), 0 if b2 is None else b2.data_ptr(),
                     out.data_ptr(), chunk, planes.data_ptr(), stride, threads)
    return out


FEW_ROWS = 16  # linear: at most this many rows without a bias take amx_linear_rows (the same sums, the same bits)


def linear(x: torch.Tensor, weight: AmxWeight, bias: torch.Tensor | None = None,
           part_rows: bool = False) -> torch.Tensor:
    """x [..., C] -> [..., N]: ``conv`` with one tap over all rows; up to ``FEW_ROWS`` rows without a bias in one
    split per thread (``amx_linear_rows``: 16 rows of the released Thinker's output head 2x faster).
    ``part_rows`` (no bias): every row count takes ``amx_linear_rows``, float32 rows summed part by part as the
    decoder kernels' phase sums them (a third of the tile products at few rows; other bits than ``conv``'s)."""
    if weight.taps != 1:
        raise ValueError("a linear layer's weight has one tap")
    rows = x.reshape(-1, x.shape[-1])
    if part_rows and bias is not None:
        raise ValueError("part_rows takes no bias")
    if bias is not None or (rows.shape[0] > FEW_ROWS and not part_rows):
        return conv(rows[None], weight, 1, bias).view(*x.shape[:-1], weight.outputs)
    _check_rows(rows, weight)
    rows = rows.contiguous()
    count, threads = rows.shape[0], torch.get_num_threads()
    pointers = rows.data_ptr() + torch.arange(count, dtype=torch.int64) * rows.stride(0) * rows.element_size()
    stride = phase_scratch(count, weight.padded_channels)
    planes = scratch("amx-planes", threads * stride, torch.bfloat16)
    out = x.new_empty(count, weight.outputs)
    bf16 = int(x.dtype == torch.bfloat16)
    _lazy.require().amx_linear_rows(weight.words.data_ptr(), count, pointers.data_ptr(), bf16, out.data_ptr(), bf16,
                                    planes.data_ptr(), stride, threads, int(part_rows))
    return out.view(*x.shape[:-1], weight.outputs)
