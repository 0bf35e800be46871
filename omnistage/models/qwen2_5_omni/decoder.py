"""The Qwen2.5 dense decoder (Thinker and Talker) over flattened token rows and a paged KV cache.

It is the shared decoder (``layers/decoder.py``) with Qwen2's attention options: q/k/v biases, an unbiased
output projection and no per-head q/k norm.
Positions are ``[N]`` (all three TMRoPE axes equal: plain RoPE) or ``[N, 3]`` (T, H, W) ids, whose rotary
frequencies are split into three contiguous sections (``mrope_section``; Qwen3-Omni interleaves them instead).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from omnistage.attention.backend import AttentionMetadata
from omnistage.models.layers.decoder import DecoderConfig, PagedDecoder
from omnistage.models.qwen3_omni.mrope import mrope_cos_sin


def decoder_config(cfg: Any) -> DecoderConfig:
    """A Qwen2.5-Omni text/talker config as a dense DecoderConfig (always biased q/k/v; with
    ``use_sliding_window`` its layers from ``max_window_layers`` on attend within ``sliding_window``)."""
    base = DecoderConfig.from_hf(cfg, sliding=True)
    if base.sparse_layers:
        raise ValueError("Qwen2.5-Omni decoders are dense")
    return dataclasses.replace(base, qkv_bias=True, o_bias=False, qk_norm=False)


def sectioned_axis_of_frequency(text_config: Any, head_dim: int) -> torch.Tensor:
    """[head_dim / 2] axis (0 = T, 1 = H, 2 = W) of each rotary frequency: contiguous sections, T first (the
    config's ``mrope_section``, else Qwen2.5-Omni's [16, 24, 24] for head_dim 128)."""
    sections = list((getattr(text_config, "rope_parameters", None) or {}).get("mrope_section") or ())
    if not sections:
        if head_dim != 128:
            raise ValueError(f"the text config has no mrope_section and head_dim {head_dim} != 128")
        sections = [16, 24, 24]
    if len(sections) != 3 or sum(sections) != head_dim // 2:
        raise ValueError(f"mrope_section {sections} must have 3 entries summing to head_dim / 2 = {head_dim // 2}")
    return torch.repeat_interleave(torch.arange(3), torch.tensor(sections))


class Qwen2PagedDecoder(PagedDecoder):
    """``embed_tokens`` + the shared ``layers`` and final ``norm`` (checkpoint names), one paged KV cache per
    layer."""

    def __init__(self, cfg: DecoderConfig, vocab_size: int, embedding_size: int | None = None) -> None:
        super().__init__(cfg)
        self.embed_tokens = nn.Embedding(vocab_size, embedding_size or cfg.hidden_size)

    def forward(
        self, h: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], attn_meta: AttentionMetadata,
        mrope_axis: torch.Tensor | None = None, rope_freqs: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """h: [N, H] layer-0 input rows -> final-normed [N, H]; ``mrope_axis`` (``sectioned_axis_of_frequency``)
        for ``[N, 3]`` positions; ``rope_freqs`` each row's frequencies (``RotaryEmbedding.row_frequencies``)."""
        rope = None
        if positions.dim() == 2:
            if mrope_axis is None:
                raise ValueError("3-D positions need the mrope axis of each frequency")
            rope = mrope_cos_sin(positions, self.rotary, mrope_axis, h.dtype, rope_freqs)
        return self.run_layers(h, positions, kv_caches, attn_meta, rope=rope, rope_freqs=rope_freqs)[0]
