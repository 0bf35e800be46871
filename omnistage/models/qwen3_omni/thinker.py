"""Qwen3-Omni Thinker text model over flattened token rows and a paged KV cache.

Parameter names follow the hub checkpoint with the ``thinker.`` prefix stripped: ``model.embed_tokens``,
``model.layers.N.*``, ``model.norm``, ``lm_head``. The audio and vision encoders are separate stages/modules.
Positions are 1-D: for text-only input Qwen3-Omni's MRoPE gives every axis the same id, which is plain RoPE.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from omnistage.attention.backend import AttentionMetadata
from omnistage.models.layers.decoder import DecoderConfig, PagedDecoder


@dataclass
class ThinkerOutput:
    hidden: torch.Tensor  # [N, H] final-normed, feeds compute_logits
    embeds: torch.Tensor  # [N, H] layer-0 input embeddings (the Talker's text side)
    accept_hidden: torch.Tensor  # [N, H] hidden entering layer talker_config.accept_hidden_layer


class ThinkerTextModel(PagedDecoder):
    def __init__(self, cfg: DecoderConfig, vocab_size: int) -> None:
        super().__init__(cfg)
        self.embed_tokens = nn.Embedding(vocab_size, cfg.hidden_size)


class Thinker(nn.Module):
    """Built from the full Qwen3OmniMoeConfig (needs ``thinker_config`` and ``talker_config.accept_hidden_layer``)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        text_cfg = config.thinker_config.text_config
        self.cfg = DecoderConfig.from_hf(text_cfg)
        self.vocab_size = text_cfg.vocab_size
        talker_cfg = getattr(config, "talker_config", None)
        # transformers' hidden_states[i] is the input of layer i (index num_layers is the final-normed output).
        self.accept_hidden_layer = int(talker_cfg.accept_hidden_layer) if talker_cfg is not None else 0
        if not 0 <= self.accept_hidden_layer <= self.cfg.num_layers:
            raise ValueError(
                f"accept_hidden_layer={self.accept_hidden_layer} outside [0, {self.cfg.num_layers}] for the Thinker"
            )
        self.model = ThinkerTextModel(self.cfg, self.vocab_size)
        self.lm_head = nn.Linear(self.cfg.hidden_size, self.vocab_size, bias=False)
        if getattr(config.thinker_config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
    ) -> ThinkerOutput:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        embeds = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        hidden, accept = self.model.run_layers(
            embeds, positions, kv_caches, attn_meta, capture_layer=self.accept_hidden_layer
        )
        assert accept is not None
        return ThinkerOutput(hidden=hidden, embeds=embeds, accept_hidden=accept)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
