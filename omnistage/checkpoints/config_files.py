"""A Qwen3-Omni checkpoint's files other than its weights (tokenizer, config.json, generation, processor and chat
template files), shared by the in-memory builder and the released-architecture writer."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from tokenizers import Tokenizer
from transformers import Qwen3OmniMoeConfig

from omnistage.checkpoints.presets import (
    Preset,
    build_config_dict,
    build_generation_config_dict,
    build_preprocessor_config_dict,
    build_video_preprocessor_config_dict,
)
from omnistage.checkpoints.tokenizer import CHAT_TEMPLATE, save_tokenizer, tokenizer_ids, train_tokenizer


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def make_hf_config(config_dict: dict) -> Qwen3OmniMoeConfig:
    with warnings.catch_warnings():
        # mrope keys in the talker's rope_parameters are flagged as unknown by the validator; they are used.
        warnings.simplefilter("ignore")
        return Qwen3OmniMoeConfig(**config_dict)


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
