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
from omnistage.core.sampling_params import SamplingParams
from omnistage.models.layers.quant import QuantFormat, quantize
from omnistage.models.layers.quant_layers import QuantExperts, QuantLinear
from omnistage.models.prequantized import (
    Fp8Scale,
    PackedInt,
    UnsupportedQuantization,
    pack,
    parse_config,
    quantization_config,
    unpack,
)
from omnistage.models.registry import load_pipeline_config
from omnistage.pipeline.engine import OmniEngine
from omnistage.pipeline.engine_args import EngineArgs
from omnistage.testing.quant_accuracy import load_part

INT4 = QuantFormat(4, 32)


@pytest.mark.parametrize("fmt", [QuantFormat(8), QuantFormat(8, 32), INT4], ids=["int8", "int8-g32", "int4"])
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
    asymmetric["config_groups"]["group_0"]["weights"]["symmetric"] = False  # (zero points: dequantized as read)
    assert parse_config(asymmetric).asymmetric_for("model.layers.0.q_proj") == PackedInt("pack-quantized", 4, 32)
    assert parse_config(asymmetric).format_for("model.layers.0.q_proj", 64) is None
    w4a8 = json.loads(json.dumps(good))
    w4a8["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int"}
    with pytest.raises(UnsupportedQuantization, match="activations"):
        parse_config(w4a8)
    with pytest.raises(UnsupportedQuantization, match="'float-quantized'"):
        parse_config({**good, "format": "float-quantized", "config_groups": {"g": {**good["config_groups"]["group_0"],
                                                                                   "format": None}}})
    with pytest.raises(UnsupportedQuantization, match="'bitsandbytes'"):
        parse_config({"quant_method": "bitsandbytes"})


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    """The tiny preset in bfloat16 through the real-architecture writer: plain, and pre-quantized int4 (g32)."""
    preset = replace(get_preset("tiny"), storage_dtype="bfloat16")
    root = tmp_path_factory.mktemp("ct")
    plain = build_real_checkpoint(root / "plain", seed=2, preset=preset, vocab_size=1000, max_shard_bytes=300_000)
    packed = build_real_checkpoint(root / "int4", seed=2, preset=preset, vocab_size=1000, max_shard_bytes=300_000,
                                   quantization=Quantization("int4", 32))
    return plain, packed


