"""Weight-only int8 / int4: formats round-trip, every kernel against the dequantized weight, rows quantized as
checkpoint parts arrive equal the whole weight quantized at once."""

from __future__ import annotations

import pytest
import torch

from omnistage.models.layers import quant_kernels
from omnistage.models.layers.quant import (
    QuantBuffer,
    QuantFormat,
    QuantWeight,
    dequantize,
    pack_nibbles,
    pack_weight,
    quant_matmul,
    quantize,
    unpack_nibbles,
)

INT8 = QuantFormat(8)
INT4 = QuantFormat(4, 32)


def _weight(n: int = 48, k: int = 128, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)  # rows of different magnitude


def test_format_validation() -> None:
    with pytest.raises(ValueError, match="bits"):
        QuantFormat(3)
    assert QuantFormat(8, 128).groups(256) == 2 and QuantFormat(8).groups(256) == 1
    with pytest.raises(ValueError, match="int8 needs an even group_size"):
        QuantFormat(8, 33)
    assert QuantFormat(8, 128).for_inputs(64) == QuantFormat(8)  # shorter than a group: per channel
    with pytest.raises(ValueError, match="group_size"):
        QuantFormat(4, None)
    with pytest.raises(ValueError, match="do not divide"):
        QuantFormat(4, 128).groups(192)
    assert QuantFormat(4, 128).for_inputs(64) == QuantFormat(4, 64)  # a row shorter than a group: one group
    # Online quantization fits rows the groups do not divide: the kernels' group sizes first, then any even group
    # of 32 or more up to the configured one, else int8 per channel (odd rows too: int4 packs input pairs).
    assert QuantFormat(4, 128).fitting(256) == QuantFormat(4, 128)
    assert QuantFormat(4, 128).fitting(192) == QuantFormat(4, 64)
    assert QuantFormat(4, 128).fitting(200) == QuantFormat(4, 100)
    assert QuantFormat(4, 128).fitting(72) == QuantFormat(4, 72)
    assert QuantFormat(4, 128).fitting(130) == QuantFormat(4, 128).fitting(25) == QuantFormat(8)
    assert QuantFormat(8, 128).fitting(200) == QuantFormat(8) and QuantFormat(8, 32).fitting(96) == QuantFormat(8, 32)
    assert QuantFormat(4, 128).weight_bytes(10, 256, 2) == 10 * (128 + 2 * 2)
    assert INT8.weight_bytes(10, 256, 4) == 10 * (256 + 4)
    assert QuantFormat(8, 64).weight_bytes(10, 256, 2) == 10 * (256 + 4 * 2)


@pytest.mark.parametrize("fmt", [INT8, QuantFormat(8, 32), INT4, QuantFormat(4, 128)],
                         ids=["int8", "int8-g32", "int4-g32", "int4-g128"])
def test_quantize_error_within_half_a_step(fmt: QuantFormat) -> None:
    w = _weight()
    values, scales = quantize(w, fmt)
    limit = 127 if fmt.bits == 8 else 7
    assert values.dtype == torch.int8 and int(values.abs().max()) <= limit + (fmt.bits == 4)
    error = (dequantize(values, scales, fmt) - w).abs()
    step = scales[:, None] if fmt.per_channel else scales.repeat_interleave(fmt.group_size, dim=1)
    assert bool((error <= step / 2 + 1e-6).all())
    # the largest value of each row (or group) is represented exactly up to float32 rounding
    assert int(values.abs().amax()) == limit


def test_nibbles_round_trip() -> None:
    values = torch.randint(-8, 8, (5, 64), dtype=torch.int8)
    packed = pack_nibbles(values)
    assert packed.shape == (5, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_nibbles(packed), values)
    assert int(packed[0, 0]) == (int(values[0, 0]) + 8) | ((int(values[0, 1]) + 8) << 4)  # even column low


def test_weight_validation() -> None:
    values, scales = quantize(_weight(), INT4)
    with pytest.raises(ValueError, match="layout"):
        QuantWeight(INT4, "int8", values, scales, 48, 128)
    with pytest.raises(ValueError, match="scales"):
        QuantWeight(INT4, "nibbles", pack_nibbles(values), scales[:, :2], 48, 128)


