"""GPTQ and AWQ checkpoints, as gptqmodel writes them and transformers reads them through it: each quantized
layer dequantized as read to the weight transformers' kernels multiply by, so a float32 model answers as
transformers' does. Qwen2.5-Omni's Thinker layers: GPTQ in its original format (zero points minus one) and in
gptq_v2, symmetric and with zero points, act-order (``g_idx``), 4 and 8 bits; AWQ (GEMM, zero points). Qwen3-Omni's
Thinker attention in GPTQ and AWQ. transformers runs in a process of its own (``packed_int_reference``: importing
gptqmodel patches torch process-wide); its kernels are CPU ones (``gptq_torch``, ``awq_torch_aten``)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import test_pipeline_parity as parity
import torch
from test_checkpoint_formats import assert_planned_as_float_and_quantizes_online

from omnistage import Omni
from omnistage.core.sampling_params import SamplingParams
from omnistage.models.loader import load_weights
from omnistage.models.prequantized import PackedInt, UnsupportedQuantization, parse_config, stored_layers
from omnistage.pipeline.memory_plan import tensor_sizes
from omnistage.testing.variants import compressed_asymmetric_variant, packed_int_variant, write_weights

PROMPT, TOKENS = "Hi there, who are you?", 16
BLOCK = "thinker.model.language_model.layers"  # (transformers' name: without it, it finds no GPTQ block)
FLOAT_PARTS = ["talker", "token2wav", "audio_tower", "visual", "lm_head"]  # (AWQ: what transformers leaves float)
# Qwen3-Omni: its Thinker's attention layers (transformers keeps its experts in fused tensors gptqmodel does not
# convert; test_qwen3_gptq_layers_and_experts_load_as_their_dequantized_weights covers GPTQ experts)
QWEN3_FLOAT_PARTS = ["talker", "code2wav", "audio_tower", "visual", "lm_head", "mlp"]
VARIANTS = {
    "gptq": dict(method="gptq", block_name_to_quantize=BLOCK),
    "gptq-zero-points-act-order": dict(method="gptq", sym=False, act_order=True, block_name_to_quantize=BLOCK),
    "gptq_v2-g64": dict(method="gptq", sym=False, group_size=64, checkpoint_format="gptq_v2",
                        block_name_to_quantize=BLOCK),
    "gptq-8bit": dict(method="gptq", bits=8, block_name_to_quantize=BLOCK),
    "awq": dict(method="awq", sym=False, modules_to_not_convert=FLOAT_PARTS),
    "qwen3-gptq-zero-points-act-order": dict(method="gptq", sym=False, act_order=True, block_name_to_quantize=BLOCK),
    "qwen3-awq": dict(method="awq", sym=False, modules_to_not_convert=QWEN3_FLOAT_PARTS),
}
MOVED = ("gptq", "gptq-zero-points-act-order", "awq", "qwen3-gptq-zero-points-act-order", "qwen3-awq")


def _quantized(name: str):
    """The layers a variant quantizes: Qwen2.5-Omni's Thinker layers, Qwen3-Omni's Thinker attention."""
    if name.startswith("qwen3"):
        return lambda module: module.startswith("thinker.model.layers.") and ".self_attn." in module
    return lambda module: module.startswith("thinker.model.layers.")


@pytest.fixture(scope="module")
def variants(q25_ckpt, tiny_ckpt, tmp_path_factory):
    root = tmp_path_factory.mktemp("packed-int")
    return {name: packed_int_variant(tiny_ckpt if name.startswith("qwen3") else q25_ckpt, root / name,
                                     modules=_quantized(name), **kw)
            for name, kw in VARIANTS.items()}


def _answer(ckpt) -> tuple[list[int], list[int]]:
    """omnistage's greedy text in the default configuration: (prompt ids, answer ids)."""
    with Omni(str(ckpt)) as omni:
        out = omni.generate([PROMPT], ["text"], SamplingParams(temperature=0.0, max_tokens=TOKENS,
                                                               min_tokens=TOKENS))[0]
    return out.prompt_token_ids, out.token_ids


