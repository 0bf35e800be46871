"""The released architecture's builder: exact released widths, depth overrides, written shard by shard with the
test weights' values (the same tensors the in-memory builder draws), loadable by transformers and omnistage."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import Qwen3OmniMoeForConditionalGeneration

from omnistage.checkpoints.builder import build_state, make_hf_config
from omnistage.checkpoints.presets import get_preset
from omnistage.checkpoints.real import (
    REAL,
    REAL_VOCAB,
    build_real_checkpoint,
    parse_depth,
    real_preset,
)


def test_real_preset_has_the_released_widths_and_scales_its_taps_with_depth():
    p = REAL
    assert (p.thinker.hidden_size, p.thinker.num_layers, p.thinker.num_heads, p.thinker.num_kv_heads,
            p.thinker.head_dim, p.thinker.num_experts, p.thinker.top_k, p.thinker.moe_intermediate_size) == (
        2048, 48, 32, 4, 128, 128, 8, 768)
    assert (p.talker.hidden_size, p.talker.num_layers, p.talker.num_heads, p.talker.num_kv_heads, p.talker.num_experts,
            p.talker.top_k, p.talker.moe_intermediate_size, p.talker.shared_expert_intermediate_size) == (
        1024, 20, 16, 2, 128, 6, 384, 768)
    assert (p.code_predictor.num_layers, p.code_predictor.num_heads, p.code_predictor.num_kv_heads,
            p.code_predictor.intermediate_size, p.num_code_groups, p.talker_vocab_size) == (5, 16, 8, 3072, 16, 3072)
    assert (p.code2wav.hidden_size, p.code2wav.num_layers, p.code2wav.decoder_dim, p.accept_hidden_layer) == (
        1024, 8, 1536, 24)
    e = p.encoders
    assert (e.audio_d_model, e.audio_layers, e.vision_hidden, e.vision_depth, e.vision_deepstack) == (
        1280, 32, 1152, 27, (8, 16, 24))
    two = real_preset(parse_depth("thinker=2,talker=2,vision=3"))
    assert two.thinker.num_layers == 2 and two.accept_hidden_layer == 1 and two.talker.num_layers == 2
    assert two.encoders.vision_depth == 3 and two.encoders.vision_deepstack == (0, 1, 2)
    assert two.thinker.hidden_size == 2048 and two.code_predictor.num_layers == 5
    for bad in ("thinker", "thinker=0", "brain=2", "talker=x"):
        with pytest.raises(ValueError, match="STACK=N"):
            parse_depth(bad)


def test_streamed_shards_hold_the_in_memory_builders_values(tmp_path):
    """A tiny preset through the streaming writer: every tensor equals the in-memory builder's (unshaped) draw,
    no shard exceeds the limit, and transformers loads the checkpoint with every tensor accounted for."""
    preset = get_preset("tiny")
    out = build_real_checkpoint(tmp_path / "ckpt", seed=3, max_shard_bytes=200_000, preset=preset, vocab_size=1000)
    config = json.loads((out / "config.json").read_text())
    assert config["thinker_config"]["text_config"]["vocab_size"] == 1000
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3 and not list(out.glob("*.tmp"))
    want = build_state(make_hf_config(config), 3, getattr(torch, preset.storage_dtype))
    seen = set()
    for fname in files:
        with safe_open(str(out / fname), framework="pt") as f:
            sizes = []
            for name in f.keys():
                assert torch.equal(f.get_tensor(name), want[name]), name
                sizes.append(want[name].numel() * want[name].element_size())
                seen.add(name)
        assert sum(sizes) <= max(200_000, max(sizes))  # (a tensor larger than the limit has a shard of its own)
    assert seen == set(want) == set(index["weight_map"])
    _, info = Qwen3OmniMoeForConditionalGeneration.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert REAL_VOCAB == 152064
