"""The released Qwen3-Omni-30B-A3B architecture as a random checkpoint, at any depth, written shard by shard.

Widths are the Instruct checkpoint's config.json: Thinker 2048 wide, 32 / 4 heads of 128, 128 experts top-8
(768), vocabulary 152064; Talker 1024, 16 / 2 heads, 128 experts top-6 (384) + a 768 shared expert, codec
vocabulary 3072; code predictor 5 x 1024 (16 / 8 heads, 3072), 16 code groups; Code2Wav 1024 x 8 layers,
decoder 1536; audio tower 1280 x 32 (20 heads, 5120); vision 1152 x 27 (16 heads, 4304, deepstack 8, 16, 24);
the three speakers. ``depth`` overrides the number of layers per stack (``thinker``, ``talker``,
``code_predictor``, ``code2wav``, ``audio``, ``vision``); the accept layer and the deepstack taps keep their
place in proportion (24 of 48: half way).

The token ids are the offline tokenizer's (the released vocabulary is not available offline): its 735 BPE
tokens and Qwen's special tokens sit at the bottom of the 152064 rows, the rest of the table is there, full
width, and never chosen by a prompt.

Tensors are created on the meta device, then one at a time drawn with the test weights' rules
(``checkpoints.weights``), rounded to the storage dtype and added to the current shard; a shard is written when it
reaches ``max_shard_bytes``, so building holds at most one shard plus one tensor in float32 (the largest: a
layer's stacked experts, 1.6 GB), whatever the depth. No shaping (it rescales rows of a whole table at once,
and only matters for the built-in model's words).
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import Qwen3OmniMoeForConditionalGeneration

from omnistage.checkpoints.config_files import make_hf_config, write_config_files
from omnistage.checkpoints.presets import (
    Code2WavSpec,
    DecoderSpec,
    EncoderSpec,
    Preset,
)
from omnistage.checkpoints.weights import hub_tensors, init_tensors
from omnistage.config.quantization import NO_QUANTIZATION, Quantization
from omnistage.models.layers.quant import QuantFormat, quantize
from omnistage.models.layers.quant_layers import QuantScheme
from omnistage.models.prequantized import pack, quantization_config, stored_scales
from omnistage.models.qwen3_omni.family import TOWER_LAYERS, quant_scheme

REAL_VOCAB = 152064
STACKS = ("thinker", "talker", "code_predictor", "code2wav", "audio", "vision")
DEFAULT_SHARD_BYTES = 5 * 10**9

REAL = Preset(
    name="real",
    thinker=DecoderSpec(2048, 48, 32, 4, 128, 6144, num_experts=128, top_k=8, moe_intermediate_size=768),
    talker=DecoderSpec(1024, 20, 16, 2, 128, 2048, num_experts=128, top_k=6, moe_intermediate_size=384,
                       shared_expert_intermediate_size=768),
    code_predictor=DecoderSpec(1024, 5, 16, 8, 128, 3072),
    code2wav=Code2WavSpec(hidden_size=1024, num_layers=8, num_heads=16, intermediate_size=3072, decoder_dim=1536),
    num_code_groups=16,
    codebook_size=2048,
    accept_hidden_layer=24,
    encoders=EncoderSpec(
        audio_d_model=1280, audio_layers=32, audio_heads=20, audio_ffn=5120, audio_downsample=480,
        vision_hidden=1152, vision_depth=27, vision_heads=16, vision_intermediate=4304,
        vision_position_embeddings=2304, vision_deepstack=(8, 16, 24),
    ),
    storage_dtype="bfloat16",
)


def parse_depth(text: str | None) -> dict[str, int]:
    """``"thinker=2,talker=2"`` -> {"thinker": 2, "talker": 2}; names from ``STACKS``, depths >= 1."""
    out: dict[str, int] = {}
    for item in filter(None, (text or "").split(",")):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or name not in STACKS or not value.strip().isdigit() or int(value) < 1:
            raise ValueError(f"depth entries are STACK=N with N >= 1 and STACK one of {list(STACKS)}, got {item!r}")
        out[name] = int(value)
    return out


def real_preset(depth: Mapping[str, int] | None = None) -> Preset:
    """The released architecture with ``depth`` layers per named stack (the others at full depth)."""
    depth = dict(depth or {})
    unknown = set(depth) - set(STACKS)
    if unknown:
        raise ValueError(f"unknown stacks {sorted(unknown)}; choose from {list(STACKS)}")
    p = REAL
    thinker = replace(p.thinker, num_layers=depth.get("thinker", p.thinker.num_layers))
    enc = p.encoders
    vision_depth = depth.get("vision", enc.vision_depth)
    taps = tuple(sorted({min(vision_depth - 1, t * vision_depth // enc.vision_depth) for t in enc.vision_deepstack}))
    return replace(
        p,
        thinker=thinker,
        talker=replace(p.talker, num_layers=depth.get("talker", p.talker.num_layers)),
        code_predictor=replace(p.code_predictor, num_layers=depth.get("code_predictor", p.code_predictor.num_layers)),
        code2wav=replace(p.code2wav, num_layers=depth.get("code2wav", p.code2wav.num_layers)),
        encoders=replace(enc, audio_layers=depth.get("audio", enc.audio_layers), vision_depth=vision_depth,
                         vision_deepstack=taps),
        accept_hidden_layer=p.accept_hidden_layer * thinker.num_layers // p.thinker.num_layers,
    )


def build_real_checkpoint(out_dir: str | Path, depth: Mapping[str, int] | None = None, seed: int = 0,
                          max_shard_bytes: int = DEFAULT_SHARD_BYTES, preset: Preset | None = None,
                          vocab_size: int = REAL_VOCAB, quantization: Quantization = NO_QUANTIZATION) -> Path:
    """Write the released architecture (``real_preset(depth)``, or ``preset`` with a Thinker vocabulary of
    ``vocab_size``) as a sharded checkpoint with its tokenizer and processor files; returns the directory.

    ``quantization`` int8 / int4: the weights Qwen3-Omni's scheme quantizes (``quant_scheme``) are written
    pre-quantized in compressed-tensors' pack-quantized format (each drawn tensor quantized as it is drawn,
    with ``quantization_config`` in config.json); the same weights an online quantizing load of the bfloat16
    checkpoint would hold."""
    preset = preset or real_preset(depth)
    out = Path(out_dir)
    _, config_dict = write_config_files(out, preset, thinker_vocab=vocab_size)
    schemes = {part: quant_scheme(part, quantization) for part in ("thinker", "talker")}
    if quantization.enabled:
        config_dict = _with_quantization_config(out, config_dict, quantization)
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        skeleton = Qwen3OmniMoeForConditionalGeneration(make_hf_config(config_dict))
    dtype = getattr(torch, preset.storage_dtype)
    shards: list[list[str]] = []
    shard: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        shards.append(sorted(shard))
        save_file(shard, str(out / f"shard-{len(shards):05d}.tmp"), metadata={"format": "pt"})
        shard.clear()

    # One tensor at a time: a layer's stacked experts are drawn whole, then split as the hub stores them.
    hubbed = (item for name, value in init_tensors(skeleton, seed) for item in hub_tensors(name, value))
    for hub, value in hubbed:
        stored = _stored(hub, value, schemes, dtype)
        nbytes = sum(t.numel() * t.element_size() for t in stored.values())
        if shard and size + nbytes > max_shard_bytes:
            flush()
            size = 0
        shard.update(stored)
        size += nbytes
        total += nbytes
    if shard:
        flush()
    weight_map = {}
    for i, names in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        (out / f"shard-{i:05d}.tmp").rename(out / fname)
        weight_map.update(dict.fromkeys(names, fname))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return out


def _stored(hub: str, value: torch.Tensor, schemes: Mapping[str, QuantScheme | None],
            dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One drawn tensor as stored: in ``dtype``, or pre-quantized (weight_packed / weight_scale / weight_shape)
    where its part's scheme quantizes it."""
    part, _, rel = hub.partition(".")
    scheme = schemes.get(part)
    fmt = scheme.format_for(rel, tuple(value.shape)) if scheme is not None else None
    if fmt is None:
        return {hub: value.to(dtype).contiguous()}
    values, scales = quantize(value.to(dtype), fmt)  # (what quantizing the stored bfloat16 weight gives)
    base = hub[: -len("weight")]
    return {base + "weight_packed": pack(values, fmt), base + "weight_scale": stored_scales(scales, dtype),
            base + "weight_shape": torch.tensor(list(value.shape), dtype=torch.int64)}


def _with_quantization_config(out: Path, config_dict: dict, quantization: Quantization) -> dict:
    """config.json with the compressed-tensors ``quantization_config`` of Qwen3-Omni's scheme."""
    decoders = r"re:^(thinker|talker)\.model\.layers\..*"
    int8_only = [r"re:^talker\.code_predictor\.model\.layers\..*"]
    int8_only += [f"re:^thinker\\.{re.escape(prefix)}.*" for prefix in TOWER_LAYERS]
    if quantization.method == "int8":
        groups = [([decoders, *int8_only], QuantFormat(8, quantization.group_size))]
    else:
        groups = [([decoders], QuantFormat(4, quantization.int4_group)), (int8_only, QuantFormat(8))]
    ignore = [r"re:.*mlp\.gate$", r"re:.*mlp\.shared_expert_gate$"]
    config_dict = {**config_dict, "quantization_config": quantization_config(groups, ignore)}
    (out / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")
    return config_dict
