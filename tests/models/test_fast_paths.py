"""The serving fast paths equal their reference paths: fused weights load from and save as the checkpoint's
separate tensors; the grouped expert GEMM gives the loop's bits; the code predictor's whole-frame function
(eager loop and compiled scan) gives ``predict``'s codes and embedding sums exactly, greedy and seeded
sampling, and a sampled request's codes do not depend on its batch mates."""

from __future__ import annotations

import gc
import mmap
import shutil
import sys
import sysconfig

import pytest
import torch
import torch.nn.functional as F

from omnistage.models.layers import amx_kernels, cpu_kernels
from omnistage.models.layers.amx_kernels import AmxWeight
from omnistage.models.layers.attention import SelfAttention
from omnistage.models.layers.compiled import LazyCompiled
from omnistage.models.layers.decoder import DecoderConfig, PagedDecoder
from omnistage.models.layers.fast_linear import (
    DenseBf16Linear,
    PackedLinear,
    can_pack,
    fast_kernels,
    onednn_available,
    pack_embedding,
)
from omnistage.models.layers.mlp import GatedMLP
from omnistage.models.layers.moe import WIDENED_BF16_MAX_ROWS_PER_EXPERT, SparseMoE
from omnistage.models.layers.quant import QuantFormat
from omnistage.models.layers.quant_kernels import KernelWeight
from omnistage.models.layers.quant_layers import QuantScheme, pack_if_complete, quantize_targets
from omnistage.models.qwen3_omni.code_predictor import (
    RESIDUAL_TOP_K,
    RESIDUAL_TOP_P,
    CodePredictor,
    CodePredictorConfig,
    _math_attention,
    _torch_draws,
    draw_residual_noise,
)


def _seeded(module: torch.nn.Module, seed: int = 0, std: float = 0.3) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return module.eval()


def _quantized(module: torch.nn.Module, method: str | None, prefix: str, dtype: torch.dtype) -> torch.nn.Module:
    """``module``'s decoder layers (under ``prefix``) quantized from their own float weights, as a quantizing load
    quantizes a checkpoint's (int8 per channel, ``int8-g32`` in groups of 32, int4 in groups of 32; routers and
    shared gates kept)."""
    if method is None:
        return module
    expected = module.state_dict(keep_vars=True)
    weights = {name: t.detach().clone() for name, t in expected.items()}
    fmt = {"int8": QuantFormat(8), "int8-g32": QuantFormat(8, 32), "int4": QuantFormat(4, 32)}[method]
    for name, target in quantize_targets(module, expected, QuantScheme({prefix: fmt}), dtype).items():
        target.buffer.write_rows(target.start, weights[name])
        pack_if_complete(target.module)
    return module


def test_fused_projections_load_and_save_under_checkpoint_names():
    attn = SelfAttention(16, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, qkv_bias=True, o_bias=True)
    names = set(attn.state_dict())
    assert {"q_proj.weight", "k_proj.bias", "v_proj.weight", "o_proj.weight"} <= names
    assert not any(n.startswith("qkv_proj") for n in names)
    g = torch.Generator().manual_seed(1)
    ckpt = {k: torch.randn(v.shape, generator=g) for k, v in attn.state_dict().items()}
    attn.load_state_dict(ckpt, strict=True)
    x = torch.randn(5, 16, generator=g)
    fused = attn.qkv_proj(x)
    parts = [F.linear(x, ckpt[f"{p}_proj.weight"], ckpt[f"{p}_proj.bias"]) for p in "qkv"]
    assert torch.equal(fused, torch.cat(parts, dim=-1))  # stacking changes no output bit
    assert all(torch.equal(attn.state_dict()[k], v) for k, v in ckpt.items())

    # Built on the meta device and loaded by assignment (big checkpoints): the fused tensor materialises.
    with torch.device("meta"):
        lazy = GatedMLP(16, 24)
    mlp_ckpt = {k: torch.randn(v.shape, generator=g) for k, v in GatedMLP(16, 24).state_dict().items()}
    lazy.load_state_dict(mlp_ckpt, strict=True, assign=True)
    assert not lazy.gate_up_proj.weight.is_meta
    assert all(torch.equal(lazy.state_dict()[k], v) for k, v in mlp_ckpt.items())

    # A loader writing into state_dict(keep_vars=True) entries writes through to the fused weight.
    mlp = GatedMLP(16, 24)
    with torch.no_grad():
        mlp.state_dict(keep_vars=True)["up_proj.weight"].copy_(mlp_ckpt["up_proj.weight"])
    assert torch.equal(mlp.gate_up_proj.weight[24:], mlp_ckpt["up_proj.weight"])

    partial = {k: v for k, v in mlp_ckpt.items() if k != "gate_proj.weight"}
    with pytest.raises(RuntimeError, match="gate_proj.weight"):
        GatedMLP(16, 24).load_state_dict(partial, strict=True)
    bad = dict(mlp_ckpt, **{"up_proj.weight": torch.zeros(23, 16)})
    with pytest.raises(RuntimeError, match="size mismatch for up_proj.weight"):
        GatedMLP(16, 24).load_state_dict(bad, strict=True)


