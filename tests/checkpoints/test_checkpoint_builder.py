"""The built test checkpoints: real HF layout, deterministic, usable as a transformers reference."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration

from omnistage.checkpoints.builder import build_checkpoint, build_state, make_hf_config
from omnistage.checkpoints.presets import PRESETS, TALKER_SPECIAL_RANGE, build_config_dict
from omnistage.checkpoints.tokenizer import tokenizer_ids, train_tokenizer

CKPT_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def _keys(path):
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


@pytest.mark.parametrize("fixture", ["tiny_ckpt", "gqa_ckpt"])
def test_transformers_loads_every_tensor(fixture, request):
    path = request.getfixturevalue(fixture)
    _, info = Qwen3OmniMoeForConditionalGeneration.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info


def test_file_layout_is_what_transformers_saves(tiny_ckpt, hf_model_factory, tmp_path):
    # transformers 5.x reverts its in-memory renames/expert fusion on save: that is the hub layout.
    hf_model_factory(tiny_ckpt).save_pretrained(tmp_path)
    assert _keys(tiny_ckpt) == _keys(tmp_path)
    keys = _keys(tiny_ckpt)
    assert "thinker.model.layers.0.mlp.experts.3.gate_proj.weight" in keys
    assert "talker.model.layers.1.mlp.experts.0.down_proj.weight" in keys
    assert "thinker.audio_tower.conv2d1.weight" in keys and "thinker.visual.patch_embed.proj.weight" in keys
    assert not any("language_model" in k or k.endswith("gate_up_proj") for k in keys)


def test_same_seed_is_byte_identical_other_seed_differs(tmp_path):
    a = build_checkpoint(tmp_path / "a", "tiny", seed=0)
    b = build_checkpoint(tmp_path / "b", "tiny", seed=0)
    c = build_checkpoint(tmp_path / "c", "tiny", seed=1)
    for name in CKPT_FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "config.json").read_bytes() == (c / "config.json").read_bytes()


def test_tokenizer_roundtrip_role_words_and_chat_template(tiny_ckpt):
    tok = AutoTokenizer.from_pretrained(tiny_ckpt)
    text = "Hello, world! The quick brown fox: 42 cafés, 中文 and emoji 🙂."
    assert tok.decode(tok(text)["input_ids"]) == text
    for word in ("system", "user", "assistant", "\n"):
        assert len(tok(word, add_special_tokens=False)["input_ids"]) == 1, word
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "audio"}]},
    ]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi<|audio_start|><|audio_pad|><|audio_end|><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tok(rendered)["input_ids"]
    cfg = json.loads((tiny_ckpt / "config.json").read_text())
    assert ids[:3] == [cfg["im_start_token_id"], cfg["system_token_id"], tok("\n")["input_ids"][0]]
    assert ids[-3:-1] == [cfg["im_start_token_id"], cfg["assistant_token_id"]]
    assert cfg["user_token_id"] in ids and cfg["thinker_config"]["audio_token_id"] in ids
    assert tok.eos_token_id == cfg["im_end_token_id"]


@pytest.mark.parametrize("fixture", ["tiny_ckpt", "gqa_ckpt"])
def test_config_ids_agree_with_tokenizer_and_size_rules(fixture, request):
    path = request.getfixturevalue(fixture)
    cfg = json.loads((path / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(path)
    conv = tok.convert_tokens_to_ids
    thinker, talker, c2w = cfg["thinker_config"], cfg["talker_config"], cfg["code2wav_config"]
    assert thinker["text_config"]["vocab_size"] == len(tok)
    expected = {
        cfg["im_start_token_id"]: "<|im_start|>",
        cfg["im_end_token_id"]: "<|im_end|>",
        cfg["tts_pad_token_id"]: "<tts_pad>",
        cfg["tts_bos_token_id"]: "<tts_text_bos>",
        cfg["tts_eos_token_id"]: "<tts_text_eod>",
        cfg["system_token_id"]: "system",
        cfg["user_token_id"]: "user",
        cfg["assistant_token_id"]: "assistant",
        thinker["audio_token_id"]: "<|audio_pad|>",
        thinker["image_token_id"]: "<|image_pad|>",
        thinker["video_token_id"]: "<|video_pad|>",
        thinker["audio_start_token_id"]: "<|audio_start|>",
        thinker["vision_start_token_id"]: "<|vision_start|>",
    }
    for token_id, token in expected.items():
        assert conv(token) == token_id, token
    assert thinker["user_token_id"] == cfg["user_token_id"]
    cb = c2w["codebook_size"]
    vocab = talker["text_config"]["vocab_size"]
    assert talker["code_predictor_config"]["vocab_size"] == cb and vocab >= cb + TALKER_SPECIAL_RANGE
    assert c2w["num_quantizers"] == talker["num_code_groups"] == talker["code_predictor_config"]["num_code_groups"]
    codec_ids = [talker[k] for k in talker if k.startswith("codec_") and k.endswith("id")]
    codec_ids += list(talker["speaker_id"].values())
    assert len(set(codec_ids)) == len(codec_ids) and all(vocab - TALKER_SPECIAL_RANGE <= i < vocab for i in codec_ids)
    assert {"ethan", "chelsie"} <= set(talker["speaker_id"])
    assert 0 < talker["accept_hidden_layer"] <= thinker["text_config"]["num_hidden_layers"]
    # the fields transformers reads without declaring them
    assert "spatial_merge_size" in talker and "shared_expert_intermediate_size" in talker["text_config"]
    assert "vision_start_token_id" in thinker


def test_gqa_preset_shapes(gqa_ckpt):
    cfg = json.loads((gqa_ckpt / "config.json").read_text())
    for sub in (
        cfg["thinker_config"]["text_config"],
        cfg["talker_config"]["text_config"],
        cfg["talker_config"]["code_predictor_config"],
    ):
        assert sub["head_dim"] * sub["num_attention_heads"] != sub["hidden_size"]
        assert sub["num_attention_heads"] // sub["num_key_value_heads"] == 4
    assert cfg["talker_config"]["num_code_groups"] == cfg["code2wav_config"]["num_quantizers"] == 8


def test_reference_generate_speaks(tiny_ckpt, hf_model_factory):
    hf = hf_model_factory(tiny_ckpt)
    tok = AutoTokenizer.from_pretrained(tiny_ckpt)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "Hello, who are you?"}], add_generation_prompt=True, return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    seq, wav = hf.generate(
        ids,
        return_audio=True,
        thinker_max_new_tokens=6,
        thinker_eos_token_id=hf.config.im_end_token_id,
        thinker_do_sample=False,
        talker_do_sample=False,
        talker_repetition_penalty=1.0,
        speaker="ethan",
        talker_max_new_tokens=8,
    )
    assert seq.shape[1] == ids.shape[1] + 6
    wav = wav.flatten()
    # one chunk of T frames gives 1920 * T samples minus what the causal transposed convs trim (555)
    assert (wav.numel() + 555) % 1920 == 0 and wav.numel() > 0
    assert wav.std() > 0.05 and (wav.abs() >= 1).float().mean() < 0.01
    codes = torch.randint(0, 64, (1, 16, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert hf.code2wav(codes).shape[-1] == 5 * 1920 - 555


def test_activations_keep_their_scale_and_routers_vary(tiny_ckpt, hf_model_factory):
    hf = hf_model_factory(tiny_ckpt)
    ids = torch.randint(0, 700, (1, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = hf.thinker(input_ids=ids, output_hidden_states=True, output_router_logits=True)
        stds = [h.std().item() for h in out.hidden_states]
        assert all(0.3 < s < 5 for s in stds), stds
        for logits in out.router_logits:  # [tokens, experts]
            top = logits.topk(2, dim=-1).indices.sort(dim=-1).values
            assert len(torch.unique(top)) >= 3 and len(torch.unique(top, dim=0)) >= 3
        talker_in = torch.randn(1, 32, 64, generator=torch.Generator().manual_seed(2))
        t_out = hf.talker.model(inputs_embeds=talker_in, output_hidden_states=True, output_router_logits=True)
        assert all(0.3 < h.std().item() < 5 for h in t_out.hidden_states)
        for logits in t_out.router_logits:
            assert len(torch.unique(logits.topk(2, dim=-1).indices)) >= 3


def test_small_preset_is_about_300m_parameters():
    tok = train_tokenizer(PRESETS["small"].bpe_vocab_size)
    config = make_hf_config(build_config_dict(PRESETS["small"], tokenizer_ids(tok)))
    with torch.device("meta"):
        n = sum(p.numel() for p in Qwen3OmniMoeForConditionalGeneration(config).parameters())
    assert 250e6 < n < 350e6, n


def test_build_state_covers_every_parameter_with_nondegenerate_values(tiny_ckpt):
    config = make_hf_config(json.loads((tiny_ckpt / "config.json").read_text()))
    state = build_state(config, seed=0, dtype=torch.float32)
    for name, t in state.items():
        assert torch.isfinite(t).all(), name
        if t.numel() > 1:
            assert t.std() > 0, name  # routers, SnakeBeta, layer scales: nothing left constant
    router = state["thinker.model.layers.0.mlp.gate.weight"]
    assert router.abs().mean() > 0.1
