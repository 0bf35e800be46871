"""The Qwen2.5-Omni checkpoint builder: real HF layout transformers loads cleanly, deterministic per seed,
non-degenerate weights, speakers, tokenizer ids the config refers to."""

from __future__ import annotations

import json

import pytest
import torch
from q25_reference import checkpoint_dir, loaded
from safetensors.torch import load_file

from omnistage.checkpoints.builder import build_checkpoint
from omnistage.checkpoints.qwen2_5_omni.builder import build_state, make_hf_config
from omnistage.checkpoints.qwen2_5_omni.presets import SPEAKERS, get_preset
from omnistage.models.qwen2_5_omni.loading import load_config, quiet_config_checks
from omnistage.models.qwen2_5_omni.voices import UnknownVoiceError, load_speakers, resolve_voice


def test_transformers_loads_with_no_missing_or_unexpected_keys():
    from transformers import PreTrainedModel, Qwen2_5OmniForConditionalGeneration

    # The subclass' from_pretrained cannot return loading info (it loads spk_dict.pt after); ask the base one.
    with quiet_config_checks():
        _, info = PreTrainedModel.from_pretrained.__func__(
            Qwen2_5OmniForConditionalGeneration, checkpoint_dir(), dtype=torch.float32, output_loading_info=True
        )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert not info["error_msgs"]
    hf = loaded().hf  # the real entry point also reads spk_dict.pt
    assert sorted(hf.speaker_map) == sorted(SPEAKERS)


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    a = build_checkpoint(tmp_path / "a", preset="tiny", seed=0, family="qwen2_5_omni")
    for name in ("model.safetensors", "spk_dict.pt", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (checkpoint_dir() / name).read_bytes(), name
    other = build_state(make_hf_config(json.loads((a / "config.json").read_text())), seed=1, dtype=torch.float32)
    same = load_file(str(a / "model.safetensors"))
    assert other.keys() == same.keys()
    assert all(not torch.equal(other[k], same[k]) for k in same)


def test_every_tensor_is_non_degenerate():
    """transformers' init leaves SnakeBeta at 0 and other tensors constant; every stored tensor varies here."""
    tensors = load_file(str(checkpoint_dir() / "model.safetensors"))
    constant = [k for k, v in tensors.items() if v.numel() > 1 and v.float().std() == 0]
    assert constant == []
    snake = [v for k, v in tensors.items() if k.endswith((".act.alpha", ".act.beta"))]
    assert snake and all(v.abs().min() > 0 for v in snake)
    assert all(v.dtype == torch.float32 for k, v in tensors.items() if k.startswith("token2wav."))


def test_speakers_and_voice_lookup():
    config = load_config(checkpoint_dir())
    speakers = load_speakers(checkpoint_dir())
    dit = config.token2wav_config.dit_config
    thinker_vocab = config.thinker_config.text_config.vocab_size
    tokenizer_size = len(loaded().tokenizer)
    for spk in speakers.values():
        assert spk.cond.shape == (dit.enc_emb_dim,)
        assert spk.ref_mel.shape == (get_preset("tiny").ref_mel_frames, dit.mel_dim)
        # A Thinker embedding row past the tokenizer's ids, as in the real checkpoint.
        assert tokenizer_size <= spk.bos_token < thinker_vocab
    assert resolve_voice("ethan", speakers) == "Ethan"
    with pytest.raises(UnknownVoiceError, match="Chelsie, Ethan"):
        resolve_voice("nobody", speakers)


def test_tokenizer_and_config_ids_agree():
    tok = loaded().tokenizer
    config = load_config(checkpoint_dir())
    th, tk = config.thinker_config, config.talker_config
    assert tok.convert_ids_to_tokens(
        [th.audio_token_index, th.image_token_index, th.video_token_index, th.audio_start_token_id,
         th.vision_start_token_id, th.user_token_id]
    ) == ["<|AUDIO|>", "<|IMAGE|>", "<|VIDEO|>", "<|audio_bos|>", "<|vision_bos|>", "user"]
    text = tok.apply_chat_template(
        [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "Hi"}]}],
        add_generation_prompt=True, tokenize=False,
    )
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|audio_bos|><|AUDIO|><|audio_eos|>Hi<|im_end|>\n<|im_start|>assistant\n"
    )
    # Codec specials inside the Talker vocabulary; text-side specials are Thinker rows past the tokenizer.
    codec = [tk.tts_codec_pad_token_id, tk.tts_codec_start_token_id, tk.tts_codec_end_token_id, tk.tts_codec_mask_token_id]
    assert len(set(codec)) == 4 and all(get_preset("tiny").codebook_size <= c < tk.vocab_size for c in codec)
    text_ids = [tk.tts_text_pad_token_id, tk.tts_text_start_token_id, tk.tts_text_end_token_id]
    assert all(len(tok) <= t < th.text_config.vocab_size for t in text_ids)