def _transformers(ckpt, prompt_ids: list[int]) -> dict:
    """transformers' greedy Thinker text for the checkpoint, through gptqmodel, in a process of its own."""
    if importlib.util.find_spec("gptqmodel") is None:
        why = "gptqmodel is not installed (.ci/run installs it: transformers reads GPTQ / AWQ through it)"
        pytest.fail(why) if os.environ.get("CI") == "true" else pytest.skip(why)
    run = subprocess.run([sys.executable, "-m", "omnistage.testing.packed_int_reference", str(ckpt), str(TOKENS),
                          *map(str, prompt_ids)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(VARIANTS))
def test_packed_int_checkpoint_answers_as_transformers(variants, q25_ckpt, tiny_ckpt, name):
    prompt_ids, tokens = _answer(variants[name])
    reference = _transformers(variants[name], prompt_ids)
    # the pinned pure-torch CPU kernels, on any CPU (auto would take an AVX-512 BF16 one where there is one)
    assert reference["kernels"] == (["TorchAtenAwqLinear"] if "awq" in name else ["TorchLinear"])
    assert tokens == reference["tokens"]
    if name in MOVED:  # (4 bits in groups of 32: the answer moves)
        assert tokens != _answer(tiny_ckpt if name.startswith("qwen3") else q25_ckpt)[1]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_dequantized_weights_are_the_stored_steps_of_the_float_ones(variants, q25_ckpt, tiny_ckpt, name):
    """Every quantized layer reads back within half a step of the float weight it was made from (the packing's
    orientation, AWQ's nibble order and the zero-point offset of each format), and not as that float weight."""
    ckpt = variants[name]
    stored = parse_config(json.loads((ckpt / "config.json").read_text())["quantization_config"])
    layers = stored_layers({n: s for n, (s, _) in tensor_sizes(ckpt).items()}, stored)
    assert len(layers.packed_int) == (8 if name.startswith("qwen3") else 14)  # 2 layers x (q, k, v, o[, MLP's 3])
    floats = load_weights(tiny_ckpt if name.startswith("qwen3") else q25_ckpt, "", None)
    stored_tensors = load_weights(ckpt, "", None)
    bits = VARIANTS[name].get("bits", 4)
    for weight, (shape, scheme) in layers.packed_int.items():
        got = scheme.dequantize(stored_tensors.__getitem__, weight[: -len(".weight")])
        want = floats[weight].float()
        assert got.shape == shape == want.shape
        step = stored_tensors[weight[: -len("weight")] + "scales"].float().amax()
        assert (got - want).abs().max() <= step / 2 * 1.01 + 1e-3 and not torch.equal(got, want), weight
        assert (got - want).abs().max() > 0 if bits == 4 else True


def _qwen3_layers(module: str) -> bool:
    """Qwen3-Omni's Thinker and Talker layers, routed experts included (routers stay float, as quantizers leave them)."""
    return (module.startswith(("thinker.model.layers.", "talker.model.layers."))
            and not module.endswith(("mlp.gate", "shared_expert_gate")))


def assert_serves_as_its_dequantized_twin(ckpt, src, twin_dir, moves: bool = True) -> None:
    """A pre-quantized Qwen3-Omni checkpoint (made from ``src``): the same tokens, codes and audio as the float
    checkpoint holding its layers' dequantized weights, experts and attention among them; ``moves``: and other
    answers than ``src``'s."""
    stored = load_weights(ckpt, "", None)
    layers = stored_layers({n: s for n, (s, _) in tensor_sizes(ckpt).items()},
                           parse_config(json.loads((ckpt / "config.json").read_text())["quantization_config"]))
    assert any(".experts." in w for w in layers.packed_int) and any(".self_attn." in w for w in layers.packed_int)
    twin = load_weights(src, "", None)
    for weight, (_, scheme) in layers.packed_int.items():
        twin[weight] = scheme.dequantize(stored.__getitem__, weight[: -len(".weight")])
    write_weights(src, twin_dir, {"model.safetensors": twin})
    got, want = (parity.run(parity.make_engine(path), {0: [1], 1: [0], 3: [2]}) for path in (ckpt, twin_dir))
    for i in range(len(parity.PROMPTS)):
        assert got[i]["tokens"] == want[i]["tokens"] and torch.equal(got[i]["codes"], want[i]["codes"])
        assert torch.equal(got[i]["audio"], want[i]["audio"])
    moved = [got[i]["tokens"] != parity.reference(str(src), i)[0] for i in range(len(parity.PROMPTS))]
    assert any(moved) == moves, moved


@pytest.mark.parametrize("bits,group", [(4, 32), (8, None)], ids=["int4-g32", "int8-channel"])
def test_compressed_tensors_with_zero_points_load_as_their_dequantized_weights(tiny_ckpt, tmp_path, bits, group):
    """compressed-tensors pack-quantized with zero points (llm-compressor's W4A16_ASYM, e.g. its AWQ), packed by the
    library: each layer dequantized as the library decompresses it, served as its dequantized float twin."""
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    forward = pytest.importorskip("compressed_tensors.quantization.lifecycle.forward")
    from compressed_tensors.quantization import QuantizationArgs

    ckpt = compressed_asymmetric_variant(tiny_ckpt, tmp_path / "ckpt", _qwen3_layers, bits, group)
    stored = load_weights(ckpt, "", None)
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=False, strategy="group" if group else "channel",
                            group_size=group)
    layers = stored_layers({n: s for n, (s, _) in tensor_sizes(ckpt).items()},
                           parse_config(json.loads((ckpt / "config.json").read_text())["quantization_config"]))
    for weight, (shape, scheme) in list(layers.packed_int.items())[:6]:
        base = weight[: -len(".weight")]
        scale = stored[base + ".weight_scale"]
        zero = helpers.unpack_from_int32(stored[base + ".weight_zero_point"], bits, (shape[0], scale.shape[1]),
                                         packed_dim=0)
        values = helpers.unpack_from_int32(stored[base + ".weight_packed"], bits, torch.Size(shape))
        library = forward.dequantize(x_q=values, scale=scale, zero_point=zero, args=args)
        assert torch.equal(scheme.dequantize(stored.__getitem__, base), library.float()), weight
    # (at 8 bits per channel the tiny checkpoint's greedy answers do not move: the weights above are the
    # library's, not the float ones)
    assert_serves_as_its_dequantized_twin(ckpt, tiny_ckpt, tmp_path / "twin", moves=bits == 4)


