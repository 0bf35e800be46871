"""Qwen3-Omni Thinker text model over flattened token rows and a paged KV cache.

Parameter names follow the hub checkpoint with the ``thinker.`` prefix stripped: ``model.embed_tokens``,
``model.layers.N.*``, ``model.norm``, ``lm_head``. The audio and vision encoders are separate modules
(``audio_encoder.py``, ``vision_encoder.py``); their outputs arrive here as rows to scatter.

Positions: ``[N]`` when every row has equal ids on the three MRoPE axes (text, decode: plain RoPE, possibly at
fractional ids after a video), ``[N, 3]`` (T, H, W) otherwise. Media rows: ``mm_rows`` [M] take ``mm_embeds``
[M, H] instead of their token embedding; visual rows ``deepstack_rows`` [V] get ``deepstack[k]`` added after
decoder layer k. The captured accept-layer rows are taken before deepstack is added, as transformers records
its hidden states.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from omnistage.attention.backend import AttentionMetadata
from omnistage.models.layers.decoder import DecoderConfig, PagedDecoder
from omnistage.models.layers.fast_linear import pack_embedding, pack_output_head
from omnistage.models.qwen3_omni.mrope import mrope_axis_of_frequency, mrope_cos_sin, mrope_sections


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
    """Built from the full Qwen3OmniMoeConfig (needs ``thinker_config``, and ``talker_config.accept_hidden_layer``
    where the model speaks)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        text_cfg = config.thinker_config.text_config
        self.cfg = DecoderConfig.from_hf(text_cfg)
        self.vocab_size = text_cfg.vocab_size
        talker_cfg = getattr(config, "talker_config", None)
        # transformers' hidden_states[i] is the input of layer i (index num_layers is the final-normed output);
        # a model that does not speak has no Talker to read them
        speaks = talker_cfg is not None and getattr(config, "enable_audio_output", True)
        self.accept_hidden_layer = int(talker_cfg.accept_hidden_layer) if speaks else 0
        if not 0 <= self.accept_hidden_layer <= self.cfg.num_layers:
            raise ValueError(
                f"accept_hidden_layer={self.accept_hidden_layer} outside [0, {self.cfg.num_layers}] for the Thinker"
            )
        self.model = ThinkerTextModel(self.cfg, self.vocab_size)
        sections = mrope_sections(text_cfg, self.cfg.head_dim)
        self.mrope_axis = nn.Buffer(mrope_axis_of_frequency(self.cfg.head_dim, sections), persistent=False)
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
        mm_rows: torch.Tensor | None = None,
        mm_embeds: torch.Tensor | None = None,
        deepstack_rows: torch.Tensor | None = None,
        deepstack: torch.Tensor | None = None,
        rope_freqs: torch.Tensor | None = None,
    ) -> ThinkerOutput:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        embeds = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        if mm_rows is not None and mm_rows.numel():
            embeds = embeds.index_copy(0, mm_rows, mm_embeds.to(embeds.dtype))
        layers = self.model.layers
        if len(kv_caches) != len(layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(layers)} layers")
        if positions.shape[0] != embeds.shape[0]:
            raise ValueError(f"positions has {positions.shape[0]} rows, embeddings have {embeds.shape[0]}")
        if positions.dim() == 2:
            cos, sin = mrope_cos_sin(positions, self.model.rotary, self.mrope_axis, embeds.dtype, rope_freqs)
        else:
            cos, sin = self.model.rotary(positions, embeds.dtype, rope_freqs)
        num_deepstack = 0 if deepstack_rows is None or not deepstack_rows.numel() else deepstack.shape[0]
        if not num_deepstack:
            h, accept = self.model.run_layers(embeds, positions, kv_caches, attn_meta, self.accept_hidden_layer,
                                              rope=(cos, sin))
            return ThinkerOutput(hidden=h, embeds=embeds, accept_hidden=accept)
        h = embeds
        accept = h if self.accept_hidden_layer == 0 else None
        for i, layer in enumerate(layers):
            h = layer(h, cos, sin, self.model.attend(kv_caches[i], attn_meta))
            if i + 1 == self.accept_hidden_layer:
                accept = h  # the layer's output before deepstack, as transformers records hidden states
            if i < num_deepstack:
                # Deepstack feature i joins the visual rows after layer i.
                h = h.index_add(0, deepstack_rows, deepstack[i].to(h.dtype))
        h = self.model.norm(h)
        if self.accept_hidden_layer == len(layers):
            accept = h  # transformers reports the final-normed output last
        return ThinkerOutput(hidden=h, embeds=embeds, accept_hidden=accept)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def pack_weights(self, batch_hint: int) -> int:
        """The ``fast`` option's part here: the output head on AMX tiles (``pack_output_head``), a float32 model's
        bfloat16-valued embedding kept in bfloat16 (``pack_embedding``); the other layers are packed after this
        call."""
        return (pack_output_head(self.lm_head, self.model.embed_tokens)
                + pack_embedding(self.model.embed_tokens, self.lm_head))
