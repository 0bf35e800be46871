"""Build a random Qwen3-Omni checkpoint in the real Hugging Face format, fully offline."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

from omnistage.checkpoints.config_files import make_hf_config, write_config_files
from omnistage.checkpoints.presets import Preset, get_preset
from omnistage.checkpoints.shaping import shape_weights
from omnistage.checkpoints.weights import init_state_dict, to_hub_layout, write_safetensors
from omnistage.config.quantization import Quantization

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_state(config: Qwen3OmniMoeConfig, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """All checkpoint tensors (hub names), seeded by `seed`, stored as `dtype`."""
    with torch.device("meta"):
        skeleton = Qwen3OmniMoeForConditionalGeneration(config)
    state = to_hub_layout(init_state_dict(skeleton, seed))
    return {k: v.to(dtype) for k, v in state.items()}


FAMILIES = ("qwen3_omni", "qwen2_5_omni")


def build_checkpoint(
    out_dir: str | Path,
    preset: str | Preset = "tiny",
    seed: int = 0,
    max_shard_bytes: int | None = None,
    family: str = "qwen3_omni",
    depth: str | None = None,
    quantization: str = "none",
    quantization_group_size: int | None = None,
) -> Path:
    """Write a complete checkpoint directory of model `family` and return its path.

    Files: config.json, generation_config.json, model.safetensors (or shards + index when
    `max_shard_bytes` is exceeded), tokenizer.json, tokenizer_config.json, vocab.json, merges.txt, and for
    qwen3_omni the processor's files: preprocessor_config.json (audio features + images),
    video_preprocessor_config.json, chat_template.json; for qwen2_5_omni spk_dict.pt (text-only, no
    processor files). The same (family, preset, seed) gives byte-identical files. ``preset``: a preset's name,
    or (qwen3_omni) a ``Preset`` of any sizes.
    """
    if preset == "real":  # the released architecture, streamed shard by shard (checkpoints/real.py)
        if family != "qwen3_omni":
            raise ValueError(f"preset 'real' is Qwen3-Omni's released architecture, not {family!r}'s")
        from omnistage.checkpoints.real import DEFAULT_SHARD_BYTES, build_real_checkpoint, parse_depth

        return build_real_checkpoint(out_dir, parse_depth(depth), seed, max_shard_bytes or DEFAULT_SHARD_BYTES,
                                     quantization=Quantization(quantization, quantization_group_size))
    if depth:
        raise ValueError("--depth applies to --preset real")
    if quantization != "none":
        raise ValueError("--quantization applies to --preset real (other presets: quantize while loading)")
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