def test_qwen3_gptq_layers_and_experts_load_as_their_dequantized_weights(tiny_ckpt, tmp_path):
    """Qwen3-Omni with its Thinker's and Talker's layers in GPTQ, routed experts included (transformers' own
    Qwen3-Omni keeps experts in fused tensors, which gptqmodel does not convert, so it has no reference here): the
    same tokens, codes and audio as a float checkpoint holding the dequantized weights; planned as that float
    checkpoint; with ``quantization`` int8 dequantized as read and quantized, and it speaks."""
    gptq = packed_int_variant(tiny_ckpt, tmp_path / "gptq", "gptq", sym=False, act_order=True, modules=_qwen3_layers)
    assert_serves_as_its_dequantized_twin(gptq, tiny_ckpt, tmp_path / "twin")
    assert_planned_as_float_and_quantizes_online(gptq, tiny_ckpt)


def test_symmetric_gptq_int4_is_kept_as_stored_under_quantization_int4(tiny_ckpt, tmp_path):
    """``--quantization int4`` in the checkpoint's group size keeps a symmetric GPTQ layer without act-order as
    stored: its values are omnistage's int4, so they are not rounded a second time. A layer with zero points or
    act-order is dequantized and quantized again."""
    from omnistage.config.quantization import Quantization
    from omnistage.models.layers.quant import QuantFormat
    from omnistage.testing.quant_accuracy import load_part

    for kept, kw in ((True, {}), (False, {"sym": False, "act_order": True})):
        ckpt = packed_int_variant(tiny_ckpt, tmp_path / str(kept), "gptq", modules=_qwen3_layers, **kw)
        stored = load_weights(ckpt, "", None)
        scheme = parse_config(json.loads((ckpt / "config.json").read_text())["quantization_config"]).packed_int
        model = load_part(ckpt, "thinker", torch.float32, Quantization("int4", 32))
        for i, layer in enumerate(model.model.layers):
            exact = [scheme.dequantize(stored.__getitem__, f"thinker.model.layers.{i}.self_attn.{name}")
                     for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
            if kept:  # (the stored values times their scales, exactly: no float16 rounding of the products)
                as_stored = [scheme.for_format(stored.__getitem__, f"thinker.model.layers.{i}.self_attn.{name}",
                                               QuantFormat(4, 32)) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
                exact = [(v.float() * s.repeat_interleave(32, dim=1)) for v, s in as_stored]
            for held, want in ((layer.self_attn.qkv_proj.weight_q.dequantize(), torch.cat(exact[:3])),
                               (layer.self_attn.o_proj.weight_q.dequantize(), exact[3])):
                assert torch.equal(held, want) == kept
                assert (held - want).abs().max() < 0.1 * want.abs().max()


def test_packed_int_configs_read_and_refused_naming_the_field():
    assert parse_config({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": True,
                         "checkpoint_format": "gptq"}).packed_int == PackedInt("gptq", 4, 128, 1)
    assert parse_config({"quant_method": "gptq", "bits": 8, "group_size": -1, "format": "gptq_v2"}).packed_int == \
        PackedInt("gptq", 8, -1, 0)
    assert parse_config({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm",
                         "zero_point": True}).packed_int == PackedInt("awq", 4, 128, 0)
    for config, field in (({"quant_method": "gptq", "bits": 3}, "bits 3"),
                          ({"quant_method": "gptq", "checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
                          ({"quant_method": "gptq", "group_size": 0}, "group_size 0"),
                          ({"quant_method": "awq", "version": "gemv"}, "version 'gemv'"),
                          ({"quant_method": "awq", "bits": 8}, "bits 8"),
                          ({"quant_method": "awq", "zero_point": False}, "zero_point false")):
        with pytest.raises(UnsupportedQuantization, match=field):
            parse_config(config)
    scheme = parse_config({"quant_method": "gptq"})
    with pytest.raises(UnsupportedQuantization, match=r"x: a gptq layer needs qweight, qzeros, scales, g_idx.*g_idx"):
        stored_layers({"x.qweight": (8, 64), "x.qzeros": (1, 8), "x.scales": (1, 64)}, scheme)
