"""omnistage's quantized CPU kernels (``quant_kernels``) against the dequantized weights: linear layers at
decode and prefill row counts, with and without a bias, float32 and bfloat16; a row's result independent of its
batch; the one-call MoE layer against each expert's SwiGLU; the shapes they refuse."""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from omnistage.models.layers import c_build, quant_kernels
from omnistage.models.layers.quant import QuantFormat, dequantize, pack_nibbles, quantize

pytestmark = pytest.mark.skipif(not quant_kernels.available(), reason="no C compiler: the kernels are not built")

# (The int path unpacks int4 in steps of 32, 64 or, on AVX-512, 128 inputs, chosen by the group: each is here.)
# int8 in groups takes the same chunked epilogue per group (one scale per 32, 64 or 128 inputs).
FORMATS = [QuantFormat(4, 32), QuantFormat(4, 64), QuantFormat(4, 128), QuantFormat(8), QuantFormat(8, 32),
           QuantFormat(8, 64), QuantFormat(8, 128)]
IDS = ["int4-g32", "int4-g64", "int4-g128", "int8", "int8-g32", "int8-g64", "int8-g128"]


def _quantized(n: int, k: int, fmt: QuantFormat, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)
    values, scales = quantize(w, fmt)
    data = pack_nibbles(values) if fmt.bits == 4 else values
    scales = scales.to(dtype)
    return data, scales, dequantize(values, scales.float(), fmt)


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype
    if dtype is torch.float32:  # float32 sums in another order than the GEMM
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    else:  # one bfloat16 rounding of the float32 result
        torch.testing.assert_close(out.float(), ref, rtol=2**-7, atol=2**-7 * float(ref.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
@pytest.mark.parametrize("shape", [(48, 128), (33, 256), (7, 384)], ids=["48x128", "33x256-odd-rows", "7x384"])
@pytest.mark.parametrize("rows", [1, 2, 3, 16, 37])
def test_linear_matches_dequantized_weight(fmt: QuantFormat, dtype: torch.dtype, shape: tuple[int, int],
                                           rows: int) -> None:
    n, k = shape
    fmt = fmt.for_inputs(k)
    if k % (fmt.group_size or k):
        pytest.skip("shape not in whole groups")
    data, scales, weight = _quantized(n, k, fmt, dtype)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2))
    out = quant_kernels.linear(x, fmt.bits, fmt.group_size, data, scales, bias)
    _close(out, x.float() @ weight.T + bias, dtype)
    _close(quant_kernels.linear(x, fmt.bits, fmt.group_size, data, scales), x.float() @ weight.T, dtype)


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_row_results_do_not_depend_on_the_batch(fmt: QuantFormat) -> None:
    # 41 output rows: a work item's odd last row goes alone, the others in pairs; 11 rows: blocks of 4 and a
    # remainder of 3; one row alone takes the single-row tile
    data, scales, _ = _quantized(41, 256, fmt, torch.bfloat16)
    x = torch.randn(11, 256, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    whole = quant_kernels.linear(x, fmt.bits, fmt.group_size, data, scales)
    for start, stop in ((0, 1), (3, 4), (1, 3), (2, 7), (6, 7), (5, 11), (10, 11)):
        part = quant_kernels.linear(x[start:stop], fmt.bits, fmt.group_size, data, scales)
        assert torch.equal(part, whole[start:stop])
    torch.set_num_threads(1)
    try:
        assert torch.equal(quant_kernels.linear(x, fmt.bits, fmt.group_size, data, scales), whole)
    finally:
        torch.set_num_threads(2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("formats", [(QuantFormat(4, 32), QuantFormat(4, 32)), (QuantFormat(4, 64), QuantFormat(8)),
                                     (QuantFormat(8), QuantFormat(8)), (QuantFormat(8, 64), QuantFormat(8, 32))],
                         ids=["int4", "int4-int8", "int8", "int8-groups"])
def test_moe_layer_matches_each_experts_swiglu(formats: tuple[QuantFormat, QuantFormat], dtype: torch.dtype) -> None:
    experts, hidden, inter = 6, 64, 96
    fmt_up, fmt_down = formats
    ups = [_quantized(2 * inter, hidden, fmt_up, dtype, seed=10 + e) for e in range(experts)]
    downs = [_quantized(hidden, inter, fmt_down, dtype, seed=20 + e) for e in range(experts)]
    counts = torch.tensor([3, 0, 1, 5, 0, 2])  # experts without rows are skipped
    x = torch.randn(int(counts.sum()), hidden, generator=torch.Generator().manual_seed(4)).to(dtype)
    stack = lambda parts, i: torch.stack([p[i] for p in parts])  # noqa: E731
    out = quant_kernels.moe(x, counts, (fmt_up.bits, fmt_up.group_size, stack(ups, 0), stack(ups, 1)),
                            (fmt_down.bits, fmt_down.group_size, stack(downs, 0), stack(downs, 1)))
    ref, start = [], 0
    for e, count in enumerate(counts.tolist()):
        rows = x[start:start + count].float()
        h = rows @ ups[e][2].T
        ref.append((F.silu(h[:, :inter]) * h[:, inter:]) @ downs[e][2].T)
        start += count
    _close(out, torch.cat(ref), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routed_moe_layer_weights_and_sums_each_tokens_slots(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    experts, hidden, inter, top_k, tokens = 6, 128, 64, 3, 11
    fmt = QuantFormat(4, 32)
    ups = [_quantized(2 * inter, hidden, fmt, dtype, seed=30 + e) for e in range(experts)]
    downs = [_quantized(hidden, inter, fmt, dtype, seed=40 + e) for e in range(experts)]
    up = (4, 32, torch.stack([u[0] for u in ups]), torch.stack([u[1] for u in ups]))
    dn = (4, 32, torch.stack([d[0] for d in downs]), torch.stack([d[1] for d in downs]))
    g = torch.Generator().manual_seed(6)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    ids = torch.rand(tokens, experts, generator=g).topk(top_k, dim=1).indices
    ids[:, 0] = 4  # one expert in every token, another in none
    ids[ids == 1] = 5
    weights = torch.rand(tokens, top_k, generator=g).to(dtype)
    out = quant_kernels.moe_routed(x, ids, weights, up, dn)
    ref = torch.zeros(tokens, hidden)
    for t in range(tokens):
        for k in range(top_k):
            e = int(ids[t, k])
            h = x[t].float() @ ups[e][2].T
            ref[t] += float(weights[t, k]) * ((F.silu(h[:inter]) * h[inter:]) @ downs[e][2].T)
    _close(out, ref, dtype)
    # a token's output does not depend on the others in its call (parts of whole tokens)
    monkeypatch.setattr(quant_kernels, "MOE_ROWS_PER_CALL", 2 * top_k)
    assert torch.equal(quant_kernels.moe_routed(x, ids, weights, up, dn), out)


def test_moe_layer_in_parts_equals_one_call(monkeypatch: pytest.MonkeyPatch) -> None:
    fmt = QuantFormat(4, 32)
    ups = [_quantized(64, 64, fmt, torch.bfloat16, seed=e) for e in range(4)]
    downs = [_quantized(64, 32, fmt, torch.bfloat16, seed=9 + e) for e in range(4)]
    up = (4, 32, torch.stack([u[0] for u in ups]), torch.stack([u[1] for u in ups]))
    dn = (4, 32, torch.stack([d[0] for d in downs]), torch.stack([d[1] for d in downs]))
    counts = torch.tensor([5, 0, 9, 3])
    x = torch.randn(17, 64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    whole = quant_kernels.moe(x, counts, up, dn)
    monkeypatch.setattr(quant_kernels, "MOE_ROWS_PER_CALL", 6)  # expert 2 alone exceeds it
    assert torch.equal(quant_kernels.moe(x, counts, up, dn), whole)


def test_shapes_the_kernels_take() -> None:
    cpu = torch.device("cpu")
    assert quant_kernels.takes(4, 128, 2048, cpu) and quant_kernels.takes(8, None, 1024, cpu)
    assert not quant_kernels.takes(4, 16, 256, cpu)  # groups of 16: torch's ops or the fallback serve
    assert not quant_kernels.takes(4, 128, 192, cpu)  # not whole groups
    assert not quant_kernels.takes(8, None, 80, cpu)  # inputs not a multiple of 32
    assert quant_kernels.takes(8, 64, 256, cpu) and not quant_kernels.takes(8, 48, 192, cpu)  # int8 groups of 32n
    assert not quant_kernels.takes(4, 128, 2048, torch.device("meta"))


def test_turned_off_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNISTAGE_CPU_KERNELS", "0")
    assert not quant_kernels.takes(4, 128, 2048, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="OMNISTAGE_CPU_KERNELS=0"):
        quant_kernels.linear(torch.randn(1, 64), 4, 32, torch.zeros(4, 32, dtype=torch.uint8), torch.ones(4, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_bfloat16_linear(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(6)
    weight = torch.randn(37, 96, generator=g).to(torch.bfloat16)
    bias = torch.randn(37, generator=g)
    x = torch.randn(9, 96, generator=g).to(dtype)
    out = quant_kernels.dense_linear(x, weight, bias)
    _close(out, x.float() @ weight.float().T + bias, dtype)
    assert all(torch.equal(out[i:i + 1], quant_kernels.dense_linear(x[i:i + 1], weight, bias)) for i in (0, 4, 8))
    assert quant_kernels.takes_dense(weight) and not quant_kernels.takes_dense(weight[:, :40])
    assert not quant_kernels.takes_dense(weight.float())


def test_calls_inside_and_outside_inference_mode() -> None:
    """Scratch buffers made under inference mode serve later calls outside it (and the other way round)."""
    data, scales, weight = _quantized(40, 256, QuantFormat(4, 128), torch.bfloat16)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    bias = torch.randn(40)
    with torch.inference_mode():
        inside = quant_kernels.linear(x, 4, 128, data, scales, bias)
    outside = quant_kernels.linear(x, 4, 128, data, scales, bias)
    assert torch.equal(inside, outside)
    dense = weight.to(torch.bfloat16)
    with torch.inference_mode():
        inside = quant_kernels.dense_linear(x, dense, bias)
    assert torch.equal(quant_kernels.dense_linear(x, dense, bias), inside)


def test_built_for_this_cpu() -> None:
    """-march=native: a CPU with AVX-512 (F + BW) gets the 512-bit int path, one with AVX2 + FMA the 256-bit one."""
    flags = next((line.split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
    expected = ("avx512" if {"avx512f", "avx512bw", "avx2", "fma"} <= set(flags)
                else "avx2" if {"avx2", "fma"} <= set(flags) else "portable")
    assert quant_kernels.isa() == expected


def test_a_kernel_library_first_asked_for_inside_a_compiled_graph_is_built_there():
    """A quantized code predictor's compiled frame may be the first to ask whether the kernels are built (int8
    layers pack without asking): the build runs while the graph is traced instead of failing the compile (dynamo
    cannot enter the build's lock), which had sent the frame to eager for good."""
    built = []
    library = c_build.LazyLibrary(lambda: built.append(1) or ctypes.CDLL(None), "test kernels", "nothing")

    @torch.compile(fullgraph=True, backend="eager")
    def frame(x: torch.Tensor) -> torch.Tensor:
        return x * 2 if library.available() else x

    assert torch.equal(frame(torch.ones(3)), torch.full((3,), 2.0)) and built == [1]
    assert library.available() and built == [1]  # built once
