"""The Qwen2.5 dense decoder (Thinker and Talker) over flattened token rows and a paged KV cache.

It is the shared decoder (``layers/decoder.py``) with Qwen2's attention options: q/k/v biases, an unbiased
output projection and no per-head q/k norm.
Positions are 1-D: for text-only input Qwen2.5-Omni's MRoPE gives all three axes the same id, which is plain
RoPE (the mrope sections only matter once audio/image/video positions differ per axis).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from omnistage.attention.backend import AttentionMetadata
from omnistage.models.layers.decoder import DecoderConfig, PagedDecoder


def decoder_config(cfg: Any) -> DecoderConfig:
    """A Qwen2.5-Omni text/talker config as a dense DecoderConfig (always biased q/k/v)."""
    if getattr(cfg, "use_sliding_window", False):
        raise ValueError("sliding-window attention is not supported")
    base = DecoderConfig.from_hf(cfg)
    if base.sparse_layers:
        raise ValueError("Qwen2.5-Omni decoders are dense")
    return dataclasses.replace(base, qkv_bias=True, o_bias=False, qk_norm=False)


class Qwen2PagedDecoder(PagedDecoder):
    """``embed_tokens`` + the shared ``layers`` and final ``norm`` (checkpoint names), one paged KV cache per
    layer."""

    def __init__(self, cfg: DecoderConfig, vocab_size: int, embedding_size: int | None = None) -> None:
        super().__init__(cfg)
        self.embed_tokens = nn.Embedding(vocab_size, embedding_size or cfg.hidden_size)

    def forward(
        self, h: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], attn_meta: AttentionMetadata
    ) -> torch.Tensor:
        """h: [N, H] layer-0 input rows -> final-normed [N, H]."""
        return self.run_layers(h, positions, kv_caches, attn_meta)[0]
