"""Build a random Qwen2.5-Omni checkpoint in the real Hugging Face format, fully offline.

Files: config.json, generation_config.json, preprocessor_config.json (feature extractor + image processor),
model.safetensors (hub tensor names, the Thinker's audio and vision towers included), tokenizer files and
``spk_dict.pt`` ({speaker: {"bos_token": int, "cond": [1, enc_emb_dim], "ref_mel": [1, frames, mel_dim]}}),
which transformers' ``Qwen2_5OmniForConditionalGeneration.from_pretrained`` requires. The same (preset, seed)
gives byte-identical files.
"""

from __future__ import annotations

import io
import json
import zlib
from pathlib import Path

import torch
from transformers import Qwen2_5OmniConfig, Qwen2_5OmniForConditionalGeneration

from omnistage.checkpoints.presets import build_generation_config_dict
from omnistage.checkpoints.qwen2_5_omni.presets import (
    SPEAKERS,
    Qwen25Preset,
    build_config_dict,
    build_preprocessor_config_dict,
    get_preset,
    reserved_ids,
)
from omnistage.checkpoints.qwen2_5_omni.tokenizer import FLAVOR, token_ids
from omnistage.checkpoints.tokenizer import save_tokenizer, train_tokenizer
from omnistage.checkpoints.weights import init_state_dict, to_hub_layout, write_safetensors
from omnistage.models.qwen2_5_omni.loading import quiet_config_checks

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SPEAKER_FILE = "spk_dict.pt"
# BigVGAN's last conv sets the waveform level: kept small so the clamp to [-1, 1] rarely bites.
_WAVEFORM_GAIN = 0.03
_VOCODER_OUT = "token2wav.code2wav_bigvgan_model.conv_post.weight"


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def make_hf_config(config_dict: dict) -> Qwen2_5OmniConfig:
    with quiet_config_checks():  # also: mrope_section in rope_parameters is flagged as unknown; it is read
        return Qwen2_5OmniConfig(**config_dict)


def build_state(config: Qwen2_5OmniConfig, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """All checkpoint tensors (hub names), seeded by `seed`, stored as `dtype` (Token2Wav always float32,
    as transformers runs it)."""
    with torch.device("meta"):
        skeleton = Qwen2_5OmniForConditionalGeneration(config)
    state = init_state_dict(skeleton, seed)
    state[_VOCODER_OUT] = state[_VOCODER_OUT] * _WAVEFORM_GAIN
    state = to_hub_layout(state)
    return {k: v if k.startswith("token2wav.") else v.to(dtype) for k, v in state.items()}


def _speaker_generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 0x9E3779B1 + zlib.crc32(f"speaker:{name}".encode())) % (2**63))


def build_speakers(preset: Qwen25Preset, bos_ids: dict[str, int], seed: int) -> dict[str, dict]:
    """Per speaker: the Thinker-table row that opens its Talker text side, a `cond` vector and a reference mel
    (log-amplitude values in a speech-like range)."""
    out = {}
    for name in SPEAKERS:
        g = _speaker_generator(seed, name)
        cond = torch.randn(1, preset.dit.enc_emb_dim, generator=g)
        ref_mel = torch.randn(1, preset.ref_mel_frames, preset.dit.mel_dim, generator=g) * 1.5 - 4.0
        out[name] = {"bos_token": bos_ids[name], "cond": cond, "ref_mel": ref_mel}
    return out


def _save_speakers(speakers: dict[str, dict], path: Path) -> None:
    # torch.save output is deterministic for the same tensors; write through a buffer to keep it atomic-ish.
    buf = io.BytesIO()
    torch.save(speakers, buf)
    path.write_bytes(buf.getvalue())


def build_checkpoint(
    out_dir: str | Path, preset: str | Qwen25Preset = "tiny", seed: int = 0, max_shard_bytes: int | None = None
) -> Path:
    """Write a complete Qwen2.5-Omni checkpoint directory (a preset by name, or a spec) and return its path."""
    spec = preset if isinstance(preset, Qwen25Preset) else get_preset(preset)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tok = train_tokenizer(spec.bpe_vocab_size, FLAVOR.added_tokens)
    ids = token_ids(tok)
    save_tokenizer(tok, out, flavor=FLAVOR)
    reserved = reserved_ids(ids)

    config_dict = build_config_dict(spec, ids, reserved)
    config = make_hf_config(config_dict)
    _write_json(out / "config.json", config_dict)
    _write_json(out / "generation_config.json", build_generation_config_dict(ids))
    _write_json(out / "preprocessor_config.json", build_preprocessor_config_dict())
    write_safetensors(build_state(config, seed, _DTYPES[spec.storage_dtype]), out, max_shard_bytes)
    _save_speakers(build_speakers(spec, reserved.speaker_bos, seed), out / SPEAKER_FILE)
    return out
