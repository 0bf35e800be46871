"""``--quantization`` end to end: the memory plan counts exactly what the quantized engine holds, a quantized
engine speaks (text and audio, reproducible with a seed under sampling), a stage's own ``quantization`` key
overrides the engine's, and what cannot be quantized is refused naming the stage and the field."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import test_custom_family  # noqa: F401 (registers the toy family, which has no quantization scheme)
import torch
from torch import nn

from omnistage import Omni, SamplingParams
from omnistage.checkpoints.builder import build_checkpoint
from omnistage.checkpoints.presets import DecoderSpec, get_preset
from omnistage.config import ConfigError, StageConfig
from omnistage.entrypoints.serve_args import add_engine_arguments
from omnistage.models.layers.quant_layers import QuantExperts, QuantLinear
from omnistage.models.registry import load_pipeline_config
from omnistage.pipeline.engine import OmniEngine
from omnistage.pipeline.engine_args import EngineArgs


def _held_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of the float parameters, bytes of the quantized weights) of ``model``'s modules."""
    floats = {t.data_ptr(): t.numel() * t.element_size() for t in model.parameters()}
    quantized = 0
    for sub in model.modules():
        if isinstance(sub, QuantLinear):
            quantized += sub.weight_q.nbytes
        elif isinstance(sub, QuantExperts):
            quantized += sub.gate_up_q.nbytes + sub.down_q.nbytes
    return sum(floats.values()), quantized


def _models(engine: OmniEngine) -> dict[str, nn.Module]:
    out = {}
    for name, stage in engine.orchestrator.stages.items():
        model = stage.runner.model
        out[name] = getattr(model, "thinker", None) or getattr(model, "talker", None) or model.code2wav
    return out


@pytest.mark.parametrize("method, dtype, group", [("int8", "float32", None), ("int8", "bfloat16", 32),
                                                  ("int4", "bfloat16", 32)])
def test_plan_equals_what_the_quantized_engine_holds(tiny_ckpt, method, dtype, group):
    args = EngineArgs(str(tiny_ckpt), dtype=dtype, fast=False, quantization=method, quantization_group_size=group)
    engine = OmniEngine(args, load_pipeline_config("qwen3_omni"))
    try:
        plans = {p.stage: p for p in engine.memory_plan}
        for name, model in _models(engine).items():
            floats, quantized = _held_bytes(model)
            assert (quantized > 0) == (name != "code2wav"), name
            if name != "thinker":  # (the Thinker's stage also holds its towers: counted in its plan)
                assert plans[name].weight_bytes == floats + quantized, name
        unquantized = OmniEngine(EngineArgs(str(tiny_ckpt), dtype=dtype), load_pipeline_config("qwen3_omni"))
        try:
            for a, b in zip(engine.memory_plan, unquantized.memory_plan, strict=True):
                assert (a.weight_bytes < b.weight_bytes) == (a.stage != "code2wav")
        finally:
            unquantized.shutdown()
    finally:
        engine.shutdown()


def test_a_quantized_engine_speaks_reproducibly(tiny_ckpt):
    prompts = ["Tell me about the sea.", "Hello!"]
    sampled = {"thinker": SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=12, min_tokens=4),
               "talker": SamplingParams(temperature=0.9, top_k=50, seed=5, max_tokens=200, min_tokens=4)}
    runs = []
    for _ in range(2):
        with Omni(str(tiny_ckpt), quantization="int4", quantization_group_size=32) as omni:
            runs.append(omni.generate(prompts, modalities=["text", "audio"], sampling_params=sampled))
    for a, b in zip(*runs, strict=True):
        assert a.text and a.audio is not None and a.audio.numel() > 0
        assert a.text == b.text and torch.equal(a.audio, b.audio)


def _formats(model: nn.Module) -> dict[str, str]:
    """{module path (gate_up / down for experts): its quantized format's name}."""
    out = {}
    for path, sub in model.named_modules():
        if isinstance(sub, QuantLinear):
            out[path] = sub.weight_q.fmt.name
        elif isinstance(sub, QuantExperts):
            out[f"{path}.gate_up"], out[f"{path}.down"] = sub.gate_up_q.fmt.name, sub.down_q.fmt.name
    return out


