"""Checkpoints of shapes our presets never use run in the default configuration, and equal the reference kernels.

Every stage at widths that are not multiples of 16/32/64 (80, 200, 1000), head_dim 24 / 80 / 128, GQA 1:1 ... 8:1,
1 to 128 experts with top-1/2/3/8, the Thinker without and the Talker with a shared expert, 8 / 16 / 32 code
groups, Code2Wav decoder widths 48 / 80 / 208: the default kernels (``fast``: the panel kernels where they build,
and without them) against ``fast=False`` on the same checkpoint, text tokens and codec codes equal,
audio within 1e-4, at batch sizes 1, 2, 3 and 16, greedy and seeded. One variant also compiles the code
predictor's frame (the default outside the test suite), which used to fail on a padded panel's strides.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from omnistage.checkpoints.builder import build_checkpoint
from omnistage.checkpoints.presets import Code2WavSpec, DecoderSpec, get_preset
from omnistage.core.sampling_params import SamplingParams
from omnistage.models.layers import compiled, cpu_kernels
from omnistage.pipeline.omni import Omni

_TINY = get_preset("tiny")
VARIANTS = {
    # hidden 80 everywhere, head_dim 24, GQA 3:1 and 2:1, 8 experts top-3, 8 code groups, decoder 48.
    "w80-hd24": replace(
        _TINY, name="w80-hd24",
        thinker=DecoderSpec(80, 2, 6, 2, 24, 72, num_experts=8, top_k=3, moe_intermediate_size=40),
        talker=DecoderSpec(80, 2, 4, 2, 24, 128, num_experts=4, top_k=2, moe_intermediate_size=32,
                           shared_expert_intermediate_size=64),
        code_predictor=DecoderSpec(80, 2, 4, 2, 24, 128), num_code_groups=8,
        code2wav=Code2WavSpec(hidden_size=40, num_layers=2, num_heads=4, intermediate_size=56, decoder_dim=48)),
    # hidden 200, head_dim 80, GQA 8:1 and 1:1, 128 experts top-8 and 1 expert top-1, 32 code groups, decoder 80.
    "w200-hd80": replace(
        _TINY, name="w200-hd80",
        thinker=DecoderSpec(200, 2, 8, 1, 80, 136, num_experts=128, top_k=8, moe_intermediate_size=8),
        talker=DecoderSpec(200, 1, 8, 8, 80, 136, num_experts=1, top_k=1, moe_intermediate_size=24,
                           shared_expert_intermediate_size=40),
        code_predictor=DecoderSpec(200, 1, 8, 1, 80, 96), num_code_groups=32,
        code2wav=Code2WavSpec(hidden_size=72, num_layers=1, num_heads=3, intermediate_size=40, decoder_dim=80)),
    # Talker and code predictor 1000 wide, head_dim 128, GQA 2:1 and 8:1, 16 experts top-1 / 8 top-3, decoder 208.
    "w1000-hd128": replace(
        _TINY, name="w1000-hd128",
        thinker=DecoderSpec(96, 1, 4, 2, 128, 64, num_experts=16, top_k=1, moe_intermediate_size=24),
        talker=DecoderSpec(1000, 1, 8, 4, 128, 64, num_experts=8, top_k=3, moe_intermediate_size=24,
                           shared_expert_intermediate_size=48),
        code_predictor=DecoderSpec(1000, 1, 16, 2, 128, 64), num_code_groups=16,
        code2wav=Code2WavSpec(hidden_size=64, num_layers=1, num_heads=4, intermediate_size=64, decoder_dim=208)),
}
PROMPTS = [f"Tell me {'a long ' * (i % 4)}story number {i} about the sea." for i in range(16)]
# (mode, batch sizes): the batch is the number of prompts submitted at once.
RUNS = [("greedy", 1), ("greedy", 3), ("greedy", 16), ("seeded", 2), ("seeded", 16)]


def _params(mode: str) -> dict[str, SamplingParams]:
    if mode == "greedy":
        return {"thinker": SamplingParams(temperature=0.0, max_tokens=8),
                "talker": SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.0)}
    return {"thinker": SamplingParams(temperature=0.9, top_k=20, max_tokens=8, seed=5),
            "talker": SamplingParams(temperature=0.9, top_k=20, max_tokens=20, seed=9)}


def _run(ckpt, fast: bool) -> dict:
    results = {}
    with Omni(model=str(ckpt), fast=fast) as omni:
        for mode, n in RUNS:
            outs = omni.generate(PROMPTS[:n], modalities=["text", "audio"], sampling_params=_params(mode))
            assert all(o.error is None for o in outs), [o.error for o in outs]
            results[mode, n] = [(o.token_ids, o.codes, o.audio) for o in outs]
    return results


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory):
    """(name, checkpoint, the reference kernels' results on it)."""
    name = request.param
    ckpt = build_checkpoint(tmp_path_factory.mktemp(name), preset=VARIANTS[name], seed=1)
    return name, ckpt, _run(ckpt, fast=False)


def _assert_same(got: dict, want: dict) -> None:
    for key, rows in want.items():
        for i, ((tokens, codes, audio), (t, c, a)) in enumerate(zip(rows, got[key], strict=True)):
            assert t == tokens, (key, i)
            assert c.shape == codes.shape and torch.equal(c, codes), (key, i)
            assert a.shape == audio.shape and (a.numel() == 0 or (a - audio).abs().max().item() <= 1e-4), (key, i)


@pytest.mark.parametrize("panels", ["auto", "0"])
def test_default_kernels_equal_the_reference_kernels_at_unfamiliar_shapes(variant, panels, monkeypatch):
    """``panels``: auto = the default (the panel kernels wherever they build), 0 = without them (oneDNN's
    GEMMs, layer-by-layer decoders: the path of a machine without a C compiler)."""
    name, ckpt, want = variant
    if panels == "auto" and not cpu_kernels.available():
        pytest.skip("no C compiler to build omnistage's CPU kernels")
    monkeypatch.setenv(cpu_kernels.PANELS_ENV, panels)
    got = _run(ckpt, fast=True)
    _assert_same(got, want)
    # Codes cover the checkpoint's groups (8 / 32 / 16), text and speech were produced by every request.
    codes = got["greedy", 16][0][1]
    assert codes.shape[0] == VARIANTS[name].num_code_groups and codes.shape[1] > 0


def test_compiled_frame_at_unfamiliar_shapes_equals_the_reference(variant, monkeypatch):
    """The default outside the suite compiles the code predictor's frame where no decoder kernel serves it: with
    a padded panel head (hidden 80: 80 % 32 != 0) the compiled graph used to fail on the op's strides, and the
    eager fallback then on a ``torch.cond`` specialised to batch 2. Now it compiles, and equals the reference."""
    name, ckpt, want = variant
    if name != "w80-hd24":
        pytest.skip("one variant is enough to compile (tens of seconds)")
    monkeypatch.setenv(compiled.ENV_VAR, "1")
    with Omni(model=str(ckpt), fast=True) as omni:
        predictor = omni.engine.orchestrator.stages["talker"].runner.model.talker.code_predictor
        assert not predictor.pass_layers()  # hidden 80: the decoder-pass kernel does not serve, the graph does
        assert predictor.frame_compiler.compile_seconds is not None and predictor.frame_compiler.failure is None
        for mode, n in [("greedy", 1), ("greedy", 3), ("seeded", 2)]:
            outs = omni.generate(PROMPTS[:n], modalities=["text", "audio"], sampling_params=_params(mode))
            got = [(o.token_ids, o.codes, o.audio) for o in outs]
            _assert_same({(mode, n): got}, {(mode, n): want[mode, n]})
        assert predictor.frame_compiler.failure is None