def test_stacked_experts_keep_per_expert_names_and_grouped_gemm_equals_loop():
    moe = _seeded(SparseMoE(16, 24, num_experts=6, top_k=2, norm_topk_prob=True, shared_expert_intermediate_size=8))
    names = set(moe.state_dict())
    assert {f"experts.{e}.{p}_proj.weight" for e in range(6) for p in ("gate", "up", "down")} <= names
    assert {"shared_expert.gate_proj.weight", "shared_expert_gate.weight", "gate.weight"} <= names
    x = torch.randn(37, 16, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        grouped, loop = moe(x, grouped=True), moe(x, grouped=False)
        one_expert = moe.experts.down_proj[3] @ (
            F.silu(moe.experts.gate_up_proj[3, :24] @ x[0]) * (moe.experts.gate_up_proj[3, 24:] @ x[0])
        )
    assert torch.equal(grouped, loop)
    assert (moe.experts.dense(x[:1])[3, 0] - one_expert).abs().max().item() <= 1e-5
    assert moe.route(x)[1].unique().numel() > 3  # routing really spreads rows over experts


def _predictor(groups: int = 5, seed: int = 0) -> CodePredictor:
    dec = DecoderConfig(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
                        intermediate_size=48, rms_norm_eps=1e-6, rope_theta=10000.0)
    return _seeded(CodePredictor(CodePredictorConfig(dec, vocab_size=64, num_code_groups=groups)), seed, std=0.5)


def _generators(seeds):
    return [None if s is None else torch.Generator().manual_seed(s) for s in seeds]


@pytest.mark.parametrize("groups", [2, 5])
@torch.inference_mode()
def test_frame_equals_predict_greedy_and_a_sampled_row_ignores_its_batch_mates(groups):
    cp = _predictor(groups)
    cp.frame_compiler.enabled = False
    g = torch.Generator().manual_seed(3)
    hidden, code0_embed = torch.randn(4, 32, generator=g), torch.randn(4, 32, generator=g)
    code0 = torch.tensor([1, 5, 9, 60])
    ref, ref_sum = cp.predict(hidden, code0, code0_embed, lambda logits, _g: logits.argmax(-1))
    codes, embed_sum = cp.complete_frames(hidden, code0, code0_embed, [None] * 4)
    assert torch.equal(codes, ref) and torch.equal(embed_sum, ref_sum)

    seeds = [None, 11, 12, None]
    batch, _ = cp.complete_frames(hidden, code0, code0_embed, _generators(seeds))
    assert torch.equal(batch[[0, 3]], ref[[0, 3]])  # greedy rows stay greedy next to sampled ones
    for i in (1, 2):
        alone, _ = cp.complete_frames(hidden[i : i + 1], code0[i : i + 1], code0_embed[i : i + 1], _generators([seeds[i]]))
        assert torch.equal(alone[0], batch[i])
    if groups > 2:
        # It really samples: other seeds give other codes for the same inputs.
        draws = {tuple(cp.complete_frames(hidden, code0, code0_embed, _generators([s] * 4))[0][1].tolist())
                 for s in range(8)}
        assert len(draws) > 1


@torch.inference_mode()
def test_residual_noise_draws_a_fixed_amount_per_sampled_request_and_none_for_greedy():
    g = torch.Generator().manual_seed(5)
    state = g.get_state()
    sampled, noise = draw_residual_noise([None, g], groups=3, k=7, device="cpu")
    assert sampled.tolist() == [False, True] and noise.shape == (2, 3, 7)
    assert torch.equal(noise[0], torch.ones(3, 7))
    replay = torch.Generator().manual_seed(5)
    assert torch.equal(noise[1], torch.empty(3, 7).exponential_(generator=replay))
    assert torch.equal(g.get_state(), replay.get_state()) and not torch.equal(g.get_state(), state)


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler to build omnistage's CPU kernels")
@pytest.mark.parametrize("vocab, scale", [(2048, 3.0), (2048, 0.3), (64, 2.0), (9000, 5.0)])
def test_residual_draw_kernel_equals_torchs_ops(vocab, scale):
    """``cpu_kernels.residual_draws`` (the CPU frames' top-k / top-p race in one call) picks the codes torch's
    ops pick, greedy rows their argmax; the block-maximum bound (2048 values), the insertion path (64 values:
    fewer blocks than candidates; 9000: more blocks than it keeps) alike."""
    g = torch.Generator().manual_seed(vocab)
    logits = scale * torch.randn(96, vocab, generator=g)
    noise = torch.empty(96, RESIDUAL_TOP_K).exponential_(generator=g)
    sampled = torch.rand(96, generator=g) < 0.75
    best = logits.argmax(-1)
    got = cpu_kernels.residual_draws(logits, sampled, noise, best, RESIDUAL_TOP_P)
    assert torch.equal(got, _torch_draws(logits, sampled, noise, best))
    assert torch.equal(got[~sampled], best[~sampled]) and not torch.equal(got[sampled], best[sampled])
    in_place = best.clone()  # the kernel frame's call: its argmax row in, its code out
    assert cpu_kernels.residual_draws(logits, sampled, noise, in_place, RESIDUAL_TOP_P, out=in_place) is in_place
    assert torch.equal(in_place, got)


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler to build omnistage's CPU kernels")
@pytest.mark.parametrize("vocab", [2048, 64])
def test_residual_draw_kernel_orders_equal_logits_by_index_and_keeps_the_top_p_prefix(vocab):
    """Equal logits rank in index order; a candidate with near-zero noise wins where the top-p prefix keeps it
    (uniform over 50: the first 40 reach 0.8), not past it; NaN logits give an index in range."""
    k = RESIDUAL_TOP_K
    logits = torch.zeros(4, vocab)
    logits[3, 7] = float("nan")
    noise = torch.ones(4, k)
    noise[0, 5] = 1e-30  # kept: the 6th candidate, index 5
    noise[1, 45] = 1e-30  # past the prefix: the race's first maximum, index 0
    noise[2, 39] = 1e-30  # the prefix's last
    codes = cpu_kernels.residual_draws(logits, torch.ones(4, dtype=torch.bool), noise, torch.zeros(4, dtype=torch.long),
                                       RESIDUAL_TOP_P)
    assert codes[:3].tolist() == [5, 0, 39] and 0 <= codes[3].item() < vocab
    with pytest.raises(ValueError, match="residual_draws needs"):
        cpu_kernels.residual_draws(logits, torch.ones(4, dtype=torch.bool), torch.ones(4, vocab + 1),
                                   torch.zeros(4, dtype=torch.long), RESIDUAL_TOP_P)


@torch.inference_mode()
def test_compiled_frame_equals_eager_frame_greedy_and_sampled():
    cp = _predictor(groups=5, seed=1)
    g = torch.Generator().manual_seed(4)
    eager = {}
    cases = [(3, [None, 21, None]), (1, [None]), (1, [22]), (5, [23, 24, None, 25, None])]
    inputs = [(torch.randn(b, 32, generator=g), torch.randint(0, 64, (b,), generator=g),
               torch.randn(b, 32, generator=g), seeds) for b, seeds in cases]
    with torch.inference_mode(False):  # the Talker stacks its hidden rows outside inference mode
        inputs[3] = (inputs[3][0].clone(), *inputs[3][1:])
    cp.frame_compiler.enabled = False
    for i, (h, c0, e0, seeds) in enumerate(inputs):
        eager[i] = cp.complete_frames(h, c0, e0, _generators(seeds))
    cp.frame_compiler.enabled = True
    cp.warm_up()  # compiles (what a model family does at load)
    assert cp.frame_compiler.failure is None, cp.frame_compiler.failure
    assert cp.frame_compiler.compile_seconds is not None
    for i, (h, c0, e0, seeds) in enumerate(inputs):
        with torch._dynamo.config.patch(error_on_recompile=True):  # one graph serves every batch size
            codes, embed_sum = cp.complete_frames(h, c0, e0, _generators(seeds))
        assert cp.frame_compiler.failure is None, cp.frame_compiler.failure
        assert torch.equal(codes, eager[i][0]), i
        assert torch.equal(embed_sum, eager[i][1]), i


@torch.inference_mode()
def test_a_compiled_pass_equals_the_eager_pass_in_every_bit():
    """Equal codes can hide drifting hidden states: one predictor pass (decoder layer, q/k norms, rotary,
    final norm) compiled gives the eager pass's bits. Inductor's own reductions and cos/sin differ in the last
    bits (~1e-7 here), which is why norms run as opaque ops in graphs and rotary tables are precomputed."""
    cp = _predictor(groups=5, seed=2)
    g = torch.Generator().manual_seed(6)
    hidden, code0_embed = torch.randn(3, 32, generator=g), torch.randn(3, 32, generator=g)

    def two_passes(h: torch.Tensor, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cache = cp.new_cache(h.shape[0], h)
        first = cp._first_pass(h, e, cache)
        return first, cp._next_pass(first, torch.tensor([2]), cache)

    compiled = LazyCompiled(two_passes, name="two passes", enabled=True)
    got, want = compiled(hidden, code0_embed), two_passes(hidden, code0_embed)
    assert compiled.failure is None, compiled.failure
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.skipif(not onednn_available(), reason="oneDNN is not available in this torch build")
@torch.inference_mode()
def test_packed_weights_replace_the_unpacked_ones_and_compute_the_same_products():
    """The ``fast`` option: products equal the default GEMM's to float rounding (not bitwise), experts
    included; each packed weight's unpacked parameter is released (one copy of the weights in memory); a
    weight tied to another parameter stays unpacked."""
    moe = _seeded(SparseMoE(16, 24, num_experts=6, top_k=2, norm_topk_prob=True, shared_expert_intermediate_size=8))
    mlp = _seeded(GatedMLP(16, 24), seed=1)
    x = torch.randn(9, 16, generator=torch.Generator().manual_seed(7))
    want_moe, want_mlp = moe(x), mlp(x)
    assert fast_kernels(moe, False) is moe and not any(isinstance(m, PackedLinear) for m in moe.modules())
    fast_kernels(moe, True), fast_kernels(mlp, True)
    # float32 experts: the expert kernel's panels are their one copy (oneDNN per expert where it cannot build).
    assert (moe.experts.panels is not None) == cpu_kernels.available()
    assert (moe.experts.packed is None) == cpu_kernels.available() and isinstance(mlp.gate_up_proj, PackedLinear)
    assert moe.experts.gate_up_proj.numel() == moe.experts.down_proj.numel() == 0
    assert mlp.gate_up_proj.weight.numel() == 0 and mlp.gate_up_proj.weight.dtype == torch.float32
    assert (moe(x) - want_moe).abs().max().item() <= 1e-5
    assert (mlp(x) - want_mlp).abs().max().item() <= 1e-5
    # The released weights cannot be saved by mistake as empty tensors.
    for module in (moe, moe.experts, mlp):
        with pytest.raises(RuntimeError, match="weights packed for serving"):
            module.state_dict()

    tied = torch.nn.ModuleDict({"embed": torch.nn.Embedding(10, 16), "head": torch.nn.Linear(16, 10, bias=False)})
    tied["head"].weight = tied["embed"].weight
    fast_kernels(tied, True)
    assert type(tied["head"]) is torch.nn.Linear and tied["embed"].weight.shape == (10, 16)


def _has_compiler() -> bool:
    return shutil.which((sysconfig.get_config_var("CC") or "cc").split()[0]) is not None


@pytest.mark.skipif(not _has_compiler(), reason="no C compiler to build the expert kernel")
@pytest.mark.parametrize("dtype, hidden, tol", [
    (torch.float32, 16, 1e-5),
    (torch.bfloat16, 16, 3e-2),  # with AVX512-BF16 (this project's CPU): the dot-product variant
    (torch.bfloat16, 15, 3e-2),  # an odd hidden size: the widened variant, as on CPUs without it
])
@torch.inference_mode()
def test_expert_kernel_equals_the_sparse_path_and_rows_ignore_their_batch_mates(dtype, hidden, tol):
    """The ``fast`` expert kernel: builds here; computes what the per-expert GEMMs compute (hidden and
    intermediate sizes off its panel widths, padded); serves every batch where it is as fast as oneDNN at any
    size, else up to its rows-per-expert limit (the per-expert packed copy serves more); gives a row the same
    bits whatever its batch mates and the thread count; takes empty batches."""
    assert cpu_kernels.available()
    moe = _seeded(SparseMoE(hidden, 24, num_experts=6, top_k=2, norm_topk_prob=True, shared_expert_intermediate_size=8))
    moe = moe.to(dtype)
    g = torch.Generator().manual_seed(11)
    xs = {n: torch.randn(n, hidden, generator=g).to(dtype) for n in (1, 3, 9, 40, 200)}
    want = {n: moe(x, grouped=False) for n, x in xs.items()}  # (torch's grouped GEMM needs 16-byte strides)
    fast_kernels(moe, True)
    any_batch = cpu_kernels.serves_any_batch(dtype, hidden)
    assert any_batch == (dtype == torch.float32 or hidden == 16 and cpu_kernels._dot_bf16(dtype, hidden))
    # A per-expert oneDNN copy serves large batches where the kernel loses there and oneDNN packs the dtype (its
    # bfloat16 needs AVX-512 BW/VL/DQ); without one the kernel serves every batch.
    per_expert = not any_batch and can_pack(torch.empty(1, hidden, dtype=dtype))
    assert moe.experts.panels is not None and (moe.experts.packed is not None) == per_expert
    calls = []
    kernel_call = moe.experts.kernel
    moe.experts.kernel = lambda x, *a: calls.append(x.shape[0]) or kernel_call(x, *a)
    for n, x in xs.items():
        got = moe(x)
        assert (got - want[n]).abs().max().item() <= tol * max(1.0, want[n].abs().max().item()), n
    assert moe.route(xs[40])[1].unique().numel() == 6  # rows really spread over the experts
    assert calls == [n for n in xs if not per_expert or n * 2 <= WIDENED_BF16_MAX_ROWS_PER_EXPERT * 6]
    if not per_expert:
        with pytest.raises(RuntimeError, match="expert kernel only"):
            moe(xs[9], kernel=False)
    else:  # above the limit: the per-expert GEMMs, close to the kernel
        assert (moe(xs[200], kernel=True) - moe(xs[200])).abs().max().item() <= tol * 10
    batch = moe(xs[40], kernel=True)
    assert all(torch.equal(batch[i : i + 1], moe(xs[40][i : i + 1], kernel=True)) for i in (0, 17, 39))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(moe(xs[40], kernel=True), batch)
    finally:
        torch.set_num_threads(threads)
    assert moe(xs[1][:0], kernel=True).shape == (0, hidden)


@pytest.mark.skipif(not _has_compiler(), reason="no C compiler to build the CPU kernels")
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@torch.inference_mode()
def test_panel_linear_equals_the_linear_and_rows_ignore_their_batch_mates(dtype, tol):
    """``fast`` linear layers on panels: the products of ``F.linear`` (bias included, output widths off the
    panel width padded, any leading dims) in float32, and in bfloat16 where the CPU has its dot products (else
    oneDNN's packed layout, or where oneDNN cannot pack bfloat16 widened bfloat16 panels); a row's bits do not
    depend on its batch mates or the thread count."""
    linear = _seeded(torch.nn.Linear(48, 37), std=0.2).to(dtype)
    x = torch.randn(2, 20, 48, generator=torch.Generator().manual_seed(3)).to(dtype)
    want = linear(x).float()
    fast_kernels(linear, True)
    probe = torch.empty(1, 48, dtype=dtype)
    if dtype == torch.bfloat16 and not cpu_kernels.supports_linear(probe):
        if can_pack(probe):
            assert linear.panels is None and linear.packed_weight is not None
            return
        if cpu_kernels.takes_widened(probe):  # no oneDNN bfloat16 on this CPU: widened bfloat16 panels
            assert linear.panels is not None and linear.panels.dtype == dtype and linear.weight.numel() == 0
        else:  # nor the panel kernels: omnistage's dense bfloat16 kernel, the weight kept
            assert type(linear) is DenseBf16Linear and linear.weight.numel() == 48 * 37
    else:
        assert linear.panels is not None and linear.packed_weight is None and linear.weight.numel() == 0
    got = linear(x)
    assert got.shape == (2, 20, 37) and got.dtype == dtype
    assert (got.float() - want).abs().max().item() <= tol * max(1.0, want.abs().max().item())
    assert all(torch.equal(got[1, i : i + 1], linear(x[1, i : i + 1])) for i in (0, 7, 19))
    # tiles of 2, 3 and 5 rows (AVX2's whole-panel 3-row tile orders its loads its own way) against 6-row ones
    assert all(torch.equal(got[1, :n], linear(x[1, :n])) for n in (2, 3, 5, 9))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(linear(x), got)
    finally:
        torch.set_num_threads(threads)
    assert linear(x[:, :0]).shape == (2, 0, 37)


@pytest.mark.skipif(not onednn_available(), reason="oneDNN is not available in this torch build")
@pytest.mark.parametrize("decoder_pass", [True, False])
@torch.inference_mode()
def test_fast_frame_packs_the_heads_and_picks_the_exact_frames_codes(decoder_pass, monkeypatch):
    """The ``fast`` code predictor: output heads packed (walked by a scanned index) and either every pass's
    decoder layers in one ``cpu_kernels.DecoderPass`` call (where the kernels build) or a compiled frame free
    to fuse norms and activations. Its rounding differs from the exact frame's, its picks do not (greedy and
    seeded)."""
    if decoder_pass and not cpu_kernels.available():
        pytest.skip("no C compiler to build omnistage's CPU kernels")
    if not decoder_pass:
        monkeypatch.setattr(cpu_kernels, "supports_decoder_layers", lambda *args: False)
    cp = _predictor(groups=5, seed=3)
    g = torch.Generator().manual_seed(8)
    cases = [(4, [None, 31, None, 32]), (1, [None]), (3, [33, None, 34])]
    inputs = [(torch.randn(b, 32, generator=g), torch.randint(0, 64, (b,), generator=g),
               torch.randn(b, 32, generator=g), seeds) for b, seeds in cases]
    cp.frame_compiler.enabled = False
    exact = [cp.complete_frames(h, c0, e0, _generators(seeds)) for h, c0, e0, seeds in inputs]
    fast_kernels(cp, True)
    assert cp.packed_heads is not None and len(cp.packed_heads) == 4 and not cp.frame_compiler.exact
    assert bool(cp.pass_layers()) == decoder_pass
    eager_fast = [cp.complete_frames(h, c0, e0, _generators(seeds)) for h, c0, e0, seeds in inputs]
    cp.frame_compiler.enabled = True
    cp.warm_up()
    assert cp.frame_compiler.failure is None, cp.frame_compiler.failure
    assert (cp.frame_compiler.compile_seconds is None) == decoder_pass  # kernel frames need no graph
    for i, (h, c0, e0, seeds) in enumerate(inputs):
        with torch._dynamo.config.patch(error_on_recompile=True):
            codes, embed_sum = cp.complete_frames(h, c0, e0, _generators(seeds))
        for got, got_sum in ((codes, embed_sum), eager_fast[i]):
            assert torch.equal(got, exact[i][0]), i
            assert (got_sum - exact[i][1]).abs().max().item() <= 1e-5, i


def _decoder_pass(x, table, position, shape, rope, eps, head=None):
    """One ``cpu_kernels.DecoderPass`` run on x: x, or with ``head`` = (norm, panels, vocabulary) (logits, picks)."""
    if head is None:
        cpu_kernels.DecoderPass(x, table, shape, rope, eps).run(position)
        return x
    norm, panels, vocab = head
    picks = torch.empty(x.shape[0], dtype=torch.int64)
    return cpu_kernels.DecoderPass(x, table, shape, rope, eps, (norm, panels.dtype, vocab)).run(position, panels,
                                                                                              picks), picks


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler to build omnistage's CPU kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [8, 16])  # the scalar and the 16-lane attention
@pytest.mark.parametrize("quant", [None, "int8", "int8-g32", "bf16-valued"])
@torch.inference_mode()
def test_decoder_pass_equals_the_layers_over_the_frame_cache(dtype, head_dim, quant):
    """``cpu_kernels.DecoderPass``: every layer of a pass in one call equals the decoder layers attending over
    the frame cache (a 2-row first pass, then a 1-row pass), float32 to rounding, bfloat16 to about one
    rounding; the keys and values land in the caches at the rows' positions. With int8 layers (the code
    predictor's under ``--quantization``) the pass runs them through the quantized kernels' phases; with
    bfloat16-valued weights on an AMX CPU (a checkpoint stored in bfloat16) its dense layers run on AMX tiles
    (``amx_kernels``' phase), float32 rows as three exact parts, each part summed on its own (a row's bits the same
    alone and in passes of 40 and 20 rows: groups of 16, 16 and 8 rows, 1 to 3 tiles a group)."""
    if not cpu_kernels.supports_decoder_layers(dtype, 64, head_dim):
        pytest.skip("the panel kernels are off")
    amx = quant == "bf16-valued"
    if amx and not amx_kernels.available():
        pytest.skip("no AMX on this CPU")
    quant = None if amx else quant
    dec = DecoderConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=head_dim,
                        intermediate_size=80 if quant is None and not amx else 96, rms_norm_eps=1e-6,
                        rope_theta=10000.0)
    cp = _seeded(CodePredictor(CodePredictorConfig(dec, vocab_size=64, num_code_groups=5)), seed=11, std=0.2)
    if amx:
        for p in cp.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    cp = _quantized(cp.to(dtype), quant, "model.layers.", dtype)
    fast_kernels(cp, True)
    layers = cp.pass_layers()
    assert len(layers) == 2
    assert all(isinstance(w.qkv, KernelWeight) and isinstance(w.down, KernelWeight) for w in layers) == bool(quant)
    if amx:
        assert all(isinstance(getattr(w, name), AmxWeight) for w in layers for name in ("qkv", "o", "gate_up", "down"))
    g = torch.Generator().manual_seed(12)
    batch = 20 if amx else 3  # AMX: passes of 40 and 20 rows
    first, second = (torch.randn(batch, n, 64, generator=g).to(dtype) for n in (2, 1))
    cache = cp.new_cache(batch, first)
    caches = [first.new_zeros(batch, 5, 2, head_dim) for _ in range(4)]
    table = cpu_kernels.decoder_table(layers, list(zip(caches[::2], caches[1::2])))
    rope = (cp.model.rope_cos.to(dtype), cp.model.rope_sin.to(dtype))
    tol = 1e-5 if dtype == torch.float32 else 2**-6
    if amx and dtype == torch.bfloat16:  # the layers one by one and the pass round in other places (bfloat16
        tol *= 2                         # activations between the kernel's phases), compounded over the layers
    norm = cp.model.norm.weight.float()
    for x, position in ((first, 0), (second, 2)):
        want = cp.model(x, torch.arange(position, position + x.shape[1]), cache)  # normed
        got = _decoder_pass(x.clone(), table, position, (4, 2, head_dim, 5), rope, 1e-6)
        got = cp.model.norm(got)
        assert (got.float() - want.float()).abs().max().item() <= tol * want.float().abs().max().item()
    # With the head: the last row's final norm, the group's logits and their argmax in the same call.
    for caches_i in caches:
        caches_i.zero_()
    _decoder_pass(first.clone(), table, 0, (4, 2, head_dim, 5), rope, 1e-6)
    logits, picks = _decoder_pass(second.clone(), table, 2, (4, 2, head_dim, 5), rope, 1e-6,
                                             (norm, cp.packed_heads[1], 64))
    want_logits = cp.logits(want[:, -1], 2).float()
    assert logits.shape == (batch, 64) and logits.dtype == dtype
    # A request's results do not depend on its batch mates: alone or with the next one they give the same bits.
    for lo, hi in ((4, 5), (19, 20), (7, 9)) if amx else ():
        alone = [c.new_zeros(hi - lo, *c.shape[1:]) for c in caches]
        table_alone = cpu_kernels.decoder_table(layers, list(zip(alone[::2], alone[1::2])))
        _decoder_pass(first[lo:hi].clone(), table_alone, 0, (4, 2, head_dim, 5), rope, 1e-6)
        logits_alone, _ = _decoder_pass(second[lo:hi].clone(), table_alone, 2, (4, 2, head_dim, 5), rope,
                                                   1e-6, (norm, cp.packed_heads[1], 64))
        assert torch.equal(logits_alone, logits[lo:hi])
    assert (logits.float() - want_logits).abs().max().item() <= 4 * tol * want_logits.abs().max().item()
    assert torch.equal(picks, logits.float().argmax(-1))
    for i in range(2):
        for mine, theirs in ((caches[2 * i], cache.k[i]), (caches[2 * i + 1], cache.v[i])):
            assert (mine.float() - theirs.float()).abs().max().item() <= tol * theirs.float().abs().max().item()
            assert mine[:, 3:].abs().max() == 0  # positions no pass reached stay empty


def _resident_mb() -> int:
    status = open("/proc/self/status").read()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1]) // 1024


@pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"),
                    reason="2 MB page advice is Linux's")
def test_packed_weights_go_to_large_page_memory_which_is_freed_with_them():
    """Weights the kernels stream (2 MB or more) are copied into 2 MB-aligned memory advised for huge pages;
    smaller ones stay as they are; the copy equals the original and its memory is returned when it dies."""
    small = torch.randn(16, 16)
    assert cpu_kernels.in_large_pages(small) is small
    weight = torch.randn(1024, 1024)
    copy = cpu_kernels.in_large_pages(weight)
    assert torch.equal(copy, weight) and copy.data_ptr() % (2 << 20) == 0
    copy.add_(1)  # writable, its own memory
    assert torch.equal(copy, weight + 1)
    if cpu_kernels.available():
        assert cpu_kernels.pack_linear(weight).data_ptr() % (2 << 20) == 0
    source = torch.ones(64 << 18)  # 64 MB, resident before the count starts
    gc.collect()
    before = _resident_mb()
    held = cpu_kernels.in_large_pages(source)
    assert _resident_mb() - before >= 60
    del held
    gc.collect()
    assert _resident_mb() - before <= 8


def test_math_attention_equals_sdpa_with_grouped_heads_and_the_frame_mask():
    """The ``fast`` bfloat16 frame's attention (broadcast products and sums in float32, the query heads of a
    key/value head sharing it) computes what ``scaled_dot_product_attention`` does: same heads paired, same
    positions masked; bfloat16 inputs give bfloat16 out, rounded from the float32 result."""
    g = torch.Generator().manual_seed(9)
    q, k, v = torch.randn(3, 2, 8, 16, generator=g), torch.randn(3, 6, 2, 16, generator=g), torch.randn(3, 6, 2, 16, generator=g)
    positions = torch.tensor([3, 4])
    mask = torch.arange(6)[None, :] <= positions[:, None]
    want = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                          scale=0.25, enable_gqa=True).transpose(1, 2)
    got = _math_attention(q, k, v, mask, 0.25)
    assert got.shape == want.shape and (got - want).abs().max().item() <= 1e-6
    assert (got[:, 0] - _math_attention(q, k.roll(1, dims=1), v, mask, 0.25)[:, 0]).abs().max() > 1e-3  # keys matter
    half = [t.bfloat16() for t in (q, k, v)]
    got_half = _math_attention(*half, mask, 0.25)
    want_half = F.scaled_dot_product_attention(*(t.float().transpose(1, 2) for t in half), attn_mask=mask, scale=0.25,
                                               enable_gqa=True).transpose(1, 2)
    assert got_half.dtype == torch.bfloat16
    assert (got_half.float() - want_half).abs().max().item() <= 2 ** -8 * want_half.abs().max().item()  # one rounding