def test_prequantized_int8_in_groups_loads_the_online_quantized_weights(twins, tmp_path):
    """W8A16 with strategy group (what llm-compressor writes for int8 in groups) reads as stored."""
    preset = replace(get_preset("tiny"), storage_dtype="bfloat16")
    packed = build_real_checkpoint(tmp_path / "int8-g32", seed=2, preset=preset, vocab_size=1000,
                                   quantization=Quantization("int8", 32))
    weights = json.loads((packed / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    assert (weights["weights"]["strategy"], weights["weights"]["group_size"]) == ("group", 32)
    for part in ("thinker", "talker"):
        online = _quantized(load_part(twins[0], part, torch.bfloat16, Quantization("int8", 32)))
        stored = _quantized(load_part(packed, part, torch.bfloat16, Quantization()))
        assert online.keys() == stored.keys() and online
        for path in online:
            for a, b in zip(online[path], stored[path], strict=True):
                assert a.fmt == b.fmt and a.fmt.bits == 8, path
                assert torch.equal(a.data, b.data) and torch.equal(a.scales, b.scales), path
        assert any(not w.fmt.per_channel for ws in online.values() for w in ws)


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
        out = omni.generate(["Hello!"], modalities=["text", "audio"], sampling_params={
            # EOS banned for a few steps: whether random weights stop at once depends on the CPU's rounding
            "thinker": SamplingParams(temperature=0.0, max_tokens=8, min_tokens=4),
            "talker": SamplingParams(temperature=0.0, max_tokens=16, min_tokens=4)})[0]
        assert out.text and out.audio is not None and out.audio.numel() > 0


# FP8 (float-quantized): each strategy on one stack of the tiny checkpoint (blocks that do not divide the
# weights); the routers stay bfloat16.
FP8_GROUPS = {"thinker": ("channel", None), "talker.model": ("block", (24, 40)), "talker.code_predictor": ("tensor", None)}
FP8_MAX = 448.0  # float8 e4m3's largest finite value


def _fp8(w: torch.Tensor, strategy: str, block: tuple[int, int] | None) -> tuple[torch.Tensor, ...]:
    """A weight as llm-compressor stores it in FP8: (float8 e4m3 values, weight_scale), and the float32 weight
    they stand for (each value times its own scale, written out here independently of the loader)."""
    w = w.float()
    n, k = w.shape
    if strategy == "tensor":
        scale = (w.abs().amax() / FP8_MAX).reshape(1)
    elif strategy == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
    else:
        bn, bk = block
        tiles = torch.nn.functional.pad(w.abs(), (0, -k % bk, 0, -n % bn)).unflatten(0, (-1, bn)).unflatten(2, (-1, bk))
        scale = tiles.amax(dim=(1, 3)) / FP8_MAX
    scale = scale.to(torch.bfloat16)
    full = torch.empty(n, k)
    for i in range(n):
        for j in range(0, k, 8):
            if strategy == "tensor":
                full[i, j:j + 8] = scale[0]
            elif strategy == "channel":
                full[i, j:j + 8] = scale[i, 0]
            else:
                full[i, j:j + 8] = scale[i // block[0], j // block[1]]
    values = (w / full).to(torch.float8_e4m3fn)
    return values, scale, values.float() * full


@pytest.fixture(scope="module")
def fp8_twins(twins, tmp_path_factory):
    """``twins``' plain checkpoint with its decoder layers in FP8 (weights, scales and everything else in three
    files, so scales sit in other shards than their weights), and its float32 twin holding the dequantized
    values the FP8 checkpoint stands for."""
    from omnistage.models.loader import checkpoint_files
    from omnistage.testing.variants import write_weights

    plain = twins[0]
    root = tmp_path_factory.mktemp("fp8")
    fp8_dir, twin_dir = root / "fp8", root / "twin"
    config = json.loads((plain / "config.json").read_text())
    groups = {}
    for i, (stack, (strategy, block)) in enumerate(FP8_GROUPS.items()):
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": False,
                   "group_size": None, "block_structure": list(block) if block else None}
        acts = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}
        groups[f"group_{i}"] = {"targets": [f"re:^{stack.replace('.', chr(92) + '.')}\\..*layers\\..*"],
                                "weights": weights, "input_activations": acts, "format": "float-quantized"}
    quant = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": groups,
             "ignore": [r"re:.*mlp\.gate$", r"re:.*mlp\.shared_expert_gate$"]}
    files = checkpoint_files(plain)
    values, scales, rest, twin = {}, {}, {}, {}
    for name, path in files.items():
        with safe_open(str(path), "pt") as f:
            tensor = f.get_tensor(name)
        stack = next((s for s in FP8_GROUPS if name.startswith(s + ".") and ".layers." in name), None)
        if stack is None or tensor.dim() != 2 or name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
            rest[name] = twin[name] = tensor
            continue
        values[name], scales[name[: -len("weight")] + "weight_scale"], twin[name] = _fp8(tensor, *FP8_GROUPS[stack])
        scales[name[: -len("weight")] + "input_scale"] = torch.ones(1, dtype=torch.bfloat16)  # (not applied)
    assert values and any(s.numel() > 1 and s.dim() == 2 and s.shape[1] > 1 for s in scales.values())
    write_weights(plain, fp8_dir, {"values.safetensors": values, "scales.safetensors": scales,
                                   "rest.safetensors": rest})
    write_weights(plain, twin_dir, {"all.safetensors": twin})
    (fp8_dir / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    return fp8_dir, twin_dir


def test_fp8_checkpoint_loads_dequantized_and_quantizes_online(fp8_twins):
    fp8_dir, twin_dir = fp8_twins
    for part in ("thinker", "talker"):
        got = load_part(fp8_dir, part, torch.float32, Quantization()).state_dict()
        want = load_part(twin_dir, part, torch.float32, Quantization()).state_dict()
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want), part
        online = _quantized(load_part(fp8_dir, part, torch.bfloat16, Quantization("int4", 32)))
        reference = _quantized(load_part(twin_dir, part, torch.bfloat16, Quantization("int4", 32)))
        assert online.keys() == reference.keys() and online
        for path in online:
            for a, b in zip(online[path], reference[path], strict=True):
                assert torch.equal(a.data, b.data) and torch.equal(a.scales, b.scales), path


def test_fp8_checkpoint_is_planned_and_generates_as_its_dequantized_twin(fp8_twins):
    fp8_dir, twin_dir = fp8_twins
    outs, plans = [], []
    for path in (fp8_dir, twin_dir):
        with Omni(str(path), dtype="float32") as omni:
            plans.append([p.weight_bytes for p in omni.engine.memory_plan])
            sampling = {"thinker": SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=8),
                        "talker": SamplingParams(temperature=0.9, top_k=50, seed=4, max_tokens=12)}
            out = omni.generate(["Hello!", "Tell me a story."], modalities=["text", "audio"], sampling_params=sampling)
            outs.append([(o.text, o.audio) for o in out])
    assert plans[0] == plans[1]
    for (text, audio), (twin_text, twin_audio) in zip(*outs, strict=True):
        assert text and text == twin_text
        assert audio is not None and audio.numel() > 0 and torch.equal(audio, twin_audio)


def test_unsupported_fp8_schemes_are_refused_naming_them():
    def config(**weights):
        w = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", **weights}
        return {"quant_method": "compressed-tensors", "format": "float-quantized",
                "config_groups": {"g": {"targets": ["Linear"], "weights": w}}, "ignore": ["lm_head"]}

    assert parse_config(config()).fp8_scheme("model.layers.0.q_proj") == Fp8Scale("channel")
    assert parse_config(config()).fp8_scheme("lm_head") is None
    assert parse_config(config(strategy="block", block_structure=[128, 128])).fp8_scheme("x") == \
        Fp8Scale("block", (128, 128))
    with pytest.raises(UnsupportedQuantization, match="'num_bits': 4"):  # NVFP4-like
        parse_config(config(num_bits=4, strategy="tensor_group", group_size=16))
    with pytest.raises(UnsupportedQuantization, match="block_structure"):
        parse_config(config(strategy="block"))
    with pytest.raises(UnsupportedQuantization, match=r"does not fit a \[4, 8\] weight"):
        Fp8Scale("channel").dequantize(torch.zeros(4, 8, dtype=torch.float8_e4m3fn), torch.ones(3, 1))