def _reference(x: torch.Tensor, fmt: QuantFormat, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The dequantized weight's product in float32, scales rounded to the activations' dtype as the kernels
    hold them."""
    return x.float() @ dequantize(values, scales.to(x.dtype), fmt).T


@pytest.mark.parametrize("own_kernels", [True, False], ids=["omnistage-kernels", "torch-ops"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", [INT8, QuantFormat(8, 32), INT4, QuantFormat(4, 128)],
                         ids=["int8", "int8-g32", "int4-g32", "int4-g128"])
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_kernels_match_dequantized_weight(fmt: QuantFormat, dtype: torch.dtype, rows: int, own_kernels: bool,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    if not own_kernels:
        monkeypatch.setenv("OMNISTAGE_CPU_KERNELS", "0")
    elif not quant_kernels.available():
        pytest.skip("no C compiler: omnistage's quantized kernels are not built")
    w = _weight()
    values, scales = quantize(w, fmt)
    packed = pack_weight(values, scales, fmt, dtype)
    # int4 on the CPU: omnistage's kernel on the checkpoint's nibbles, else torch's int4pack
    assert packed.layout == ("int8" if fmt.bits == 8 else "nibbles" if own_kernels else "int4pack")
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = quant_matmul(x, packed)
    ref = _reference(x, fmt, values, scales)
    assert out.dtype == dtype and out.shape == (rows, 48)
    if dtype is torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:  # every kernel rounds the float32 result once; the summation order is its own: one bfloat16 step
        torch.testing.assert_close(out.float(), ref, rtol=2 ** -7, atol=1e-2)
    # the layout's own dequantization is the weight the kernel multiplies by
    torch.testing.assert_close(packed.dequantize(), dequantize(values, scales.to(dtype), fmt), rtol=0, atol=1e-6)


def test_portable_layout_where_the_kernel_does_not_take_the_shape() -> None:
    w = _weight(n=24)  # 24 rows: torch's int4 CPU kernel needs a multiple of 16... and 24 is not a multiple of 64
    fmt = QuantFormat(4, 16)  # a group size its kernel does not take
    values, scales = quantize(w, fmt)
    packed = pack_weight(values, scales, fmt, torch.float32)
    assert packed.layout == "nibbles"
    x = torch.randn(3, 128)
    torch.testing.assert_close(quant_matmul(x, packed), _reference(x, fmt, values, scales), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inputs", [20, 36, 100, 104, 112])
def test_int8_rows_of_any_length_match_the_dequantized_weight(dtype: torch.dtype, inputs: int) -> None:
    """int8 per channel where omnistage's kernels do not take the row (not a multiple of 32). torch 2.13's int8 kernel
    in bfloat16 gave wrong sums for rows whose inputs are not a multiple of its vector (8 with AVX2, 16 with AVX-512:
    104 inputs gave 1e18 there) and then crashed the process (a checkpoint with hidden size 100 under
    ``--quantization int8 --dtype bfloat16``): those take the dequantizing path."""
    values, scales = quantize(_weight(k=inputs), INT8)
    packed = pack_weight(values, scales, INT8, dtype)
    for rows in (1, 2, 3, 40):
        x = torch.randn(rows, inputs, generator=torch.Generator().manual_seed(rows)).to(dtype)
        out = quant_matmul(x, packed)
        ref = _reference(x, INT8, values, scales)
        if dtype is torch.float32:
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        else:
            torch.testing.assert_close(out.float(), ref, rtol=2 ** -7, atol=1e-2)


@pytest.mark.parametrize("fmt", [INT8, QuantFormat(8, 32), INT4], ids=["int8", "int8-g32", "int4"])
def test_buffer_rows_in_parts_equal_whole_weight(fmt: QuantFormat) -> None:
    experts = torch.randn(3, 32, 64)  # [E, N, K]: stacked experts, filled one checkpoint part at a time
    buffer = QuantBuffer(tuple(experts.shape), fmt, torch.device("cpu"))
    for e in range(3):
        for half in (slice(0, 16), slice(16, 32)):  # e.g. gate then up
            assert not buffer.complete
            buffer.write_rows(e * 32 + half.start, experts[e, half])
    assert buffer.complete
    packed = buffer.pack(torch.float32)
    values, scales = quantize(experts.reshape(-1, 64), fmt)
    whole = dequantize(values, scales, fmt).view(3, 32, 64)
    for e in range(3):
        torch.testing.assert_close(packed.select(e).dequantize(), whole[e], rtol=0, atol=1e-6)


def test_buffer_refuses_incomplete_and_misfit_rows() -> None:
    buffer = QuantBuffer((32, 64), INT8, torch.device("cpu"))
    buffer.write_rows(0, torch.randn(16, 64))
    with pytest.raises(ValueError, match="16 rows not loaded"):
        buffer.pack(torch.float32)
    with pytest.raises(ValueError, match="do not fit"):
        buffer.write_rows(24, torch.randn(16, 64))
