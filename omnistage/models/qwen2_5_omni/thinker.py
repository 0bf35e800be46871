"""Qwen2.5-Omni Thinker text model over flattened token rows and a paged KV cache.

Parameter names follow the hub checkpoint with ``thinker.`` stripped: ``model.embed_tokens``,
``model.layers.N.*``, ``model.norm``, ``lm_head``. The audio and vision towers (``thinker.audio_tower.*``,
``thinker.visual.*``) are separate modules (``audio_encoder``, ``vision_encoder``); their outputs arrive here as
rows to scatter: ``mm_rows`` [M] take ``mm_embeds`` [M, H] instead of their token embedding.

Positions: ``[N]`` (plain RoPE: text, audio-only prompts, decode rows at ``index + rope_delta``) or ``[N, 3]``
(T, H, W) TMRoPE ids, whose rotary frequencies are split into three contiguous sections (``mrope_section``).

What the Talker reads from the Thinker is one row per processed token: its layer-0 embedding plus its
final-normed hidden state (transformers' ``hidden_states[i][0] + hidden_states[i][-1]``), for every prompt row
and for every generated token the Thinker feeds back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from omnistage.attention.backend import AttentionMetadata
from omnistage.models.layers.fast_linear import pack_embedding, pack_output_head
from omnistage.models.qwen2_5_omni.decoder import (
    Qwen2PagedDecoder,
    decoder_config,
    sectioned_axis_of_frequency,
)


@dataclass
class ThinkerOutput:
    hidden: torch.Tensor  # [N, H] final-normed; feeds compute_logits
    embeds: torch.Tensor  # [N, H] layer-0 input embeddings

    @property
    def talker_rows(self) -> torch.Tensor:
        """[N, H] embedding + final hidden: what the Talker consumes for each of these rows."""
        return self.embeds + self.hidden


class Thinker(nn.Module):
    """Built from the full Qwen2_5OmniConfig (reads ``thinker_config.text_config``)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        text_cfg = config.thinker_config.text_config
        self.cfg = decoder_config(text_cfg)
        self.vocab_size = int(text_cfg.vocab_size)
        self.model = Qwen2PagedDecoder(self.cfg, self.vocab_size)
        self.mrope_axis = nn.Buffer(sectioned_axis_of_frequency(text_cfg, self.cfg.head_dim), persistent=False)
        self.lm_head = nn.Linear(self.cfg.hidden_size, self.vocab_size, bias=False)
        if getattr(config.thinker_config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_meta: AttentionMetadata,
        mm_rows: torch.Tensor | None = None,
        mm_embeds: torch.Tensor | None = None,
        rope_freqs: torch.Tensor | None = None,
    ) -> ThinkerOutput:
        embeds = self.embed(input_ids)
        if mm_rows is not None and mm_rows.numel():
            embeds = embeds.index_copy(0, mm_rows, mm_embeds.to(embeds.dtype))
        hidden = self.model(embeds, positions, kv_caches, attn_meta, self.mrope_axis, rope_freqs)
        return ThinkerOutput(hidden=hidden, embeds=embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def pack_weights(self, batch_hint: int) -> int:
        """The ``fast`` option's part here: the output head on AMX tiles (``pack_output_head``), a float32 model's
        bfloat16-valued embedding kept in bfloat16 (``pack_embedding``); the other layers are packed after this
        call."""
        return (pack_output_head(self.lm_head, self.model.embed_tokens)
                + pack_embedding(self.model.embed_tokens, self.lm_head))
