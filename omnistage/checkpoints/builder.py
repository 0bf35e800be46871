"""Build a random Qwen3-Omni checkpoint in the real Hugging Face format, fully offline."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from tokenizers import Tokenizer
from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

from omnistage.checkpoints.presets import (
    Preset,
    build_config_dict,
    build_generation_config_dict,
    build_preprocessor_config_dict,
    build_video_preprocessor_config_dict,
    get_preset,
)
from omnistage.checkpoints.shaping import shape_weights
from omnistage.checkpoints.tokenizer import CHAT_TEMPLATE, save_tokenizer, tokenizer_ids, train_tokenizer
from omnistage.checkpoints.weights import init_state_dict, to_hub_layout, write_safetensors

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def make_hf_config(config_dict: dict) -> Qwen3OmniMoeConfig:
    with warnings.catch_warnings():
        # mrope keys in the talker's rope_parameters are flagged as unknown by the validator; they are used.
        warnings.simplefilter("ignore")
        return Qwen3OmniMoeConfig(**config_dict)


def build_state(config: Qwen3OmniMoeConfig, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """All checkpoint tensors (hub names), seeded by `seed`, stored as `dtype`."""
    with torch.device("meta"):
        skeleton = Qwen3OmniMoeForConditionalGeneration(config)
    state = to_hub_layout(init_state_dict(skeleton, seed))
    return {k: v.to(dtype) for k, v in state.items()}


FAMILIES = ("qwen3_omni", "qwen2_5_omni")


def write_config_files(out: Path, spec: Preset, thinker_vocab: int | None = None) -> tuple[Tokenizer, dict]:
    """Everything of a Qwen3-Omni checkpoint but its weights: the tokenizer (trained here), config.json (a Thinker
    vocabulary of ``thinker_vocab`` rows where larger than the tokenizer's), generation, processor and chat
    template files. Returns (tokenizer, the config.json contents)."""
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(spec.bpe_vocab_size)
    ids = tokenizer_ids(tok)
    save_tokenizer(tok, out)
    config_dict = build_config_dict(spec, ids)
    if thinker_vocab is not None:
        config_dict["thinker_config"]["text_config"]["vocab_size"] = max(thinker_vocab, ids.vocab_size)
    _write_json(out / "config.json", config_dict)
    _write_json(out / "generation_config.json", build_generation_config_dict(ids))
    _write_json(out / "preprocessor_config.json", build_preprocessor_config_dict())
    _write_json(out / "video_preprocessor_config.json", build_video_preprocessor_config_dict())
    _write_json(out / "chat_template.json", {"chat_template": CHAT_TEMPLATE})
    return tok, config_dict


def build_checkpoint(
    out_dir: str | Path,
    preset: str | Preset = "tiny",
    seed: int = 0,
    max_shard_bytes: int | None = None,
    family: str = "qwen3_omni",
) -> Path:
    """Write a complete checkpoint directory of model `family` and return its path.

    Files: config.json, generation_config.json, model.safetensors (or shards + index when
    `max_shard_bytes` is exceeded), tokenizer.json, tokenizer_config.json, vocab.json, merges.txt, and for
    qwen3_omni the processor's files: preprocessor_config.json (audio features + images),
    video_preprocessor_config.json, chat_template.json; for qwen2_5_omni spk_dict.pt (text-only, no
    processor files). The same (family, preset, seed) gives byte-identical files. ``preset``: a preset's name,
    or (qwen3_omni) a ``Preset`` of any sizes.
    """
    if family == "qwen2_5_omni":
        from omnistage.checkpoints.qwen2_5_omni.builder import build_checkpoint as build_qwen2_5_omni

        return build_qwen2_5_omni(out_dir, preset, seed, max_shard_bytes)
    if family != "qwen3_omni":
        raise ValueError(f"unknown model family {family!r}; choose from {list(FAMILIES)}")
    spec = preset if isinstance(preset, Preset) else get_preset(preset)
    out = Path(out_dir)
    tok, config_dict = write_config_files(out, spec)
    config = make_hf_config(config_dict)
    state = build_state(config, seed, torch.float32)
    shape_weights(state, config_dict, tok)
    write_safetensors({k: v.to(_DTYPES[spec.storage_dtype]) for k, v in state.items()}, out, max_shard_bytes)
    return out