def test_widths_that_do_not_divide_into_the_groups_load_quantized(tmp_path):
    """Other widths than the release's under int4 in groups of 128 (they used to refuse to load: "200 inputs do not
    divide into int4 groups of 128"): each weight takes the largest group that divides its inputs, the kernels' own
    sizes first (200 -> 100, 136 -> 68), a row shorter than a group is one group (72), and a row no even group of 32
    or more divides (130) takes int8 per channel. The plan counts what the engine holds, and it speaks, seeded."""
    preset = replace(get_preset("tiny"), name="odd-widths",
                     thinker=DecoderSpec(200, 1, 4, 2, 50, 64, num_experts=4, top_k=2, moe_intermediate_size=136),
                     talker=DecoderSpec(192, 1, 4, 2, 48, 64, num_experts=4, top_k=2, moe_intermediate_size=72,
                                        shared_expert_intermediate_size=130),
                     code_predictor=DecoderSpec(192, 1, 4, 2, 48, 64))
    ckpt = build_checkpoint(tmp_path / "odd", preset=preset, seed=2)
    engine = OmniEngine(EngineArgs(str(ckpt), quantization="int4", fast=False), load_pipeline_config("qwen3_omni"))
    try:
        models = _models(engine)
        thinker, talker = _formats(models["thinker"].model.layers), _formats(models["talker"].model.layers)
        assert thinker["0.self_attn.qkv_proj"] == thinker["0.self_attn.o_proj"] == "int4 (groups of 100)"
        assert thinker["0.mlp.experts.gate_up"] == "int4 (groups of 100)"
        assert thinker["0.mlp.experts.down"] == "int4 (groups of 68)"
        assert talker["0.self_attn.qkv_proj"] == talker["0.mlp.experts.gate_up"] == "int4 (groups of 64)"
        assert talker["0.mlp.experts.down"] == "int4 (groups of 72)"
        assert talker["0.mlp.shared_expert.gate_up_proj"] == "int4 (groups of 64)"
        assert talker["0.mlp.shared_expert.down_proj"] == "int8"
        plans = {p.stage: p for p in engine.memory_plan}
        floats, quantized = _held_bytes(models["talker"])
        assert plans["talker"].weight_bytes == floats + quantized
    finally:
        engine.shutdown()
    sampled = {"thinker": SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=8, min_tokens=4),
               "talker": SamplingParams(temperature=0.9, top_k=50, seed=5, max_tokens=40, min_tokens=4)}
    runs = []
    for _ in range(2):
        with Omni(str(ckpt), quantization="int4") as omni:
            runs.append(omni.generate(["Tell me about the sea.", "Hello!"], modalities=["text", "audio"],
                                      sampling_params=sampled))
    for a, b in zip(*runs, strict=True):
        assert a.error is None and a.token_ids and a.audio is not None and a.audio.numel() > 0
        assert torch.isfinite(a.audio).all()
        assert a.token_ids == b.token_ids and torch.equal(a.audio, b.audio)


def test_a_stage_overrides_the_engine_quantization(tiny_ckpt, tmp_path):
    pipeline = load_pipeline_config("qwen3_omni", {"stages": {"thinker": {"quantization": "none"}}})
    engine = OmniEngine(EngineArgs(str(tiny_ckpt), quantization="int8"), pipeline)
    try:
        models = _models(engine)
        assert _held_bytes(models["thinker"])[1] == 0 and _held_bytes(models["talker"])[1] > 0
    finally:
        engine.shutdown()


def test_refusals_name_the_field(tiny_ckpt, tmp_path, monkeypatch):
    with pytest.raises(ConfigError) as info:
        StageConfig.from_dict({"name": "thinker", "execution": "ar", "model_part": "thinker", "quantization": "fp3"})
    assert info.value.field == "quantization" and "fp3" in str(info.value)
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineArgs(str(tiny_ckpt), quantization="int2")
    with pytest.raises(ValueError, match="group_size"):
        EngineArgs(str(tiny_ckpt), quantization="int4", quantization_group_size=7)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["ToyChainForTest"]}))
    with pytest.raises(ConfigError) as info:  # a family without a quantization scheme: refused before loading
        Omni(tmp_path, quantization="int8")
    assert info.value.field == "quantization" and "does not support weight quantization" in str(info.value)


def test_cli_options():
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--quantization", "int4", "--quantization-group-size", "64"])
    assert (args.quantization, args.quantization_group_size) == ("int4", 64)
    assert parser.parse_args([]).quantization == "none"
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "int3"])
