"""The llama.cpp side-by-side benchmark's GGUF export: every Thinker tensor under llama.cpp's qwen3moe name and
shape, its values those of the checkpoint (packed int4 layers dequantized) within the GGUF type's rounding,
and the metadata llama.cpp reads the model's shape from."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

gguf = pytest.importorskip("gguf")

from benchmarks.llama_cpp_bench import ThinkerWeights, write_gguf  # noqa: E402
from omnistage.checkpoints.presets import get_preset  # noqa: E402
from omnistage.checkpoints.real import build_real_checkpoint  # noqa: E402
from omnistage.config.quantization import Quantization  # noqa: E402


@pytest.fixture(scope="module")
def int4_ckpt(tmp_path_factory):
    """The tiny preset pre-quantized (compressed-tensors int4, groups of 32) through the real-architecture writer."""
    preset = replace(get_preset("tiny"), storage_dtype="bfloat16")
    return build_real_checkpoint(tmp_path_factory.mktemp("tiny-int4"), seed=2, preset=preset, vocab_size=1000,
                                 quantization=Quantization("int4", 32))


def _read(path):
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    return tensors, fields


def _value(t) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).float()


@pytest.mark.parametrize("kind", ["bf16", "q8_0", "q4_0"])
def test_gguf_holds_the_checkpoints_thinker(tiny_ckpt, int4_ckpt, tmp_path, kind):
    for ckpt in (tiny_ckpt, int4_ckpt):
        path = tmp_path / f"{ckpt.name}-{kind}.gguf"
        write_gguf(ckpt, path, kind)
        tensors, fields = _read(path)
        text = json.loads((ckpt / "config.json").read_text())["thinker_config"]["text_config"]
        layers, experts = text["num_hidden_layers"], text["num_experts"]
        assert fields["general.architecture"] == "qwen3moe"
        assert fields["qwen3moe.block_count"] == layers
        assert fields["qwen3moe.expert_count"] == experts
        assert fields["qwen3moe.expert_used_count"] == text["num_experts_per_tok"]
        assert fields["qwen3moe.attention.head_count_kv"] == text["num_key_value_heads"]
        assert fields["qwen3moe.attention.key_length"] == text["head_dim"]
        assert len(fields["tokenizer.ggml.tokens"]) == text["vocab_size"]
        assert len(tensors) == 3 + layers * 12
        weights = ThinkerWeights(ckpt)
        # bfloat16: one rounding; Q8_0: half a step of a 32-value block's scale (max / 127); Q4_0: max / 8
        step = {"bf16": 2**-8, "q8_0": 1 / 127, "q4_0": 1 / 8}[kind]
        for name, want in [("token_embd.weight", weights.get("model.embed_tokens.weight")),
                           ("output.weight", weights.get("lm_head.weight")),
                           ("output_norm.weight", weights.get("model.norm.weight")),
                           ("blk.1.attn_q.weight", weights.get("model.layers.1.self_attn.q_proj.weight")),
                           ("blk.1.attn_k_norm.weight", weights.get("model.layers.1.self_attn.k_norm.weight")),
                           ("blk.1.ffn_gate_inp.weight", weights.get("model.layers.1.mlp.gate.weight")),
                           ("blk.1.ffn_down_exps.weight", torch.stack(
                               [weights.get(f"model.layers.1.mlp.experts.{e}.down_proj.weight")
                                for e in range(experts)]))]:
            got = _value(tensors[name]).reshape(want.shape)
            if want.dim() == 1:  # norms are stored float32, exactly
                assert torch.equal(got, want), name
                continue
            blocks = want.reshape(-1, 32).abs().amax(dim=1, keepdim=True)
            err = (got - want).reshape(-1, 32).abs()
            tol = blocks * step + 1e-7
            assert (err <= tol).all(), name
            assert (got != 0).any(), name


def test_packed_layers_are_dequantized_exactly(int4_ckpt):
    """A packed int4 layer's float values are its int4 values times its group scale, as omnistage serves them."""
    from safetensors import safe_open

    weights = ThinkerWeights(int4_ckpt)
    name = "model.layers.0.self_attn.o_proj.weight"
    w = weights.get(name)
    files = weights.files
    module = "thinker.model.layers.0.self_attn.o_proj"
    with safe_open(str(files[module + ".weight_scale"]), framework="pt") as f:
        scale = f.get_tensor(module + ".weight_scale").float()
    q = w.unflatten(1, (scale.shape[1], -1)) / scale[..., None]
    assert torch.equal(q, q.round()) and q.abs().max() <= 8
    assert weights.shape(name) == tuple(w.shape)
