"""Variants of a built checkpoint for tests: a copy whose config.json is edited and whose tensors are filtered
(the weights otherwise untouched), or some of whose tensors are scaled; the checkpoint in transformers' FP8 format,
as GPTQ or AWQ, or in PyTorch's pickled files."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from omnistage.models.loader import load_weights

WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
FP8_MAX = 448.0  # float8 e4m3's largest finite value
# transformers' FP8 variant: how each stack's scales are stored (the format allows any float dtype, and E8M0
# exponents as float8_e8m0fnu or raw bytes); "tensor": one scale for the weight
FP8_SCALES = {"thinker.": "float32", "talker.model.": "bfloat16", "talker.code_predictor.": "e8m0",
              "talker.text_projection.": "e8m0-bytes", "talker.hidden_projection.": "tensor",
              "code2wav.pre_transformer.": "float32"}
FP8_KEPT = ("embed", "lm_head", "mlp.gate.", "shared_expert_gate", "norm")  # (weights left in float)


def qk_norms(name: str) -> bool:
    """Qwen3's query and key norm weights (``scaled_variant`` x4: attention logits x16)."""
    return name.endswith(("q_norm.weight", "k_norm.weight"))


def checkpoint_variant(src: str | Path, dst: str | Path, edit: Callable[[dict[str, Any]], None],
                       drop: Callable[[str], bool] | None = None) -> Path:
    """Copy checkpoint ``src`` to ``dst``, let ``edit`` change its config.json contents in place, and leave out
    the tensors whose names ``drop`` selects."""
    dst = Path(dst)
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    if drop is not None:
        for f in dst.glob("*.safetensors"):
            tensors = {k: v for k, v in load_file(str(f)).items() if not drop(k)}
            save_file(tensors, str(f), metadata={"format": "pt"})
    return dst


def scaled_variant(src: str | Path, dst: str | Path, pick: Callable[[str], bool], factor: float) -> Path:
    """Checkpoint ``src`` with the tensors ``pick`` selects by name multiplied by ``factor`` (e.g. sharper
    attention: a tiny random checkpoint attends almost uniformly, where rotary positions hardly change an
    answer)."""
    state = load_weights(src, "", None)
    write_weights(src, dst, {"model.safetensors": {n: t * factor if pick(n) else t for n, t in state.items()}})
    return Path(dst)