def test_lazy_compiled_falls_back_to_the_eager_function():
    def breaks_the_graph(x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()
        return x * 2

    fn = LazyCompiled(breaks_the_graph, name="test", enabled=True)
    x = torch.arange(3.0)
    assert torch.equal(fn(x), x * 2) and fn.failure is not None and not fn.active
    assert torch.equal(fn(x), x * 2)
    off = LazyCompiled(lambda x: x + 1, name="off", enabled=False)
    assert torch.equal(off(x), x + 1) and off.compile_seconds is None


class _Compiles(torch.nn.Module):
    """A module whose method compiles once per instance, guarding on its own weight (as the code predictor's
    frame does)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(width, width), requires_grad=False)
        self.compiler = LazyCompiled(self._step, name="step", enabled=True, dynamic_batch=True)

    def _step(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ self.weight) + 1


def test_every_model_built_in_a_process_compiles():
    """Dynamo keeps graphs per code object and stops compiling one after 8: every model built in one process (a
    notebook, an evaluation loop) added one to the same method's count, so from the ninth on the code predictor's
    frame ran eagerly, and the dead models' graphs stayed. Each instance now compiles its own copy of the code."""
    for width in range(4, 16):
        module = _Compiles(width)
        x = torch.randn(3, width)
        assert torch.equal(module.compiler(x), torch.relu(x @ module.weight) + 1)
        assert module.compiler.failure is None and module.compiler.compile_seconds is not None, width
        del module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_takes_torchs_op_with_the_reference_bits(dtype):
    """RMSNorm's statistics go through ``F.rms_norm`` (one call): its bits equal the reference expression's
    (statistics in float32, cast back to the input dtype, then the weight), contiguous or not, at any scale."""
    from omnistage.models.layers.norm import rms_norm

    g = torch.Generator().manual_seed(10)
    for shape in [(16, 512), (3, 7, 4, 16), (2049, 96)]:
        for scale in (1e-3, 1.0, 50.0):
            x = (torch.randn(shape, generator=g) * scale).to(dtype)
            w = torch.randn(shape[-1], generator=g).to(dtype)
            for view in (x, x[::2], x.transpose(0, 1) if x.dim() > 2 else x.t().contiguous().t()):
                xf = view.float()
                want = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
                assert torch.equal(rms_norm(view, w, 1e-6), want), (shape, scale)


def test_fast_bfloat16_decoders_attend_in_float32_on_cpu():
    """``fast`` makes a bfloat16 decoder on CPU attend in float32 (torch's bfloat16 CPU attention is slower and
    less precise); a float32 one, and any decoder without ``fast``, attend in their own dtype."""
    cfg = DecoderConfig(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=32,
                        rms_norm_eps=1e-6, rope_theta=1e4)
    for dtype, want in ((torch.bfloat16, torch.float32), (torch.float32, None)):
        assert PagedDecoder(cfg).to(dtype).attention_dtype is None
        assert fast_kernels(PagedDecoder(cfg).to(dtype), True).attention_dtype == want


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler to build omnistage's CPU kernels")
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("weights,quant", [  # (quantized layers do not look at their float values' precision)
    *((weights, quant) for weights in ("float32", "bfloat16") for quant in (None, "int8", "int8-g32", "int4")),
    ("float32-bf16-values", None)])
def test_decoder_step_equals_the_layers_over_the_paged_cache(weights, shared, quant, monkeypatch):
    """``cpu_kernels.decoder_step`` (a decode step's layers in one call, the fast option's default on CPU) equals
    the decoder layers one by one: a dense layer, then routed experts with and without a sigmoid-gated shared
    expert; requests of different lengths in scattered cache blocks; keys and values land in the same slots;
    the hidden captured between layers and the final-normed output of ``run_layers`` agree too. Quantized
    layers (int8, int4: projections, experts, the shared expert) run through the quantized kernels' phases
    inside the same call; where AMX takes the dense layers (bfloat16 values), through its phase."""
    dtype = torch.bfloat16 if weights == "bfloat16" else torch.float32
    if not cpu_kernels.supports_decoder_layers(dtype, 64, 16):
        pytest.skip("the panel kernels are off")
    if (dtype == torch.bfloat16 and quant is None and cpu_kernels.widened_bf16_decoders()
            and can_pack(torch.zeros(32, 64, dtype=torch.bfloat16))):
        pytest.skip("without AVX512-BF16, where oneDNN packs bfloat16, plain bfloat16 layers keep its GEMMs")
    from omnistage.attention.backend import allocate_kv_cache, build_attention_metadata

    wide = quant is not None  # (the quantized kernels take inputs in multiples of 32)
    cfg = DecoderConfig(hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
                        intermediate_size=96 if wide else 80, rms_norm_eps=1e-6, rope_theta=1e4, num_experts=6,
                        num_experts_per_tok=2, moe_intermediate_size=32 if wide else 24, norm_topk_prob=not shared,
                        sparse_layers=(1, 2), shared_expert_intermediate_size=(64 if wide else 40) if shared else 0)
    dec = _seeded(PagedDecoder(cfg), seed=21, std=0.2)
    if weights == "float32-bf16-values":
        dec = dec.to(torch.bfloat16)
    dec = fast_kernels(_quantized(dec.to(dtype), quant, "layers.", dtype), True)
    assert len(dec.kernel_layers()) == 3
    dense = {type(w.qkv) for w in dec.kernel_layers()} | {type(w.gate_up) for w in dec.kernel_layers()[:1]}
    experts = {type(w.experts[0]) for w in dec.kernel_layers()[1:]}
    amx = amx_kernels.available() and weights != "float32"
    assert experts == {KernelWeight if quant else torch.Tensor}
    assert dense == {KernelWeight if quant else AmxWeight if amx else torch.Tensor}
    # float32 rows on bfloat16 pair panels: 6 experts for 2 selections a token take AMX tiles too
    assert [w.experts_on_amx for w in dec.kernel_layers()[1:]] == [amx and weights == "float32-bf16-values"] * 2
    caches = allocate_kv_cache(3, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=16, dtype=dtype)
    tables, contexts = [[5, 2], [7], [0, 6, 3]], [5, 1, 9]
    g = torch.Generator().manual_seed(22)
    prompt = torch.randn(sum(contexts), 64, generator=g).to(dtype)
    meta = build_attention_metadata(contexts, [0, 0, 0], tables, 4, 8)  # prefill: layer by layer
    positions = torch.cat([torch.arange(n) for n in contexts])
    dec.run_layers(prompt, positions, caches, meta)

    step = torch.randn(3, 64, generator=g).to(dtype)
    meta = build_attention_metadata([1, 1, 1], contexts, tables, 4, 8)
    positions = torch.tensor(contexts)
    cos, sin = dec.rotary(positions, dtype)
    mine, alone = [c.clone() for c in caches], [c.clone() for c in caches]
    h, want_mid = step, None
    for i, layer in enumerate(dec.layers):  # the reference: each layer's own ops
        h = layer(h, cos, sin, dec.attend(caches[i], meta))
        want_mid = h if i == 0 else want_mid
    want = dec.norm(h)
    calls, kernel = [], cpu_kernels.decoder_step
    monkeypatch.setattr(cpu_kernels, "decoder_step", lambda *args: calls.append(args[1]) or kernel(*args))
    before = step.clone()
    got, got_mid = dec.run_layers(step, positions, mine, meta, capture_layer=1)
    assert [t.addresses.shape[0] for t in calls] == [1, 2]  # layer 0, then layers 1-2
    tol = 1e-5 if dtype == torch.float32 else 2**-6
    for a, b in ((got, want), (got_mid, want_mid)):
        assert (a.float() - b.float()).abs().max().item() <= tol * b.float().abs().max().item()
    for theirs, ours in zip(caches, mine):
        assert (ours.float() - theirs.float()).abs().max().item() <= tol * theirs.float().abs().max().item()
        written = ours.float().abs().sum(dim=(0, 2, 3)) > 0
        assert torch.equal(written, theirs.float().abs().sum(dim=(0, 2, 3)) > 0)  # the same slots, no others
    assert torch.equal(step, before)  # the input rows are left as they were
    # Without a capture, every layer and the final norm in one call (the Talker's steps).
    got_alone, _ = dec.run_layers(step, positions, alone, meta)
    assert [t.addresses.shape[0] for t in calls[2:]] == [3]
    assert torch.equal(got_alone, got)  # the same sums, whether the norm follows one call or two
    # An output head in the same call (the Talker's codec head): every row's logits, with the panels' own bits.
    head = torch.randn(70, 64, generator=g)
    panels = cpu_kernels.pack_linear((head if weights == "float32" else head.to(torch.bfloat16)).to(dtype),
                                     float32_pairs=True)
    hidden, logits = dec.run_layers_with_head(step, positions, alone, meta, (panels, 70))
    assert torch.equal(hidden, got) and (logits is not None or quant is not None)
    if logits is not None:
        assert logits.shape == (3, 70) and torch.equal(logits, cpu_kernels.linear(hidden, panels, None, 70))
    # A request's row gives the same bits alone (its own blocks, its own experts' rows) as in the batch.
    first = [c.clone() for c in caches]
    solo_meta = build_attention_metadata([1], contexts[:1], tables[:1], 4, 8)
    solo = dec.run_layers(step[:1], positions[:1], first, solo_meta)[0]
    assert torch.equal(solo, got[:1])


@pytest.mark.skipif(not onednn_available(), reason="oneDNN is not available in this torch build")
@pytest.mark.parametrize("out_features", [64, 80, 1000])  # whole panels, a padded panel, many padded
def test_every_custom_ops_fake_kernel_reports_the_real_sizes_and_strides(out_features):
    """``torch.library.opcheck`` runs each op for real and on fake tensors (static and dynamic shapes) and
    compares sizes, strides and dtypes: a compiled graph then sees what the real op returns (a padded panel's
    output is a view with the padded row stride)."""
    from omnistage.models.layers.fast_linear import pack_weight, packed_linear, packed_linear_at

    g = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, 48, generator=g)
    for x in (torch.randn(3, 48, generator=g), torch.randn(2, 5, 48, generator=g)):
        packed = pack_weight(weight)
        # oneDNN's packed weight is an opaque tensor (no storage) that opcheck cannot fake: its ops' fakes are
        # contiguous [..., out_features], so the real ops must return exactly that.
        for out in (packed_linear(x, packed, None), packed_linear_at(x, [packed, packed], torch.tensor(1))):
            assert out.shape == (*x.shape[:-1], out_features) and out.is_contiguous()
        if cpu_kernels.available():
            panels = cpu_kernels.pack_linear(weight)
            bias = cpu_kernels.pack_bias(torch.randn(out_features, generator=g), out_features)
            torch.library.opcheck(cpu_kernels.panel_linear, (x, panels, bias, out_features))
            stacked = cpu_kernels.pack_linear(torch.stack((weight, -weight)))
            torch.library.opcheck(cpu_kernels.panel_linear_at, (x, stacked, torch.tensor(1), out_features))


