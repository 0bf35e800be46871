import dataclasses
import math
import random

import pytest
import torch

from omnistage.attention import backend
from omnistage.attention.backend import (
    allocate_kv_cache,
    build_attention_metadata,
    paged_attention,
    scratch_slot,
)
from omnistage.models.layers import cpu_kernels

BLOCK = 4
NUM_BLOCKS = 64


def naive_causal(q, k, v, scale, window=None):
    """Full causal attention for one request: q [t, H, D] against k/v [t, Hkv, D] (``window``: each query sees
    itself and the window - 1 keys before it)."""
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, 1)
    v = v.repeat_interleave(rep, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    t = q.shape[0]
    hidden = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
    if window is not None:
        hidden |= torch.tril(torch.ones(t, t, dtype=torch.bool), -window)
    s = s.masked_fill(hidden, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


def run_steps(seqs, schedule, heads=4, kv_heads=2, dim=8, padded_extra=0, decode_kernel=None, dtype=torch.float32,
              window=None):
    """Feed each sequence's rows in the given per-step chunk sizes; return outputs per sequence."""
    scale = 1 / math.sqrt(dim)
    (cache,) = allocate_kv_cache(1, NUM_BLOCKS, BLOCK, kv_heads, dim, dtype=dtype)
    # Blocks are handed out non-contiguously and interleaved across requests on purpose.
    free = list(range(NUM_BLOCKS))[::-1]
    tables = {i: [] for i in range(len(seqs))}
    done = {i: 0 for i in range(len(seqs))}
    outs = {i: [] for i in range(len(seqs))}
    for step in schedule:  # step: list of (seq index, n tokens) in batch order
        qs, ks, vs, qlens, ctxs, tabs = [], [], [], [], [], []
        for i, n in step:
            q, k, v = seqs[i]
            need = math.ceil((done[i] + n) / BLOCK)
            while len(tables[i]) < need:
                tables[i].append(free.pop(len(free) // 2))
            qs.append(q[done[i] : done[i] + n])
            ks.append(k[done[i] : done[i] + n])
            vs.append(v[done[i] : done[i] + n])
            qlens.append(n)
            ctxs.append(done[i])
            tabs.append(tables[i])
        num = sum(qlens)
        pad = num + padded_extra
        q = torch.cat(qs + [torch.randn(padded_extra, heads, dim, dtype=dtype)])
        k = torch.cat(ks + [torch.randn(padded_extra, kv_heads, dim, dtype=dtype)])
        v = torch.cat(vs + [torch.randn(padded_extra, kv_heads, dim, dtype=dtype)])
        meta = build_attention_metadata(qlens, ctxs, tabs, BLOCK, NUM_BLOCKS, num_padded_tokens=pad)
        o = paged_attention(q, k, v, cache, meta, scale, compute_dtype=torch.float32, decode_kernel=decode_kernel,
                            window=window)
        assert torch.all(o[num:] == 0)
        start = 0
        for (i, n) in step:
            outs[i].append(o[start : start + n])
            done[i] += n
            start += n
    return {i: torch.cat(o) for i, o in outs.items()}, scale


def make_seqs(lengths, heads=4, kv_heads=2, dim=8):
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(t, heads, dim, generator=g), torch.randn(t, kv_heads, dim, generator=g),
         torch.randn(t, kv_heads, dim, generator=g))
        for t in lengths
    ]


SCHEDULE = [
    [(0, 5), (1, 6)],  # prefill chunk + full prefill
    [(1, 1), (0, 4), (2, 7)],  # decode, last prefill chunk, new request
    [(2, 1), (0, 1)],  # a one-row prefill remainder next to a decode; reordered batch
    [(0, 1), (2, 5)],
    [(2, 1)],
    [(1, 1), (0, 1), (2, 1)],  # decode only
]
SEQ_LENGTHS = [12, 8, 15]  # what SCHEDULE feeds


@pytest.mark.parametrize("padded_extra", [0, 3])
def test_chunked_prefill_and_decode_match_full_causal_attention(padded_extra):
    seqs = make_seqs(SEQ_LENGTHS)
    outs, scale = run_steps(seqs, SCHEDULE, padded_extra=padded_extra)
    for i, (q, k, v) in enumerate(seqs):
        expect = naive_causal(q, k, v, scale)
        assert outs[i].shape == expect.shape
        torch.testing.assert_close(outs[i], expect, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 2, 3, 5, 16])
@pytest.mark.parametrize("kernel", [False, True])
def test_sliding_window_matches_windowed_causal_attention(window, kernel):
    """A sliding-window layer over prefill chunks (fresh and after cached keys), mixed steps and decode rows,
    with padding; the decode kernel, where given, leaves the window to the general path."""
    seqs = make_seqs(SEQ_LENGTHS)
    decode_kernel = cpu_kernels.decode_attention if kernel and cpu_kernels.supports_decode_attention(
        torch.float32, 8, torch.device("cpu")) else None
    outs, scale = run_steps(seqs, SCHEDULE, padded_extra=2, decode_kernel=decode_kernel, window=window)
    for i, (q, k, v) in enumerate(seqs):
        torch.testing.assert_close(outs[i], naive_causal(q, k, v, scale, window), atol=1e-5, rtol=1e-5)
    if window < max(SEQ_LENGTHS):  # the window changes the result
        assert not torch.allclose(outs[2], naive_causal(*seqs[2], scale), atol=1e-3)


def test_metadata_rejects_short_block_table_and_bad_padding():
    with pytest.raises(ValueError, match="cannot hold"):
        build_attention_metadata([5], [0], [[0]], BLOCK, NUM_BLOCKS)
    with pytest.raises(ValueError, match="smaller"):
        build_attention_metadata([5], [0], [[0, 1]], BLOCK, NUM_BLOCKS, num_padded_tokens=3)


def test_bfloat16_cache_attends_in_float32_when_asked():
    """``compute_dtype=float32`` (the ``fast`` option's bfloat16 decoders on CPU): the bfloat16 cache's context
    attended in float32, the output rounded to bfloat16 once, the same rows as naive attention."""
    heads, kv_heads, dim = 4, 2, 8
    scale = 1 / math.sqrt(dim)
    seqs = [tuple(t.bfloat16() for t in s) for s in make_seqs([9, 5], heads, kv_heads, dim)]
    (cache,) = allocate_kv_cache(1, NUM_BLOCKS, BLOCK, kv_heads, dim, dtype=torch.bfloat16)
    tables = [[3, 7, 1], [5, 2]]
    meta = build_attention_metadata([9, 5], [0, 0], tables, BLOCK, NUM_BLOCKS)
    q, k, v = (torch.cat([s[j] for s in seqs]) for j in range(3))
    got = paged_attention(q, k, v, cache, meta, scale, compute_dtype=torch.float32)
    plain = paged_attention(q, k, v, cache, meta, scale)
    assert got.dtype == plain.dtype == torch.bfloat16
    want = torch.cat([naive_causal(sq.float(), sk.float(), sv.float(), scale).bfloat16() for sq, sk, sv in seqs])
    # Float32 arithmetic rounded once: the float32 reference's bfloat16 values, but for a rare rounding tie.
    assert (got == want).float().mean().item() >= 0.97
    assert (got.float() - want.float()).abs().max().item() <= 2 ** -7
    assert (plain.float() - want.float()).abs().max().item() <= 2 ** -5


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler to build omnistage's CPU kernels")
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2 ** -7)])
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (6, 6)])
def test_decode_kernel_reads_the_paged_cache_in_place_and_matches(dtype, tol, heads, kv_heads):
    """The ``fast`` option's decode attention (``cpu_kernels.decode_attention``): decode rows of mixed steps
    (prefill chunks around them, padded rows, blocks scattered) attended from the cache in place give naive
    attention's rows; float32 arithmetic, bfloat16 caches rounded once (as the prefill rows, attended in float32
    as the ``fast`` option's bfloat16 decoders do)."""
    dim = 32
    seqs = [tuple(t.to(dtype) for t in s) for s in make_seqs(SEQ_LENGTHS, heads, kv_heads, dim)]
    calls = []

    def kernel(q, *args):
        calls.append(args[1].numel())
        cpu_kernels.decode_attention(q, *args)

    outs, scale = run_steps(seqs, SCHEDULE, heads, kv_heads, dim, padded_extra=2, decode_kernel=kernel, dtype=dtype)
    assert calls == [1, 2, 1, 1, 3]  # every step's single-row queries but the first step's
    for i, (q, k, v) in enumerate(seqs):
        expect = naive_causal(q.float(), k.float(), v.float(), scale)
        assert outs[i].dtype == dtype
        assert (outs[i].float() - expect).abs().max().item() <= tol, i


def test_decode_step_metadata_equals_the_general_path():
    """A step of one query per request takes its own, shorter path: the same tensors as the general one (block
    tables of different lengths, padding rows, requests at position 0)."""
    rng = random.Random(3)
    for _ in range(50):
        n, block_size, num_blocks = rng.randint(1, 16), rng.choice([4, 16]), 300
        context = [rng.choice([0, rng.randint(0, 70)]) for _ in range(n)]
        tables = [rng.sample(range(num_blocks), (c + block_size) // block_size + rng.randint(0, 2)) for c in context]
        padded = n + rng.randint(0, 3)
        fast = build_attention_metadata([1] * n, context, tables, block_size, num_blocks, padded)
        general = backend._general_metadata([1] * n, context, tables, block_size, num_blocks, padded,
                                            scratch_slot(num_blocks, block_size), "cpu")
        for a, b in [(fast, general), *zip(fast.groups, general.groups, strict=True)]:
            for field in dataclasses.fields(a):
                x, y = getattr(a, field.name), getattr(b, field.name)
                if isinstance(x, torch.Tensor):
                    assert x.dtype == y.dtype and torch.equal(x, y), field.name
                elif field.name != "groups":
                    assert x == y, field.name