def fp8_variant(src: str | Path, dst: str | Path, block: int = 16,
                stacks: dict[str, str] | None = None) -> Path:
    """Checkpoint ``src`` as transformers' FP8 quantizer writes it (``quant_method: fp8``, static activation
    scheme, blocks of ``block`` x ``block``): every 2-D weight under ``stacks`` (name prefix -> how its scales are
    stored; default ``FP8_SCALES``) but the ``FP8_KEPT`` ones (embeddings, routers, output heads, as released FP8 checkpoints keep them) in float8 e4m3
    with its ``weight_scale_inv`` (and an ``activation_scale``), the scales in a file of their own."""
    src, dst = Path(src), Path(dst)
    values, scales = {}, {}
    for name, tensor in load_weights(src, "", None).items():
        kind = next((k for stack, k in (stacks or FP8_SCALES).items() if name.startswith(stack)), None)
        if kind is None or tensor.dim() != 2 or not name.endswith(".weight") or any(k in name for k in FP8_KEPT):
            values[name] = tensor
            continue
        base = name[: -len("weight")]
        values[name], scales[base + "weight_scale_inv"] = _fp8(tensor, kind, block)
        scales[base + "activation_scale"] = torch.ones(1)
    write_weights(src, dst, {"model-00001-of-00002.safetensors": values, "model-00002-of-00002.safetensors": scales})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static",
                                  "weight_block_size": [block, block], "scale_fmt": "ue8m0",
                                  "modules_to_not_convert": ["lm_head", "mlp.gate", "shared_expert_gate"]}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def _fp8(w: torch.Tensor, kind: str, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight as transformers' FP8 quantizer stores it: (float8 e4m3 values, weight_scale_inv), per block or,
    where the blocks do not tile it, for the tensor."""
    w = w.float()
    if kind == "tensor" or w.shape[0] % block or w.shape[1] % block:  # (blocks only where they tile the weight)
        scale = (w.abs().amax() / FP8_MAX).reshape(1)
        return (w / scale).to(torch.float8_e4m3fn), scale
    tiles = w.abs().unflatten(0, (-1, block)).unflatten(2, (-1, block)).amax(dim=(1, 3)) / FP8_MAX
    if kind.startswith("e8m0"):  # a power of two at least the block's need
        exponent = tiles.clamp_min(2.0 ** -100).log2().ceil()
        tiles = exponent.exp2()
        stored = (exponent + 127).to(torch.uint8)
        scale = stored if kind == "e8m0-bytes" else stored.view(torch.float8_e8m0fnu)
    else:
        scale = tiles.to(getattr(torch, kind))
        tiles = scale.float()
    full = tiles.repeat_interleave(block, 0).repeat_interleave(block, 1)
    return (w / full).to(torch.float8_e4m3fn), scale


def packed_int_variant(src: str | Path, dst: str | Path, method: str, modules: Callable[[str], bool],
                       bits: int = 4, group_size: int = 32, sym: bool = True, act_order: bool = False,
                       checkpoint_format: str = "gptq", seed: int = 0, **config: Any) -> Path:
    """Checkpoint ``src`` as gptqmodel writes GPTQ (``method`` gptq: ``checkpoint_format`` gptq stores each zero
    point minus one, gptq_v2 as is; ``act_order``: inputs in a random group order, ``g_idx``) or AWQ (awq, GEMM,
    4 bits): every 2-D ``X.weight`` whose module ``modules`` selects (where its shape packs), quantized in groups of
    ``group_size``
    (symmetric: zero point 2^(bits-1)), scales in float16. ``config``: more quantization_config fields (e.g.
    transformers' ``block_name_to_quantize`` / ``modules_to_not_convert``)."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in load_weights(src, "", None).items():
        module = name[: -len(".weight")]
        n, k = tensor.shape if tensor.dim() == 2 else (0, 0)
        # (layers whose outputs fill no whole word or whose inputs no whole group stay float, as gptqmodel leaves them)
        if not (name.endswith(".weight") and n and modules(module) and n % (32 // bits) == 0 and k % group_size == 0):
            out[name] = tensor
            continue
        group = torch.arange(k) // group_size
        if act_order:
            group = group[torch.randperm(k, generator=gen)]
        values, zeros, scales = _quantize_groups(tensor.float(), group, bits, sym)
        per = 32 // bits
        if method == "gptq":
            offset = 1 if checkpoint_format == "gptq" else 0
            out[f"{module}.qweight"] = _pack_words(values, bits).t().contiguous()  # [K / per, N]
            out[f"{module}.qzeros"] = _pack_words(zeros - offset, bits)
            out[f"{module}.g_idx"] = group.to(torch.int32)
        else:  # AWQ: [K, N / 8] in its nibble order
            order = torch.arange(n).view(-1, per)[:, [0, 2, 4, 6, 1, 3, 5, 7]].flatten()
            out[f"{module}.qweight"] = _pack_words(values.t()[:, order].contiguous(), bits)
            out[f"{module}.qzeros"] = _pack_words(zeros[:, order].contiguous(), bits)
        out[f"{module}.scales"] = scales.half()
    write_weights(src, dst, {"model.safetensors": out})
    cfg = json.loads((Path(dst) / "config.json").read_text())
    quant = {"quant_method": method, "bits": bits, "group_size": group_size, **config}
    if method == "gptq":
        quant.update(sym=sym, desc_act=act_order, checkpoint_format=checkpoint_format)
    else:
        quant.update(version="gemm", zero_point=True)
    cfg["quantization_config"] = quant
    (Path(dst) / "config.json").write_text(json.dumps(cfg, indent=2))
    return Path(dst)


def compressed_asymmetric_variant(src: str | Path, dst: str | Path, modules: Callable[[str], bool], bits: int = 4,
                                  group_size: int | None = 32) -> Path:
    """Checkpoint ``src`` in compressed-tensors' pack-quantized format with zero points (what llm-compressor's AWQ /
    GPTQ with ``W4A16_ASYM`` writes), packed by the compressed-tensors library itself: every 2-D ``X.weight``
    whose module ``modules`` selects, in groups of ``group_size`` (None: per channel), scales in bfloat16."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    out: dict[str, torch.Tensor] = {}
    offset = 1 << (bits - 1)
    for name, tensor in load_weights(src, "", None).items():
        module = name[: -len(".weight")]
        n, k = tensor.shape if tensor.dim() == 2 else (0, 0)
        group = group_size or k
        if not (name.endswith(".weight") and n and modules(module) and k % group == 0 and k * bits % 32 == 0):
            out[name] = tensor
            continue
        values, zeros, scales = _quantize_groups(tensor.float(), torch.arange(k) // group, bits, sym=False)
        out[f"{module}.weight_packed"] = pack_to_int32((values - offset).to(torch.int8), bits)
        out[f"{module}.weight_zero_point"] = pack_to_int32((zeros.t() - offset).to(torch.int8), bits, packed_dim=0)
        out[f"{module}.weight_scale"] = scales.t().contiguous().to(torch.bfloat16)
        out[f"{module}.weight_shape"] = torch.tensor([n, k])
    write_weights(src, dst, {"model.safetensors": out})
    cfg = json.loads((Path(dst) / "config.json").read_text())
    weights = {"num_bits": bits, "type": "int", "symmetric": False, "strategy": "group" if group_size else "channel",
               "group_size": group_size, "dynamic": False, "actorder": None, "observer": "minmax"}
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                  "quantization_status": "compressed", "ignore": [], "kv_cache_scheme": None,
                                  "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                                                "input_activations": None,
                                                                "output_activations": None}}}
    (Path(dst) / "config.json").write_text(json.dumps(cfg, indent=2))
    return Path(dst)


def _quantize_groups(w: torch.Tensor, group: torch.Tensor, bits: int,
                     sym: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K], each input's group -> (values [N, K], zero points [groups, N], float16-valued scales [groups, N]),
    each in [0, 2^bits)."""
    top = (1 << bits) - 1
    groups = int(group.max()) + 1
    zeros = torch.empty(groups, w.shape[0], dtype=torch.int32)
    scales = torch.empty(groups, w.shape[0])
    values = torch.empty(w.shape, dtype=torch.int32)
    for g in range(groups):
        cols = w[:, group == g]
        if sym:
            scale, zero = cols.abs().amax(1).clamp_min(1e-6) / (top / 2), torch.full((w.shape[0],), (top + 1) // 2)
        else:
            lo, hi = cols.amin(1).clamp_max(0), cols.amax(1).clamp_min(0)
            scale = ((hi - lo) / top).clamp_min(1e-6)
            zero = (-lo / scale).round().clamp(0, top).to(torch.int32)
        scale = scale.half().float()
        values[:, group == g] = (cols / scale[:, None] + zero[:, None]).round().clamp(0, top).to(torch.int32)
        zeros[g], scales[g] = zero, scale
    return values, zeros, scales


def _pack_words(values: torch.Tensor, bits: int) -> torch.Tensor:
    """int [R, C * 32 / bits] in [0, 2^bits) -> int32 [R, C]: value j of a word at bits j * bits.. (lowest first)."""
    per = 32 // bits
    parts = values.to(torch.int64).view(values.shape[0], -1, per) << (torch.arange(per) * bits)
    return (parts.sum(-1) & 0xFFFFFFFF).to(torch.uint32).view(torch.int32)


def pickled_variant(src: str | Path, dst: str | Path, shards: int = 2) -> Path:
    """Checkpoint ``src`` with its tensors in PyTorch's pickled files instead of safetensors: one
    ``pytorch_model.bin``, or ``shards`` of them with ``pytorch_model.bin.index.json``."""
    state = load_weights(src, "", None)
    names = sorted(state)
    files = {"pytorch_model.bin": names} if shards == 1 else {
        f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin": names[i::shards] for i in range(shards)}
    write_weights(src, dst, {file: {name: state[name] for name in part} for file, part in files.items()})
    return Path(dst)


def write_weights(src: str | Path, dst: str | Path, files: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
    """A checkpoint at ``dst`` with ``src``'s other files (config, tokenizer, processor, voices) and these weight
    files (name -> tensors: safetensors, or PyTorch's pickled ``.bin``), indexed where there are several."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True)
    for extra in src.iterdir():
        if extra.suffix not in (".safetensors", ".bin") and extra.name not in WEIGHT_INDEXES:
            shutil.copy(extra, dst / extra.name)
    for file, tensors in files.items():
        if file.endswith(".bin"):
            torch.save(dict(tensors), dst / file)
        else:
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / file), metadata={"format": "pt"})
    if len(files) > 1:
        index = WEIGHT_INDEXES[1] if next(iter(files)).endswith(".bin") else WEIGHT_INDEXES[0]
        weight_map = {name: file for file, tensors in files.items() for name in tensors}
        (dst / index).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