@pytest.mark.skipif(not onednn_available(), reason="oneDNN is not available in this torch build")
@pytest.mark.parametrize("panels", ["1", "0"])
def test_packing_keeps_one_copy_of_the_weights_resident(panels, monkeypatch):
    """The engine keeps freed heap blocks for reuse (``configure_allocator``); packing must still hand the
    released unpacked weights back, or the process holds every weight twice (the panels live in their own
    2 MB-page mappings)."""
    psutil = pytest.importorskip("psutil")
    from omnistage.models.layers.fast_linear import pack_linear_weights
    from omnistage.runtime_env import configure_allocator

    if panels == "1" and not cpu_kernels.available():
        pytest.skip("no C compiler to build omnistage's CPU kernels")
    monkeypatch.setenv(cpu_kernels.PANELS_ENV, panels)
    from omnistage.runtime_env import release_free_heap

    configure_allocator()
    release_free_heap()  # what earlier tests freed would otherwise serve the new weights without new pages
    process = psutil.Process()
    start = process.memory_info().rss
    model = torch.nn.Sequential(*(torch.nn.Linear(1024, 2048, bias=False) for _ in range(24))).eval()
    weight_bytes = 24 * 2048 * 1024 * 4  # 201 MB
    loaded = process.memory_info().rss
    assert loaded - start >= 0.9 * weight_bytes
    assert pack_linear_weights(model) == 24
    packed = process.memory_info().rss
    assert packed - start <= 1.1 * weight_bytes, (packed - start) / weight_bytes
    x = torch.randn(3, 1024)
    assert model[0](x).shape == (3, 2048)


