"""Qwen2.5-Omni Talker: a dense Qwen2.5 decoder that emits one codec token per step.

Names follow the checkpoint with ``talker.`` stripped: ``model.embed_tokens`` (the codec embedding, in the
*Thinker's* width ``embedding_size``), ``thinker_to_talker_proj`` (Thinker width -> Talker width, with bias),
``model.layers.N.*``, ``model.norm``, ``codec_head``.

Every input row is built in the Thinker's width (Thinker rows + codec embeddings, see ``talker_inputs``) and
projected once by ``thinker_to_talker_proj`` before the decoder, exactly as transformers does.

Sampling rules transformers' ``generate`` applies to the Talker (``Qwen2_5OmniForConditionalGeneration``):
``suppress_tokens=[codec_bos]`` (applied here, in ``compute_logits``); EOS = ``talker_eos_token_id``, by default
``[codec_pad, codec_eos]`` (both stop; neither is spoken); repetition penalty 1.05 over the whole sequence
*including* the prompt ids (``codec_mask`` x prompt, ``codec_pad``, ``codec_bos``); top-k 40, top-p 0.8,
temperature 0.9; no minimum length; at most 4096 new tokens. The stage model carries these as defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from omnistage.attention.backend import AttentionMetadata
from omnistage.models.qwen2_5_omni.decoder import (
    Qwen2PagedDecoder,
    decoder_config,
    sectioned_axis_of_frequency,
)


@dataclass(frozen=True)
class TalkerTokenIds:
    """Codec ids (Talker vocabulary) and text-side ids (Thinker embedding rows) the Talker's inputs use."""

    codec_pad: int
    codec_bos: int
    codec_eos: int
    codec_mask: int
    text_pad: int
    text_bos: int
    text_eos: int

    def __post_init__(self) -> None:
        codec = (self.codec_pad, self.codec_bos, self.codec_eos, self.codec_mask)
        if len(set(codec)) != len(codec):
            raise ValueError(f"codec pad/bos/eos/mask ids must differ: {codec}")

    @property
    def eos_ids(self) -> tuple[int, int]:
        """The ids that end a Talker request (generate's default ``talker_eos_token_id``)."""
        return (self.codec_pad, self.codec_eos)

    @classmethod
    def from_config(cls, config: Any) -> TalkerTokenIds:
        t = config.talker_config
        return cls(
            codec_pad=t.tts_codec_pad_token_id,
            codec_bos=t.tts_codec_start_token_id,
            codec_eos=t.tts_codec_end_token_id,
            codec_mask=t.tts_codec_mask_token_id,
            text_pad=t.tts_text_pad_token_id,
            text_bos=t.tts_text_start_token_id,
            text_eos=t.tts_text_end_token_id,
        )


class Talker(nn.Module):
    """Built from the full Qwen2_5OmniConfig (reads ``talker_config``)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        tcfg = config.talker_config
        self.cfg = decoder_config(tcfg)
        self.vocab_size = int(tcfg.vocab_size)
        self.embedding_size = int(tcfg.embedding_size)
        self.ids = TalkerTokenIds.from_config(config)
        for name, value in (("codec_bos", self.ids.codec_bos), ("codec_pad", self.ids.codec_pad),
                            ("codec_eos", self.ids.codec_eos), ("codec_mask", self.ids.codec_mask)):
            if not 0 <= value < self.vocab_size:
                raise ValueError(f"talker {name} id {value} outside the codec vocabulary [0, {self.vocab_size})")
        self.model = Qwen2PagedDecoder(self.cfg, self.vocab_size, self.embedding_size)
        self.mrope_axis = nn.Buffer(sectioned_axis_of_frequency(tcfg, self.cfg.head_dim), persistent=False)
        self.thinker_to_talker_proj = nn.Linear(self.embedding_size, self.cfg.hidden_size, bias=True)
        self.codec_head = nn.Linear(self.cfg.hidden_size, self.vocab_size, bias=False)
        if getattr(tcfg, "tie_word_embeddings", False):
            raise ValueError("a tied codec head is not supported (embedding and head widths differ)")

    def embed_codec(self, ids: torch.Tensor) -> torch.Tensor:
        """Codec ids -> [..., embedding_size] rows in the Thinker's width."""
        return self.model.embed_tokens(ids)

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_meta: AttentionMetadata,
        rope_freqs: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """inputs_embeds: [N, embedding_size] rows in the Thinker's width -> final-normed [N, H]; positions [N] or
        [N, 3] (the prefill of an image/video prompt); ``rope_freqs`` each row's rotary frequencies."""
        return self.model(self.thinker_to_talker_proj(inputs_embeds), positions, kv_caches, attn_meta, self.mrope_axis,
                          rope_freqs)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[M, H] -> [M, vocab]; codec_bos is -inf (generate's ``suppress_tokens``)."""
        logits = self.codec_head(hidden)
        logits[:, self.ids.codec_bos] = float("-inf")
        return logits
