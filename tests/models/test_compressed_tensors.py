"""Pre-quantized checkpoints (compressed-tensors pack-quantized): the format round-trips (and matches the
library's packing where it is installed), the builder's pre-quantized checkpoint loads into exactly the weights
an online quantizing load of its bfloat16 twin holds, speaks, is planned as it loads, and a scheme omnistage
cannot read is refused naming it."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors import safe_open

from omnistage import Omni
from omnistage.checkpoints.presets import get_preset
from omnistage.checkpoints.real import build_real_checkpoint
from omnistage.config.quantization import Quantization
from omnistage.models.compressed_tensors import (
    UnsupportedQuantization,
    pack,
    parse_config,
    quantization_config,
    unpack,
)
from omnistage.models.layers.quant import QuantFormat, quantize
from omnistage.models.layers.quant_layers import QuantExperts, QuantLinear
from omnistage.models.registry import load_pipeline_config
from omnistage.pipeline.engine import OmniEngine
from omnistage.pipeline.engine_args import EngineArgs
from omnistage.testing.quant_accuracy import load_part

INT4 = QuantFormat(4, 32)


@pytest.mark.parametrize("fmt", [QuantFormat(8), INT4], ids=["int8", "int4"])
def test_pack_round_trip(fmt):
    w = torch.randn(16, 64)
    values, scales = quantize(w, fmt)
    packed = pack(values, fmt)
    assert packed.dtype == torch.int32 and packed.shape == (16, 64 * fmt.bits // 32)
    back, back_scales = unpack(packed, scales, fmt)
    assert torch.equal(back, values) and torch.equal(back_scales.reshape(scales.shape), scales)
    # element i of a row sits at bits i * bits.. of the row's words, offset by 2^(bits-1)
    word = int(packed[0, 0]) & 0xFFFFFFFF
    per = 32 // fmt.bits
    assert [(word >> (i * fmt.bits)) & ((1 << fmt.bits) - 1) for i in range(per)] == [
        int(v) + (1 << (fmt.bits - 1)) for v in values[0, :per]]


@pytest.mark.parametrize("fmt", [QuantFormat(8), INT4], ids=["int8", "int4"])
def test_packing_equals_the_librarys(fmt):
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    values, _ = quantize(torch.randn(16, 64), fmt)
    assert torch.equal(pack(values, fmt), helpers.pack_to_int32(values, fmt.bits))
    assert torch.equal(helpers.unpack_from_int32(pack(values, fmt), fmt.bits, values.shape), values)


def test_unsupported_schemes_are_refused_naming_them():
    good = quantization_config([(["Linear"], INT4)], ["lm_head"])
    assert parse_config(good).format_for("model.layers.0.q_proj", 64) == INT4
    assert parse_config(good).format_for("lm_head", 64) is None
    asymmetric = json.loads(json.dumps(good))
    asymmetric["config_groups"]["group_0"]["weights"]["symmetric"] = False
    with pytest.raises(UnsupportedQuantization, match="group_0.*'symmetric': False"):
        parse_config(asymmetric)
    w4a8 = json.loads(json.dumps(good))
    w4a8["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int"}
    with pytest.raises(UnsupportedQuantization, match="activations"):
        parse_config(w4a8)
    with pytest.raises(UnsupportedQuantization, match="'float-quantized'"):
        parse_config({**good, "format": "float-quantized", "config_groups": {"g": {**good["config_groups"]["group_0"],
                                                                                   "format": None}}})
    with pytest.raises(UnsupportedQuantization, match="'gptq'"):
        parse_config({"quant_method": "gptq"})


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    """The tiny preset in bfloat16 through the real-architecture writer: plain, and pre-quantized int4 (g32)."""
    preset = replace(get_preset("tiny"), storage_dtype="bfloat16")
    root = tmp_path_factory.mktemp("ct")
    plain = build_real_checkpoint(root / "plain", seed=2, preset=preset, vocab_size=1000, max_shard_bytes=300_000)
    packed = build_real_checkpoint(root / "int4", seed=2, preset=preset, vocab_size=1000, max_shard_bytes=300_000,
                                   quantization=Quantization("int4", 32))
    return plain, packed


def _quantized(model):
    return {path: (sub.weight_q,) if isinstance(sub, QuantLinear) else (sub.gate_up_q, sub.down_q)
            for path, sub in model.named_modules() if isinstance(sub, (QuantLinear, QuantExperts))}


def test_prequantized_checkpoint_loads_the_online_quantized_weights(twins):
    plain, packed = twins
    config = json.loads((packed / "config.json").read_text())
    assert config["quantization_config"]["format"] == "pack-quantized"
    index = json.loads((packed / "model.safetensors.index.json").read_text())["weight_map"]
    assert "thinker.model.layers.0.mlp.experts.1.up_proj.weight_packed" in index
    assert "thinker.model.layers.0.mlp.gate.weight" in index and "thinker.lm_head.weight" in index
    with safe_open(str(packed / index["talker.code_predictor.model.layers.0.self_attn.q_proj.weight_packed"]),
                   "pt") as f:  # the code predictor in int8: 4 values per word
        assert f.get_slice("talker.code_predictor.model.layers.0.self_attn.q_proj.weight_packed").get_shape()[1] == 16
    for part in ("thinker", "talker"):
        online = _quantized(load_part(plain, part, torch.bfloat16, Quantization("int4", 32)))
        stored = _quantized(load_part(packed, part, torch.bfloat16, Quantization()))
        assert online.keys() == stored.keys() and online
        for path in online:
            for a, b in zip(online[path], stored[path], strict=True):
                assert a.fmt == b.fmt and a.layout == b.layout, path
                assert torch.equal(a.data, b.data) and torch.equal(a.scales, b.scales), path


def test_prequantized_checkpoint_is_planned_as_loaded_and_speaks(twins):
    plain, packed = twins
    online = OmniEngine(EngineArgs(str(plain), dtype="bfloat16", quantization="int4", quantization_group_size=32),
                        load_pipeline_config("qwen3_omni"))
    online.shutdown()
    with Omni(str(packed), dtype="bfloat16") as omni:
        assert [p.weight_bytes for p in omni.engine.memory_plan] == [p.weight_bytes for p in online.memory_plan]
        out = omni.generate(["Hello!"], modalities=["text", "audio"])[0]
        assert out.text and out.audio is not None and out.audio.numel() > 0
