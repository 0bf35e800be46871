"""Qwen2.5-Omni under ``--quantization`` (it used to be refused): the Thinker's and the Talker's decoder layers in
the configured format, the towers' layers in int8, Token2Wav untouched; the memory plan counts exactly what the
engine holds; a quantized Thinker stays within int8's / int4's error of the float one; the engine speaks,
reproducibly with a seed under sampling."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from omnistage import Omni, SamplingParams
from omnistage.config.quantization import Quantization
from omnistage.models.layers.quant_layers import QuantExperts, QuantLinear
from omnistage.models.qwen2_5_omni.family import Qwen25OmniFamily
from omnistage.models.qwen2_5_omni.loading import load_config, load_media_encoders, load_thinker
from omnistage.models.registry import load_pipeline_config
from omnistage.pipeline.engine import OmniEngine
from omnistage.pipeline.engine_args import EngineArgs
from omnistage.testing.variants import packed_int_variant


def _held(*modules: nn.Module | None) -> int:
    """Bytes of the float parameters and the quantized weights ``modules`` hold (each tensor once)."""
    held = {}
    for module in filter(None, modules):
        held.update({t.data_ptr(): t.nbytes for t in module.parameters()})
        for sub in module.modules():
            if isinstance(sub, QuantLinear):
                held[sub.weight_q.data.data_ptr()] = sub.weight_q.nbytes
            assert not isinstance(sub, QuantExperts)  # (dense decoders)
    return sum(held.values())


def _formats(module: nn.Module) -> set[str]:
    return {sub.weight_q.fmt.name for sub in module.modules() if isinstance(sub, QuantLinear)}


@pytest.mark.parametrize("method, dtype, group", [("int8", "float32", None), ("int4", "bfloat16", 16)])
def test_plan_equals_what_the_quantized_engine_holds(q25_ckpt, method, dtype, group):
    args = EngineArgs(str(q25_ckpt), dtype=dtype, fast=False, quantization=method, quantization_group_size=group)
    engine = OmniEngine(args, load_pipeline_config("qwen2_5_omni"))
    try:
        plans = {p.stage: p.weight_bytes for p in engine.memory_plan}
        models = {name: stage.runner.model for name, stage in engine.orchestrator.stages.items()}
        thinker, encoders = models["thinker"].thinker, models["thinker"].encoders
        talker, token2wav = models["talker"].talker, models["token2wav"].token2wav
        decoder = {"int8": "int8", "int4": "int4 (groups of 16)"}[method]
        assert _formats(thinker.model.layers) == _formats(talker.model.layers) == {decoder}
        assert _formats(encoders.audio.layers) == _formats(encoders.vision.blocks) == {"int8"}
        assert not _formats(token2wav) and not isinstance(thinker.lm_head, QuantLinear)
        assert plans["thinker"] == _held(thinker, encoders.audio, encoders.vision)
        assert plans["talker"] == _held(talker)
        assert plans["token2wav"] == _held(token2wav)
    finally:
        engine.shutdown()
    unquantized = OmniEngine(EngineArgs(str(q25_ckpt), dtype=dtype, fast=False), load_pipeline_config("qwen2_5_omni"))
    try:
        smaller = {p.stage: p.weight_bytes for p in unquantized.memory_plan}
        assert plans["thinker"] < smaller["thinker"] and plans["talker"] < smaller["talker"]
        assert plans["token2wav"] == smaller["token2wav"]
    finally:
        unquantized.shutdown()


@pytest.mark.parametrize("method, group, bound", [("int8", None, 0.02), ("int4", 16, 0.2)])
def test_each_quantized_layer_stays_within_its_error_of_the_float_one(q25_ckpt, method, group, bound):
    """Every quantized layer of the Thinker (fused q/k/v with their biases, o, gate/up, down) and of its towers,
    against the float layer it was read from: the same rows in, outputs within the format's error, and not equal
    (the quantized weights are what ran)."""
    config = load_config(q25_ckpt)
    scheme = Qwen25OmniFamily(q25_ckpt).quant_scheme("thinker", Quantization(method, group))
    pairs = [(load_thinker(q25_ckpt, config), load_thinker(q25_ckpt, config, quantize=scheme))]
    float_towers, towers = load_media_encoders(q25_ckpt, config), load_media_encoders(q25_ckpt, config, quantize=scheme)
    pairs += [(float_towers.audio, towers.audio), (float_towers.vision, towers.vision)]
    gen = torch.Generator().manual_seed(0)
    checked = 0
    for reference, quantized in pairs:
        for name, layer in quantized.named_modules():
            if not isinstance(layer, QuantLinear):
                continue
            float_layer = reference.get_submodule(name)
            x = torch.randn(5, float_layer.in_features, generator=gen)
            with torch.inference_mode():
                want, got = float_layer(x), layer(x)
            error = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
            assert 0 < error < bound, (name, error)
            checked += 1
    assert checked == sum(isinstance(m, QuantLinear) for _, q in pairs for m in q.modules()) > 0


def test_a_quantized_engine_speaks_reproducibly(q25_ckpt):
    sampled = {"thinker": SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=8, min_tokens=4),
               "talker": SamplingParams(temperature=0.9, top_k=50, seed=5, max_tokens=40, min_tokens=8)}
    runs = []
    for _ in range(2):
        with Omni(str(q25_ckpt), dtype="bfloat16", quantization="int4", quantization_group_size=16) as omni:
            runs.append(omni.generate(["Tell me about the sea.", "Hello!"], modalities=["text", "audio"],
                                      sampling_params=sampled))
    for a, b in zip(*runs, strict=True):
        assert a.error is None and a.token_ids and a.audio is not None and a.audio.numel() > 0
        assert torch.isfinite(a.audio).all()
        assert a.token_ids == b.token_ids and torch.equal(a.codes, b.codes) and torch.equal(a.audio, b.audio)


def test_a_gptq_checkpoint_under_quantization_int4_keeps_its_layers_int4(q25_ckpt, tmp_path):
    """Qwen2.5-Omni's GPTQ Int4 release is a Thinker of symmetric GPTQ int4 layers: under ``--quantization int4``
    in its group size they are held as int4 (kept as stored: ``PackedInt.for_format``), not widened to the float
    weight, and the engine speaks."""
    ckpt = packed_int_variant(q25_ckpt, tmp_path / "gptq", "gptq",
                              modules=lambda module: module.startswith("thinker.model.layers."),
                              block_name_to_quantize="thinker.model.language_model.layers")
    greedy = {"thinker": SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6),
              "talker": SamplingParams(temperature=0.0, max_tokens=16, min_tokens=4, seed=1)}
    with Omni(str(ckpt), quantization="int4", quantization_group_size=32) as omni:
        out = omni.generate(["Hi there"], ["text", "audio"], greedy)[0]
        thinker = omni.engine.orchestrator.stages["thinker"].runner.model.thinker
        assert _formats(thinker.model.layers) == {"int4 (groups of 32)"}
    assert out.error is None and len(out.token_ids) == 6 and out.audio.numel() > 0
