"""How far quantized weights move a model: per-layer relative output error against the checkpoint's float
weights, and teacher-forced top-1 agreement of the Thinker's text logits and the Talker's codec logits (every
position of the same prefixes, one prefill each: after the first differing token a free-running comparison
says nothing). Shared by ``tests/models/test_quant_accuracy.py`` (bounds at small sizes) and
``benchmarks/quant_accuracy.py`` (the released widths)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.attention.backend import allocate_kv_cache, build_attention_metadata
from omnistage.config.quantization import Quantization
from omnistage.models.layers.quant_layers import QuantExperts, QuantLinear
from omnistage.models.loader import building, load_into, load_weights
from omnistage.models.prequantized import read_stored
from omnistage.models.qwen3_omni.config import load_config
from omnistage.models.qwen3_omni.family import Qwen3OmniFamily
from omnistage.models.qwen3_omni.talker import Talker
from omnistage.models.qwen3_omni.thinker import Thinker

_BLOCK = 16


def load_part(model_dir: str | Path, part: str, dtype: torch.dtype, quantization: Quantization) -> nn.Module:
    """The Thinker or the Talker of a checkpoint, quantized as the engine would (no fast kernels)."""
    config = load_config(model_dir)
    scheme = Qwen3OmniFamily(model_dir).quant_scheme(part, quantization)
    cls, skip = (Thinker, ("audio_tower.", "visual.")) if part == "thinker" else (Talker, ())
    with building(dtype, "cpu", init=scheme is None and read_stored(model_dir) is None):
        model = cls(config)
    load_into(model, model_dir, f"{part}.", dtype, skip=skip, quantize=scheme)
    return model.eval()


def _prefill(decoder_call, layers: int, kv_heads: int, head_dim: int, batch: int, rows: int, dtype: torch.dtype):
    """One prefill of ``batch`` requests of ``rows`` tokens each (flattened request-major)."""
    blocks = -(-rows // _BLOCK)
    kv = allocate_kv_cache(layers, batch * blocks + 1, _BLOCK, kv_heads, head_dim, dtype)
    tables = [list(range(r * blocks, (r + 1) * blocks)) for r in range(batch)]
    meta = build_attention_metadata([rows] * batch, [0] * batch, tables, _BLOCK, batch * blocks + 1)
    return decoder_call(torch.arange(rows).repeat(batch), kv, meta)


@torch.inference_mode()
def thinker_logits(thinker: Thinker, ids: torch.Tensor) -> torch.Tensor:
    """Logits [P * T, V] (float32) at every position of P prefixes of token ids [P, T], teacher-forced in one
    prefill."""
    cfg = thinker.cfg
    out = _prefill(lambda pos, kv, meta: thinker(ids.flatten(), pos, kv, meta), cfg.num_layers, cfg.num_kv_heads,
                   cfg.head_dim, *ids.shape, thinker.model.embed_tokens.weight.dtype)
    return thinker.compute_logits(out.hidden).float()


@torch.inference_mode()
def codec_logits(talker: Talker, codes: torch.Tensor) -> torch.Tensor:
    """Codec logits [P * T, vocab] (float32) at every position of the Talker fed P prefixes of codec ids [P, T]
    as its input rows."""
    cfg = talker.model.cfg
    embeds = talker.model.codec_embedding(codes.flatten())
    hidden = _prefill(lambda pos, kv, meta: talker(embeds, pos, kv, meta), cfg.num_layers, cfg.num_kv_heads,
                      cfg.head_dim, *codes.shape, embeds.dtype)
    return talker.compute_logits(hidden, suppress=False).float()


def top1_agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of positions whose argmax agrees."""
    return float((a.argmax(-1) == b.argmax(-1)).float().mean())


@dataclass(frozen=True)
class LayerError:
    name: str
    fmt: str
    relative_error: float  # ||x W_q^T - x W^T|| / ||x W^T|| over random rows x


@torch.inference_mode()
def layer_errors(model: nn.Module, model_dir: str | Path, prefix: str, rows: int = 32,
                 seed: int = 0) -> list[LayerError]:
    """Every quantized layer's relative output error against its checkpoint weights (float32, random inputs);
    stacked experts as one error over all experts (each expert's product with the same rows)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for path, sub in model.named_modules():
        if isinstance(sub, QuantLinear):
            base, _, leaf = (prefix + path).rpartition(".")
            parts = _FUSED.get(leaf, (leaf,))
            ref = load_weights(model_dir, base + ".", dtype=None)
            pairs = {"": [(sub.weight_q, torch.cat([ref[f"{p}.weight"] for p in parts]))]}
        elif isinstance(sub, QuantExperts):
            ref = load_weights(model_dir, prefix + path + ".", dtype=None)
            pairs = {
                ".gate_up_proj": [(sub.gate_up_q.select(e), torch.cat([ref[f"{e}.gate_proj.weight"],
                                                                        ref[f"{e}.up_proj.weight"]]))
                                  for e in range(sub.num_experts)],
                ".down_proj": [(sub.down_q.select(e), ref[f"{e}.down_proj.weight"]) for e in range(sub.num_experts)],
            }
        else:
            continue
        for suffix, weights in pairs.items():
            x = torch.randn(rows, weights[0][0].in_features, generator=gen)
            noise = signal = 0.0
            for wq, w in weights:
                exact = x @ w.float().T
                noise += float((x @ wq.dequantize(torch.float32).T - exact).pow(2).sum())
                signal += float(exact.pow(2).sum())
            out.append(LayerError(path + suffix, weights[0][0].fmt.name, (noise / signal) ** 0.5))
        del ref
    return out


_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def snr_db(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Signal-to-noise ratio of ``other`` against ``reference`` in dB (inf when equal)."""
    noise = (other.float() - reference.float()).pow(2).sum()
    return float("inf") if noise == 0 else float(10 * torch.log10(reference.float().pow(2).sum() / noise))


def relative_error(reference: torch.Tensor, other: torch.Tensor) -> float:
    return float(F.mse_loss(other.float(), reference.float(), reduction="sum").sqrt() / reference.float().norm())
