"""The Qwen2.5 dense decoder (Thinker and Talker) over flattened token rows and a paged KV cache.

It differs from the shared Qwen3 layers in one place: attention has q/k/v biases and no per-head q/k norm
(o_proj has no bias). RMSNorm, rotary embedding, SwiGLU MLP and the paged attention backend are shared.
Positions are 1-D: for text-only input Qwen2.5-Omni's MRoPE gives all three axes the same id, which is plain
RoPE (the mrope sections only matter once audio/image/video positions differ per axis).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from omnistage.attention.backend import AttentionMetadata
from omnistage.models.layers.attention import AttendFn
from omnistage.models.layers.decoder import DecoderConfig, paged_attend
from omnistage.models.layers.mlp import GatedMLP
from omnistage.models.layers.norm import RMSNorm
from omnistage.models.layers.rotary import RotaryEmbedding, apply_rotary


def decoder_config(cfg: Any) -> DecoderConfig:
    """A Qwen2.5-Omni text/talker config as a dense DecoderConfig (always biased q/k/v)."""
    if getattr(cfg, "use_sliding_window", False):
        raise ValueError("sliding-window attention is not supported")
    base = DecoderConfig.from_hf(cfg)
    if base.sparse_layers:
        raise ValueError("Qwen2.5-Omni decoders are dense")
    return DecoderConfig(
        hidden_size=base.hidden_size,
        num_layers=base.num_layers,
        num_heads=base.num_heads,
        num_kv_heads=base.num_kv_heads,
        head_dim=base.head_dim,
        intermediate_size=base.intermediate_size,
        rms_norm_eps=base.rms_norm_eps,
        rope_theta=base.rope_theta,
        attention_bias=True,
    )


class BiasedAttention(nn.Module):
    """Qwen2 self-attention: biased q/k/v projections, unbiased output, RoPE; attention itself injected."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=True)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=True)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=True)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: AttendFn) -> torch.Tensor:
        lead = x.shape[:-1]
        q = apply_rotary(self.q_proj(x).view(*lead, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(self.k_proj(x).view(*lead, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(*lead, self.num_kv_heads, self.head_dim)
        out = attend(q, k, v, self.scale)
        return self.o_proj(out.reshape(*lead, self.num_heads * self.head_dim))


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.self_attn = BiasedAttention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: AttendFn) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, attend)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen2PagedDecoder(nn.Module):
    """``embed_tokens`` + ``layers`` + final ``norm`` (checkpoint names), one paged KV cache per layer."""

    def __init__(self, cfg: DecoderConfig, vocab_size: int, embedding_size: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(vocab_size, embedding_size or cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen2DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)

    def forward(
        self, h: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], attn_meta: AttentionMetadata
    ) -> torch.Tensor:
        """h: [N, H] layer-0 input rows -> final-normed [N, H]."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.layers)} layers")
        if positions.shape[0] != h.shape[0]:
            raise ValueError(f"positions has {positions.shape[0]} rows, hidden has {h.shape[0]}")
        cos, sin = self.rotary(positions, h.dtype)
        for layer, cache in zip(self.layers, kv_caches):
            h = layer(h, cos, sin, paged_attend(cache, attn_meta))
        return self.norm(h)
