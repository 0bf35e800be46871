"""Qwen3-Omni Talker: a Qwen3-MoE decoder (every layer MoE + sigmoid-gated shared expert) over codec rows.

Names follow the checkpoint with ``talker.`` stripped: ``model.codec_embedding``, ``model.layers.N.*``,
``model.norm``, ``codec_head``, ``text_projection``, ``hidden_projection`` and ``code_predictor.*``.

Positions: ``[N]`` (equal ids on the three MRoPE axes: text-only prompts, where row i of the talker sequence
sits at i, and decode rows at ``index + rope delta``) or ``[N, 3]`` (T, H, W) for prefill rows of a prompt with
images or videos (``talker_inputs.talker_positions``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from omnistage.attention.backend import AttentionMetadata
from omnistage.models.layers.decoder import DecoderConfig, PagedDecoder
from omnistage.models.layers.mlp import ResizeMLP
from omnistage.models.qwen3_omni.code_predictor import CodePredictor, SampleFn
from omnistage.models.qwen3_omni.mrope import MRopeRotary, mrope_sections

# generate() keeps the top this-many codec ids for control tokens and never lets the talker sample them.
NUM_RESERVED_CODEC_IDS = 1024


class TalkerTextModel(PagedDecoder):
    def __init__(self, cfg: DecoderConfig, vocab_size: int) -> None:
        super().__init__(cfg)
        self.codec_embedding = nn.Embedding(vocab_size, cfg.hidden_size)


class Talker(nn.Module):
    """Built from the full Qwen3OmniMoeConfig (reads ``talker_config``)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        tcfg = config.talker_config
        text_cfg = tcfg.text_config
        # transformers' talker layer always installs the shared-expert MoE, whatever mlp_only_layers says.
        self.cfg = DecoderConfig.from_hf(text_cfg, all_sparse=True, shared_expert=True)
        if self.cfg.shared_expert_intermediate_size <= 0:
            raise ValueError("talker text_config.shared_expert_intermediate_size must be positive")
        self.vocab_size = text_cfg.vocab_size
        self.codec_eos_id = int(tcfg.codec_eos_token_id)
        if self.vocab_size <= NUM_RESERVED_CODEC_IDS or not 0 <= self.codec_eos_id < self.vocab_size:
            raise ValueError(
                f"talker vocab {self.vocab_size} must exceed {NUM_RESERVED_CODEC_IDS} and hold codec_eos "
                f"{self.codec_eos_id}"
            )
        cp_cfg = tcfg.code_predictor_config
        if cp_cfg.hidden_size != self.cfg.hidden_size:
            raise ValueError("code predictor hidden_size must equal the talker hidden_size")
        if cp_cfg.num_code_groups != tcfg.num_code_groups:
            raise ValueError("talker and code predictor disagree on num_code_groups")
        self.num_code_groups = int(tcfg.num_code_groups)

        self.model = TalkerTextModel(self.cfg, self.vocab_size)
        sections = mrope_sections(text_cfg, self.cfg.head_dim)
        self.model.rotary = MRopeRotary(self.cfg.head_dim, self.cfg.rope_theta, sections, self.cfg.rope_inv_freq,
                                        self.cfg.rope_scale, self.cfg.rope_length)
        # The Talker's own 3-D positions over its prompt read these (transformers: its talker config's values).
        self.spatial_merge_size = int(tcfg.spatial_merge_size)
        self.position_id_per_seconds = float(tcfg.position_id_per_seconds)
        self.codec_head = nn.Linear(self.cfg.hidden_size, self.vocab_size, bias=False)
        if getattr(tcfg, "tie_word_embeddings", False):
            self.codec_head.weight = self.model.codec_embedding.weight
        thinker_hidden = int(tcfg.thinker_hidden_size)
        act = self.cfg.hidden_act
        self.text_projection = ResizeMLP(thinker_hidden, text_cfg.intermediate_size, self.cfg.hidden_size, act)
        self.hidden_projection = ResizeMLP(thinker_hidden, text_cfg.intermediate_size, self.cfg.hidden_size, act)
        self.code_predictor = CodePredictor(cp_cfg)

        suppressed = torch.zeros(self.vocab_size, dtype=torch.bool)
        suppressed[self.vocab_size - NUM_RESERVED_CODEC_IDS :] = True
        suppressed[self.codec_eos_id] = False
        self.suppressed = nn.Buffer(suppressed, persistent=False)

    def embed_codec(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.codec_embedding(ids)

    def project_text(self, thinker_embeds: torch.Tensor) -> torch.Tensor:
        """Thinker layer-0 embeddings [..., H_thinker] -> talker rows [..., H]."""
        return self.text_projection(thinker_embeds)

    def project_hidden(self, thinker_hidden: torch.Tensor) -> torch.Tensor:
        """Thinker accept-layer hidden rows (multimodal positions) -> talker rows."""
        return self.hidden_projection(thinker_hidden)

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_meta: AttentionMetadata,
        rope_freqs: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden, _ = self.model.run_layers(inputs_embeds, positions, kv_caches, attn_meta, rope_freqs=rope_freqs)
        return hidden

    def forward_with_logits(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_meta: AttentionMetadata,
        rope_freqs: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``forward``, and every row's ``compute_logits`` (the same bits) where a decode step's layers and the codec
        head run in one kernel call (the ``fast`` option on CPU, the head on panels); else None."""
        panels = getattr(self.codec_head, "panels", None)  # (None for a head on AMX or oneDNN, or unpacked)
        if panels is None:
            return self.forward(inputs_embeds, positions, kv_caches, attn_meta, rope_freqs), None
        hidden, logits = self.model.run_layers_with_head(inputs_embeds, positions, kv_caches, attn_meta,
                                                         (panels, self.vocab_size), rope_freqs)
        return hidden, None if logits is None else logits.masked_fill_(self.suppressed, float("-inf"))

    def compute_logits(self, hidden: torch.Tensor, suppress: bool = True) -> torch.Tensor:
        """[M, H] -> [M, vocab]; the reserved top ids except codec_eos are -inf (as generate's suppress_tokens)."""
        logits = self.codec_head(hidden)
        if suppress:
            logits = logits.masked_fill(self.suppressed, float("-inf"))
        return logits

    def predict_codes(
        self, talker_hidden: torch.Tensor, code0: torch.Tensor, sample: SampleFn
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Complete the frames of B requests, ``sample`` picking each residual group: (codes [B, Q] with code0
        first, embed_sum [B, H])."""
        return self.code_predictor.predict(talker_hidden, code0, self.embed_codec(code0), sample)

    def complete_frames(
        self, talker_hidden: torch.Tensor, code0: torch.Tensor, generators: Sequence[torch.Generator | None]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Serving path of ``predict_codes``: row i greedy (``generators[i]`` None) or sampled with transformers'
        residual settings from its own generator; the whole frame runs as one compiled graph when enabled."""
        return self.code_predictor.complete_frames(talker_hidden, code0, self.embed_codec(code0), generators)
