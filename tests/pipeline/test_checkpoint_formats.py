"""Checkpoint formats transformers reads, read as it reads them.

transformers' own FP8 format (``quant_method: fp8``, ``FineGrainedFP8Config``: float8 e4m3 weights beside a
``weight_scale_inv`` per block) loads as transformers loads it without a GPU, each weight dequantized to ``value *
scale``: text, codes and audio equal transformers' generate on the same checkpoint. Scales in float32, bfloat16 and
E8M0 (as float8_e8m0fnu and as raw bytes), static activation scales (not applied), and a per-tensor scale; what
the format can say and omnistage does not read is refused naming it.

PyTorch's pickled weights (``pytorch_model.bin``, single or sharded with its index), which transformers reads where
a checkpoint has no safetensors: the same answers as transformers', the same memory plan as the safetensors twin.
"""

from __future__ import annotations

import re

import pytest
import test_pipeline_parity as parity
import torch
from safetensors import safe_open
from test_config_variants import assert_q25_speech_matches_reference

from omnistage import Omni
from omnistage.core.sampling_params import SamplingParams
from omnistage.models.loader import checkpoint_files
from omnistage.models.prequantized import Fp8Scale, UnsupportedQuantization, parse_config
from omnistage.pipeline.memory_plan import tensor_sizes
from omnistage.testing.variants import FP8_SCALES, fp8_variant, pickled_variant


def _serves_as_transformers(ckpt) -> None:
    """Concurrent requests through the default configuration: tokens, codes and audio equal transformers'
    generate on the same checkpoint, and everything is freed after."""
    engine = parity.make_engine(ckpt)
    parity.assert_matches_reference(ckpt, parity.run(engine, {0: [1], 1: [0], 3: [2]}))
    parity.assert_all_free(engine)


def test_fp8_variant_holds_every_kind_of_scale(fp8_ckpt):
    kinds = {}
    for name, path in checkpoint_files(fp8_ckpt).items():
        if name.endswith("weight_scale_inv"):
            with safe_open(str(path), "pt") as f:
                scale = f.get_tensor(name)
            kinds.setdefault(next(s for s in FP8_SCALES if name.startswith(s)), set()).add((scale.dtype, scale.dim()))
    assert kinds["thinker."] == {(torch.float32, 2)}  # (the towers' layers too)
    assert kinds["talker.model."] == {(torch.bfloat16, 2)}
    assert kinds["talker.code_predictor."] == {(torch.float8_e8m0fnu, 2)}
    assert kinds["talker.text_projection."] == {(torch.uint8, 2)}
    assert kinds["talker.hidden_projection."] == {(torch.float32, 1)}
    assert kinds["code2wav.pre_transformer."] == {(torch.float32, 2)}
    assert any(".audio_tower." in n for n in checkpoint_files(fp8_ckpt) if n.endswith("weight_scale_inv"))



def test_fp8_checkpoint_equals_transformers(fp8_ckpt, tiny_ckpt):
    _serves_as_transformers(fp8_ckpt)
    # the FP8 values are what was served: the float checkpoint answers otherwise
    assert any(parity.reference(str(fp8_ckpt), i)[0] != parity.reference(str(tiny_ckpt), i)[0]
               for i in range(len(parity.PROMPTS)))


def test_qwen2_5_fp8_checkpoint_equals_transformers(q25_ckpt, tmp_path):
    """Qwen2.5-Omni in transformers' FP8 format (Thinker and towers, Talker, Token2Wav's DiT; per-tensor scales
    where blocks do not tile a weight): text and speech equal transformers'."""
    ckpt = fp8_variant(q25_ckpt, tmp_path / "ckpt", stacks={"thinker.": "float32", "talker.": "bfloat16",
                                                            "token2wav.": "e8m0"})
    assert_q25_speech_matches_reference(ckpt)


# Greedy, with EOS banned for a few steps in both decoders: whether random weights end an answer at once depends
# on the CPU's rounding of quantized products, and a test of loading and speaking must not.
SPEAKS = {"thinker": SamplingParams(temperature=0.0, max_tokens=8, min_tokens=4),
          "talker": SamplingParams(temperature=0.0, max_tokens=16, min_tokens=4)}


def assert_planned_as_float_and_quantizes_online(ckpt, float_ckpt) -> None:
    """A checkpoint whose layers load dequantized: its memory plan counts each as the float weight it loads as
    (``float_ckpt``'s plan); with ``quantization`` int8 they are dequantized as read and quantized, and it speaks."""
    plans = []
    for path in (ckpt, float_ckpt):
        with Omni(str(path), dtype="float32", quantization="int8") as omni:
            plans.append([p.weight_bytes for p in omni.engine.memory_plan])
            out = omni.generate(["Hello!"], modalities=["text", "audio"], sampling_params=SPEAKS)[0]
            assert out.text and out.audio is not None and out.audio.numel() > 0
    assert plans[0] == plans[1]


def test_fp8_checkpoint_is_planned_at_the_serving_width_and_quantizes_online(fp8_ckpt, tiny_ckpt):
    assert_planned_as_float_and_quantizes_online(fp8_ckpt, tiny_ckpt)


def test_fp8_config_read_and_refused_naming_the_field():
    read = parse_config({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"})
    assert read.fp8_scheme("thinker.model.layers.0.self_attn.q_proj") == \
        Fp8Scale("block", (128, 128), "weight_scale_inv")
    assert parse_config({"quant_method": "fp8", "weight_block_size": None}).fp8_scheme("x") == \
        Fp8Scale("tensor", None, "weight_scale_inv")
    for field, value in (("expert_dtype", "fp4"), ("scale_fmt", "int"), ("weight_block_size", [128])):
        with pytest.raises(UnsupportedQuantization, match=re.escape(f"{field} {value!r}")):
            parse_config({"quant_method": "fp8", "weight_block_size": [128, 128], field: value})
    with pytest.raises(UnsupportedQuantization, match=r"weight_scale_inv of shape \[2, 2\] does not fit a \[64, 64\]"):
        Fp8Scale("block", (16, 16), "weight_scale_inv").dequantize(torch.zeros(64, 64, dtype=torch.float8_e4m3fn),
                                                                   torch.ones(2, 2))


def test_stacked_fp8_weights_dequantize_as_their_parts():
    """[E, N, K] (experts stacked) with a scale per expert and block: each expert as its own [N, K]."""
    scheme = Fp8Scale("block", (16, 32), "weight_scale_inv")
    weight = (torch.randn(3, 40, 72) * 100).to(torch.float8_e4m3fn)
    scale = torch.rand(3, 3, 3)
    whole = scheme.dequantize(weight, scale)
    assert torch.equal(whole, torch.stack([scheme.dequantize(w, s) for w, s in zip(weight, scale)]))
    assert torch.equal(whole[1, 17, 40], weight[1, 17, 40].float() * scale[1, 1, 1])


@pytest.mark.parametrize("shards", [1, 2], ids=["single", "sharded"])
def test_pickled_checkpoint_equals_transformers(tiny_ckpt, tmp_path, shards):
    ckpt = pickled_variant(tiny_ckpt, tmp_path / "ckpt", shards)
    assert not list(ckpt.glob("*.safetensors"))
    assert tensor_sizes(ckpt) == tensor_sizes(tiny_ckpt)  # (what the memory plan reads: names, shapes, dtypes)
    _serves_as_transformers(ckpt)
