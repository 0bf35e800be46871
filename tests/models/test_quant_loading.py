"""Quantization while loading: each quantized layer holds exactly its checkpoint weight quantized, the other
weights load unchanged, a layer's output equals the float layer's on the dequantized weights, and the memory
plan counts the bytes the loaded model holds."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from omnistage.config.quantization import Quantization
from omnistage.models.layers.quant import QuantFormat, dequantize, quantize
from omnistage.models.layers.quant_layers import QuantExperts, QuantLinear, QuantScheme
from omnistage.models.loader import building, load_into, load_weights
from omnistage.models.qwen3_omni.config import load_config
from omnistage.models.qwen3_omni.family import Qwen3OmniFamily
from omnistage.models.qwen3_omni.talker import Talker
from omnistage.models.qwen3_omni.thinker import Thinker


def _thinker(ckpt, scheme: QuantScheme | None) -> Thinker:
    with building(torch.float32, "cpu", init=scheme is None):
        thinker = Thinker(load_config(ckpt))
    load_into(thinker, ckpt, "thinker.", torch.float32, skip=("audio_tower.", "visual."), quantize=scheme)
    return thinker.eval()


def _quantized(weight: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    return dequantize(*quantize(weight, fmt), fmt)


@pytest.mark.parametrize(("method", "group", "fmt"), [("int8", None, QuantFormat(8)), ("int8", 32, QuantFormat(8, 32)),
                                                     ("int4", 32, QuantFormat(4, 32))], ids=["int8", "int8-g32", "int4"])
def test_loaded_layers_hold_the_quantized_checkpoint(tiny_ckpt, method: str, group: int | None,
                                                     fmt: QuantFormat) -> None:
    scheme = Qwen3OmniFamily(tiny_ckpt).quant_scheme("thinker", Quantization(method, group))
    thinker = _thinker(tiny_ckpt, scheme)
    raw = load_weights(tiny_ckpt, "thinker.model.layers.")
    for i, layer in enumerate(thinker.model.layers):
        attn, moe = layer.self_attn, layer.mlp
        assert isinstance(attn.qkv_proj, QuantLinear) and isinstance(attn.o_proj, QuantLinear)
        assert isinstance(moe.experts, QuantExperts)
        assert type(moe.gate) is nn.Linear  # the router keeps the serving dtype
        torch.testing.assert_close(moe.gate.weight, raw[f"{i}.mlp.gate.weight"], rtol=0, atol=0)
        qkv = torch.cat([raw[f"{i}.self_attn.{p}_proj.weight"] for p in "qkv"])
        torch.testing.assert_close(attn.qkv_proj.weight_q.dequantize(), _quantized(qkv, fmt), rtol=0, atol=1e-6)
        torch.testing.assert_close(attn.o_proj.weight_q.dequantize(), _quantized(raw[f"{i}.self_attn.o_proj.weight"],
                                                                                  fmt), rtol=0, atol=1e-6)
        for e in range(moe.num_experts):
            gate_up = torch.cat([raw[f"{i}.mlp.experts.{e}.{p}_proj.weight"] for p in ("gate", "up")])
            torch.testing.assert_close(moe.experts.gate_up_q.select(e).dequantize(), _quantized(gate_up, fmt),
                                       rtol=0, atol=1e-6)
            down = raw[f"{i}.mlp.experts.{e}.down_proj.weight"]
            torch.testing.assert_close(moe.experts.down_q.select(e).dequantize(), _quantized(down, fmt),
                                       rtol=0, atol=1e-6)
    with pytest.raises(RuntimeError, match="quantized while loading"):
        thinker.state_dict()


@pytest.mark.parametrize("which", ["tiny_ckpt", "act_ckpt"])  # act_ckpt: GELU experts, which the kernels do not take
def test_layers_compute_like_the_float_layers_on_dequantized_weights(which: str, request) -> None:
    ckpt = request.getfixturevalue(which)
    scheme = Qwen3OmniFamily(ckpt).quant_scheme("thinker", Quantization("int4", 32))
    quant = _thinker(ckpt, scheme)
    ref = _thinker(ckpt, None)
    with torch.no_grad():  # the float model on the weights the quantized one computes with
        for q, r in zip(quant.model.layers, ref.model.layers, strict=True):
            r.self_attn.qkv_proj.weight.copy_(q.self_attn.qkv_proj.weight_q.dequantize())
            r.self_attn.o_proj.weight.copy_(q.self_attn.o_proj.weight_q.dequantize())
            for e in range(q.mlp.num_experts):
                r.mlp.experts.gate_up_proj[e].copy_(q.mlp.experts.gate_up_q.select(e).dequantize())
                r.mlp.experts.down_proj[e].copy_(q.mlp.experts.down_q.select(e).dequantize())
    x = torch.randn(7, ref.model.layers[0].self_attn.qkv_proj.in_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for q, r in zip(quant.model.layers, ref.model.layers, strict=True):
            torch.testing.assert_close(q.self_attn.qkv_proj(x), r.self_attn.qkv_proj(x), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(q.mlp(x), r.mlp(x, kernel=False), rtol=1e-5, atol=1e-5)


def test_talker_code_predictor_in_int8_under_int4(tiny_ckpt) -> None:
    scheme = Qwen3OmniFamily(tiny_ckpt).quant_scheme("talker", Quantization("int4", 32))
    with building(torch.float32, "cpu", init=False):
        talker = Talker(load_config(tiny_ckpt))
    load_into(talker, tiny_ckpt, "talker.", torch.float32, quantize=scheme)
    decoder = talker.model.layers[0]
    assert decoder.self_attn.qkv_proj.weight_q.fmt == QuantFormat(4, 32)
    assert decoder.mlp.shared_expert.gate_up_proj.weight_q.fmt == QuantFormat(4, 32)
    assert type(decoder.mlp.shared_expert_gate) is nn.Linear
    predictor = talker.code_predictor.model.layers[0]
    assert predictor.self_attn.o_proj.weight_q.fmt == QuantFormat(8)
    assert predictor.mlp.gate_up_proj.weight_q.fmt == QuantFormat(8)
    assert type(talker.codec_head) is nn.Linear and type(talker.text_projection.linear_fc1) is nn.Linear