def _bf16_valued(module: torch.nn.Module) -> torch.nn.Module:
    """``module``'s float32 parameters rounded to bfloat16 values, as a checkpoint stored in bfloat16 loads."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return module


_no_pairs = pytest.mark.skipif(not (cpu_kernels.available() and cpu_kernels._has_pairs()),
                               reason="this build has no float32-on-bfloat16-pair tiles (AVX-512 only)")


@_no_pairs
@torch.inference_mode()
def test_float32_weights_of_bfloat16_values_are_kept_as_pairs_with_the_same_bits():
    """A float32 linear layer or expert stack whose weights are bfloat16 values is packed as bfloat16 pairs: half
    the bytes, and each row's result has exactly the float32 panels' bits (the same products, the same order)."""
    g = torch.Generator().manual_seed(31)
    weight = torch.randn(70, 96, generator=g).to(torch.bfloat16).float()
    pairs, plain = cpu_kernels.pack_linear(weight, float32_pairs=True), cpu_kernels.pack_linear(weight)
    assert pairs.dtype == torch.bfloat16 and plain.dtype == torch.float32
    assert pairs.numel() * pairs.element_size() * 2 == plain.numel() * plain.element_size()
    for rows in (1, 3, 5, 9, 17, 64):
        x = torch.randn(rows, 96, generator=g)
        assert torch.equal(cpu_kernels.linear(x, pairs, None, 70), cpu_kernels.linear(x, plain, None, 70))
    not_exact = weight.clone()
    not_exact[3, 4] += 1e-5
    assert cpu_kernels.pack_linear(not_exact, float32_pairs=True).dtype == torch.float32
    gate_up = torch.randn(6, 2 * 40, 64, generator=g).to(torch.bfloat16).float()
    down = torch.randn(6, 64, 40, generator=g).to(torch.bfloat16).float()
    experts_pairs = cpu_kernels.pack_experts(gate_up, down, float32_pairs=True)
    experts_plain = cpu_kernels.pack_experts(gate_up, down)
    assert {t.dtype for t in experts_pairs} == {torch.bfloat16}
    x = torch.randn(9, 64, generator=g)
    ids = torch.randint(0, 6, (9, 2), generator=g)
    route = torch.rand(9, 2, generator=g)
    assert torch.equal(cpu_kernels.moe_experts(x, ids, route, experts_pairs),
                       cpu_kernels.moe_experts(x, ids, route, experts_plain))


@_no_pairs
@torch.inference_mode()
def test_a_float32_decoder_of_bfloat16_values_decodes_on_pairs_with_the_same_bits(monkeypatch):
    """A float32 MoE decoder (shared expert, router) whose weights are bfloat16 values: its decode steps run on
    bfloat16 pairs and give exactly the bits of the same decoder on float32 panels, in half the weight bytes (its
    dense layers and experts kept off AMX, which would take them in both)."""
    from omnistage.attention.backend import allocate_kv_cache, build_attention_metadata
    from omnistage.runner.memory_use import weight_bytes_by_component

    cfg = DecoderConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96,
                        rms_norm_eps=1e-6, rope_theta=1e4, num_experts=6, num_experts_per_tok=2,
                        moe_intermediate_size=32, sparse_layers=(1,), shared_expert_intermediate_size=64)

    def decoder(pairs: bool) -> PagedDecoder:
        dec = _bf16_valued(_seeded(PagedDecoder(cfg), seed=33, std=0.2))
        monkeypatch.setattr(amx_kernels, "takes", lambda weight: False)
        if not pairs:
            monkeypatch.setattr(cpu_kernels, "keeps_float32_as_pairs", lambda weight: False)
        dec = fast_kernels(dec, True)
        monkeypatch.undo()
        return dec

    on_pairs, on_float32 = decoder(True), decoder(False)
    monkeypatch.setattr(cpu_kernels, "experts_take_amx", lambda *args: False)  # (their panels, as the float32 ones)
    assert {t.dtype for layer in on_pairs.kernel_layers() for t in layer.panels()} == {torch.bfloat16}
    assert {t.dtype for layer in on_float32.kernel_layers() for t in layer.panels()} == {torch.float32}
    held = (sum(weight_bytes_by_component(d).values()) for d in (on_pairs, on_float32))
    assert next(held) < 0.55 * next(held)
    tables, contexts = [[5, 2], [7], [0, 6, 3]], [5, 1, 9]
    g = torch.Generator().manual_seed(34)
    prompt, step = torch.randn(sum(contexts), 64, generator=g), torch.randn(3, 64, generator=g)
    outs = []
    for dec in (on_pairs, on_float32):
        caches = allocate_kv_cache(2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=16, dtype=torch.float32)
        meta = build_attention_metadata(contexts, [0, 0, 0], tables, 4, 8)
        dec.run_layers(prompt, torch.cat([torch.arange(n) for n in contexts]), caches, meta)
        meta = build_attention_metadata([1, 1, 1], contexts, tables, 4, 8)
        outs.append(dec.run_layers(step, torch.tensor(contexts), caches, meta)[0])
    assert torch.equal(outs[0], outs[1])


def test_a_float32_embedding_of_bfloat16_values_is_kept_as_them():
    """``pack_embedding`` (a float32 model's Thinker vocabulary, stored in bfloat16): half the bytes, the same
    float32 rows; the unpacked weight released (state_dict refuses); untouched where the head shares the weight or
    the values are not bfloat16's."""
    gen = torch.Generator().manual_seed(3)
    embedding = torch.nn.Embedding(300, 64)
    with torch.no_grad():
        embedding.weight.copy_(torch.randn(300, 64, generator=gen).to(torch.bfloat16))
    head = torch.nn.Linear(64, 300, bias=False)
    ids = torch.tensor([[0, 7, 299], [5, 5, 1]])
    want = embedding(ids)
    assert pack_embedding(embedding, head) == 1
    assert embedding.weight.numel() == 0 and embedding.weight.dtype == torch.float32
    assert embedding.stored_weight.dtype == torch.bfloat16 and embedding.stored_weight.shape == (300, 64)
    got = embedding(ids)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    with pytest.raises(RuntimeError, match="fast=False"):
        embedding.state_dict()
    tied = torch.nn.Embedding(300, 64)
    with torch.no_grad():
        tied.weight.copy_(torch.randn(300, 64, generator=gen).to(torch.bfloat16))
    head.weight = tied.weight
    other = torch.nn.Embedding(300, 64)  # float32 values
    assert pack_embedding(tied, head) == 0 and pack_embedding(other, torch.nn.Linear(64, 300)) == 0
    assert type(tied) is type(other) is torch.nn.Embedding and tied.weight.numel() == other.weight.numel() == 300 * 64
