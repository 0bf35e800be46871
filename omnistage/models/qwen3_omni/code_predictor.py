"""Qwen3-Omni code predictor: fills in code groups 1..Q-1 of a codec frame from the Talker's hidden state.

Names follow the checkpoint with ``talker.code_predictor.`` stripped: ``model.layers.N.*``, ``model.norm``,
``model.codec_embedding.{0..Q-2}`` (embeds code group g+1) and ``lm_head.{0..Q-2}`` (predicts group g+1).

One call runs all requests of a step in lockstep: a 2-row prefill ``[talker hidden, embed(code0)]`` at
positions 0, 1, then Q-2 single-row steps, each attending to a small contiguous per-call KV cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.models.layers.attention import AttendFn
from omnistage.models.layers.decoder import DecoderConfig, DecoderLayer
from omnistage.models.layers.norm import RMSNorm
from omnistage.models.layers.rotary import RotaryEmbedding

# sample(logits [B, V], group) -> codes [B]; group runs 1..Q-1.
SampleFn = Callable[[torch.Tensor, int], torch.Tensor]


@dataclass(frozen=True)
class CodePredictorConfig:
    decoder: DecoderConfig
    vocab_size: int
    num_code_groups: int

    def __post_init__(self) -> None:
        if self.num_code_groups < 2:
            raise ValueError(f"num_code_groups must be >= 2, got {self.num_code_groups}")
        if self.vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {self.vocab_size}")
        if self.decoder.sparse_layers:
            raise ValueError("the code predictor is a dense decoder")

    @classmethod
    def from_hf(cls, cfg: Any) -> CodePredictorConfig:
        return cls(DecoderConfig.from_hf(cfg), cfg.vocab_size, cfg.num_code_groups)


class _ContiguousCache:
    """K/V for one predict() call: [B, Q, kv_heads, dim] per layer, filled left to right."""

    def __init__(self, num_layers: int, batch: int, length: int, kv_heads: int, dim: int, like: torch.Tensor):
        shape = (batch, length, kv_heads, dim)
        self.k = [like.new_empty(shape) for _ in range(num_layers)]
        self.v = [like.new_empty(shape) for _ in range(num_layers)]
        self.start = 0

    def attend_fn(self, layer: int) -> AttendFn:
        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
            # q: [B, T, heads, dim]; k, v: [B, T, kv_heads, dim] for positions start..start+T-1.
            t = q.shape[1]
            end = self.start + t
            self.k[layer][:, self.start : end] = k
            self.v[layer][:, self.start : end] = v
            kb, vb = self.k[layer][:, :end], self.v[layer][:, :end]
            rep = q.shape[2] // kb.shape[2]
            if rep > 1:
                kb = kb.repeat_interleave(rep, dim=2)
                vb = vb.repeat_interleave(rep, dim=2)
            # Every request sits at the same position, so one causal mask (or none for one query) serves all.
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2), is_causal=t > 1, scale=scale
            )
            return out.transpose(1, 2)

        return attend


class CodePredictorModel(nn.Module):
    def __init__(self, cfg: CodePredictorConfig) -> None:
        super().__init__()
        d = cfg.decoder
        self.layers = nn.ModuleList(DecoderLayer(d, i) for i in range(d.num_layers))
        self.norm = RMSNorm(d.hidden_size, d.rms_norm_eps)
        self.rotary = RotaryEmbedding(d.head_dim, d.rope_theta)
        self.codec_embedding = nn.ModuleList(
            nn.Embedding(cfg.vocab_size, d.hidden_size) for _ in range(cfg.num_code_groups - 1)
        )

    def forward(self, h: torch.Tensor, start: int, cache: _ContiguousCache) -> torch.Tensor:
        """h: [B, T, H] rows at positions start..start+T-1 -> final-normed [B, T, H]."""
        positions = torch.arange(start, start + h.shape[1], device=h.device)
        cos, sin = self.rotary(positions, h.dtype)
        cache.start = start
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, cache.attend_fn(i))
        return self.norm(h)


class CodePredictor(nn.Module):
    def __init__(self, config: Any) -> None:
        """config: transformers' ``talker_config.code_predictor_config`` (or a CodePredictorConfig)."""
        super().__init__()
        self.cfg = config if isinstance(config, CodePredictorConfig) else CodePredictorConfig.from_hf(config)
        self.num_code_groups = self.cfg.num_code_groups
        self.model = CodePredictorModel(self.cfg)
        self.lm_head = nn.ModuleList(
            nn.Linear(self.cfg.decoder.hidden_size, self.cfg.vocab_size, bias=False)
            for _ in range(self.num_code_groups - 1)
        )

    def embed_group(self, codes: torch.Tensor, group: int) -> torch.Tensor:
        """Embedding of code group ``group`` (1..Q-1); group 0 is embedded by the Talker's codec table."""
        return self.model.codec_embedding[group - 1](codes)

    def new_cache(self, batch: int, like: torch.Tensor) -> _ContiguousCache:
        d = self.cfg.decoder
        return _ContiguousCache(d.num_layers, batch, self.num_code_groups, d.num_kv_heads, d.head_dim, like)

    def logits(self, hidden: torch.Tensor, group: int) -> torch.Tensor:
        """Logits for code group ``group`` (1..Q-1) from the predictor's last hidden row."""
        return self.lm_head[group - 1](hidden)

    def predict(
        self,
        talker_hidden: torch.Tensor,
        code0: torch.Tensor,
        code0_embed: torch.Tensor,
        sample: SampleFn,
        forced_codes: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fill a frame for B requests at once.

        talker_hidden: [B, H] the Talker's final-normed hidden of the previous step; code0: [B] the layer-0 code
        sampled from it; code0_embed: [B, H] the Talker's codec embedding of code0. ``forced_codes`` [B, Q-1]
        (teacher forcing, tests) feeds given codes instead of the sampled ones; ``sample`` still sees the logits.
        Returns (codes [B, Q] with code0 first, embed_sum [B, H] = sum of all Q code embeddings, which is what
        the Talker adds to the next step's input).
        """
        if talker_hidden.dim() != 2 or code0.shape != talker_hidden.shape[:1]:
            raise ValueError(
                f"expected talker_hidden [B, H] and code0 [B], got {talker_hidden.shape}, {code0.shape}"
            )
        batch = talker_hidden.shape[0]
        cache = self.new_cache(batch, talker_hidden)
        x = torch.stack((talker_hidden, code0_embed.to(talker_hidden.dtype)), dim=1)  # [B, 2, H]
        start = 0
        codes = [code0]
        embeds = [code0_embed.to(talker_hidden.dtype)]
        for group in range(1, self.num_code_groups):
            h = self.model(x, start, cache)
            start += x.shape[1]
            picked = sample(self.logits(h[:, -1], group), group)
            if forced_codes is not None:
                picked = forced_codes[:, group - 1]
            codes.append(picked)
            emb = self.embed_group(picked, group)
            embeds.append(emb)
            x = emb[:, None]
        # One stacked sum (not a running sum): the same reduction the reference uses, so float32 bits agree.
        return torch.stack(codes, dim=1), torch.stack(embeds, dim=1).sum(dim=1)
