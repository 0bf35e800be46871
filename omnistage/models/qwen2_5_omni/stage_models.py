"""Qwen2.5-Omni's three parts as stage models (``omnistage.runner.outputs.ARStageModel`` and
``GenerationStageModel``).

- ``ThinkerStageModel``: token ids and media in (Qwen3-Omni's media scheduling, shared), hidden states out; for
  requests that speak (``speech`` in their state, from ``StageRequest.data``) it sends the Talker every row it
  processed this step: embedding + final hidden (final hidden alone for media placeholder rows), with their
  positions (a recompute after preemption sends rows again; the bridge keeps the first copy).
- ``TalkerStageModel``: per-request state (written by the Thinker -> Talker bridge): ``prompt_rows`` [P, E],
  ``answer_rows`` (tuple of [E]), ``text_done``; ``voice`` from ``StageRequest.data``; it caches
  ``prefill_embeds`` itself. Prefill rows come from that state; a decode row is the codec embedding of its input
  id (the code sampled the step before) plus its text row, so a recompute after preemption needs nothing stored.
  ``input_ready`` pauses a request whose next text row has not arrived. Rows sit at plain positions, except the
  prefill of an image/video prompt: the Talker's own TMRoPE ids (``TALKER_POSITIONS_KEY``), decode at
  ``index + rope_delta``. The codes it samples go downstream and
  to the client (its EOS ids dropped): the code sampled at step t is spoken, none lags behind.
- ``Token2WavStageModel``: one batched call over Token2Wav windows (see ``token2wav`` / ``streaming``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

from omnistage.attention.backend import AttentionMetadata
from omnistage.core.request import Request
from omnistage.models.qwen2_5_omni.talker import Talker
from omnistage.models.qwen2_5_omni.talker_inputs import (
    TextSpecials,
    build_prefill,
    text_row_ready,
    text_rows_for_steps,
    text_specials,
)
from omnistage.models.qwen2_5_omni.thinker import Thinker
from omnistage.models.qwen2_5_omni.token2wav import Token2Wav, Token2WavWindow
from omnistage.models.qwen2_5_omni.voices import Speaker
from omnistage.models.qwen3_omni.mrope import step_positions, step_rope_freqs
from omnistage.models.qwen3_omni.stage_models import ThinkerStageModel as MediaThinkerStageModel
from omnistage.runner.outputs import OmniOutput, StepContext

SPEECH_KEY = "speech"  # Thinker request state: this request feeds a Talker
MEDIA_ROWS_KEY = "talker_media_rows"  # Thinker request state: [P] bool, the prompt's media placeholder rows
TALKER_POSITIONS_KEY = "prefill_positions"  # Talker request state: its prompt's 3-D ids (image/video prompts)
SAMPLE_RATE = 24000  # Qwen2.5-Omni's BigVGAN: 100 mel frames per second, hop 240


def _dims(model: Thinker | Talker) -> tuple[int, int, int]:
    return model.cfg.num_layers, model.cfg.num_kv_heads, model.cfg.head_dim


class ThinkerStageModel(MediaThinkerStageModel):
    """Token ids and a request's media in, hidden states out.

    Media scheduling is Qwen3-Omni's (inherited ``prepare_inputs``: encoders run for the media rows a prefill
    chunk reaches, batched across the step's requests through the shared encoder cache, outputs released once
    a prompt is prefilled or its request freed; 3-D positions from the request's table, decode rows at
    ``index + rope_delta``); this family supplies its Thinker and towers.
    """

    # Its only aux output is row-aligned (``embeds`` [N, H]): safe to rebuild after a graph replay.
    supports_full_graph_aux_outputs = True

    def cache_hit_limit(self, state: Mapping[str, Any], request: Request) -> int | None:
        """A request that speaks hands the Talker the embedding + final hidden row of every prompt position, and a
        final hidden row only a forward pass gives: it prefills its whole prompt (no prefix-cache hit). A text
        answer may take the Thinker's cached blocks (keyed as Qwen3-Omni's: token ids, media, 3-D positions)."""
        return 0 if state.get(SPEECH_KEY) else None

    def forward(self, kv_caches, attn_meta: AttentionMetadata, input_ids, positions, **media) -> OmniOutput:
        with torch.inference_mode():
            out = self.thinker(input_ids, positions, kv_caches, attn_meta, **media)
        return OmniOutput(hidden_states=out.hidden, multimodal_outputs={"embeds": out.embeds})

    def postprocess(self, ctx: StepContext, output: OmniOutput, sampled: dict[str, int]):
        return [None] * len(ctx.req_ids)

    def stage_outputs(
        self, ctx: StepContext, output: OmniOutput, sampled: dict[str, int]
    ) -> dict[str, dict[str, Any]]:
        """{req_id: {"positions": [k] (host), "rows": [k, E]}} for speech requests: every row of their span,
        embedding + final hidden; a media placeholder row (``MEDIA_ROWS_KEY`` of its state) gives its final hidden
        alone, as transformers zeroes those embeddings before handing them to the Talker.

        Rows are picked with one gather (the row indices are host data) and owned by the payload.
        """
        picks, owners, hidden_only = [], [], []
        for req_id, start, state in zip(ctx.req_ids, ctx.num_computed, ctx.states):
            if not state.get(SPEECH_KEY):
                continue
            s, e = ctx.spans[req_id]
            pos = torch.arange(start, start + e - s)
            media_rows = state.get(MEDIA_ROWS_KEY)
            if media_rows is not None:
                in_prompt = pos < media_rows.shape[0]
                mine = torch.zeros_like(in_prompt)
                mine[in_prompt] = media_rows[pos[in_prompt]]
                hidden_only.append(mine)
            else:
                hidden_only.append(torch.zeros(e - s, dtype=torch.bool))
            picks.append(torch.arange(s, e))
            owners.append((req_id, pos))
        if not picks:
            return {}
        hidden = output.hidden_states
        index = torch.cat(picks).to(hidden.device)
        embeds = output.multimodal_outputs["embeds"][index]
        drop = torch.cat(hidden_only)
        if drop.any():
            embeds[drop.to(embeds.device)] = 0  # index-select made a copy: the step's buffer is untouched
        rows = embeds + hidden[index]
        out, start = {}, 0
        for req_id, pos in owners:
            out[req_id] = {"positions": pos, "rows": rows[start : start + pos.numel()]}
            start += pos.numel()
        return out


class TalkerStageModel:
    # transformers' penalty sees the Talker's prompt ids (codec_mask x P, codec_pad, codec_bos) too.
    penalty_includes_prompt = True
    # The sampled ids are codec codes, not text: clients get them as "codes" [1, k] instead.
    emits_token_ids = False

    def __init__(self, talker: Talker, specials: TextSpecials, speaker_bos_embeds: Mapping[str, torch.Tensor]) -> None:
        """``specials``: Thinker embeddings of tts_text_end / tts_text_pad; ``speaker_bos_embeds``: the Thinker
        embedding of each voice's bos token (see ``for_speakers``)."""
        self.talker = talker
        self.ids = talker.ids
        self.specials = specials
        self.speaker_bos_embeds = dict(speaker_bos_embeds)
        self.num_layers, self.num_kv_heads, self.head_dim = _dims(talker)
        self.embedding_size = talker.embedding_size
        self.eos_ids = frozenset(talker.ids.eos_ids)

    @classmethod
    def for_speakers(
        cls, talker: Talker, thinker_embed_tokens: torch.nn.Module, speakers: Mapping[str, Speaker]
    ) -> TalkerStageModel:
        """Take the few Thinker embedding rows the Talker reads (text specials, speaker bos rows)."""
        device = thinker_embed_tokens.weight.device
        with torch.inference_mode():
            specials = text_specials(thinker_embed_tokens, talker.ids)
            bos = {name: thinker_embed_tokens(torch.tensor(s.bos_token, device=device)) for name, s in speakers.items()}
        return cls(talker, specials, bos)

    def input_ready(self, state: Mapping[str, Any], request: Request) -> bool:
        """Whether the request's next step has its text row (decode step ``num_output_tokens - 1`` needs answer
        row ``num_output_tokens``, or the Thinker's end); False pauses it until the bridge delivers more."""
        n = request.num_output_tokens
        if n == 0:
            return True  # the prefill carries its own rows
        return text_row_ready(n - 1, len(state.get("answer_rows", ())), bool(state.get("text_done")))

    def _prefill(self, req_id: str, state: Mapping[str, Any]) -> torch.Tensor:
        cached = state.get("prefill_embeds")
        if cached is not None:
            return cached
        if state.get("prompt_rows") is None or not state.get("answer_rows"):
            raise RuntimeError(f"talker request {req_id!r} scheduled before its Thinker rows arrived")
        with torch.inference_mode():
            return build_prefill(
                self.talker, state["prompt_rows"], self.speaker_bos_embeds[state["voice"]], state["answer_rows"][0]
            )

    def prepare_inputs(self, ctx: StepContext, input_ids: torch.Tensor, positions: torch.Tensor):
        embeds = torch.zeros(input_ids.shape[0], self.embedding_size, dtype=self.specials.pad.dtype,
                             device=input_ids.device)
        updates: list[dict[str, Any] | None] = [None] * len(ctx.req_ids)
        decode_rows: list[int] = []
        decode_steps: list[int] = []
        owners: list[int] = []
        num_prefill: list[int] = []
        for i, req_id in enumerate(ctx.req_ids):
            st = ctx.states[i]
            prefill = self._prefill(req_id, st)
            num_prefill.append(prefill.shape[0])
            if st.get("prefill_embeds") is None:
                updates[i] = {"prefill_embeds": prefill, "prompt_rows": None}  # the rows live on in the prefill
            s, e = ctx.spans[req_id]
            lo = ctx.num_computed[i]  # this span's first position (host data: no sync)
            n = prefill.shape[0]
            a, b = lo, min(lo + e - s, n)
            if a < b:
                embeds[s : s + b - a] = prefill[a:b]
            for pos in range(max(lo, n), lo + e - s):  # decode rows (several only when recomputing)
                decode_rows.append(s + pos - lo)
                decode_steps.append(pos - n)
                owners.append(i)
        if decode_rows:
            rows = torch.tensor(decode_rows, device=input_ids.device)
            text = text_rows_for_steps(
                torch.tensor(decode_steps),
                [ctx.states[i]["answer_rows"] for i in owners],
                [bool(ctx.states[i].get("text_done")) for i in owners],
                self.specials,
            )
            with torch.inference_mode():
                embeds[rows] = self.talker.embed_codec(input_ids[rows]) + text.to(embeds.dtype)
        prompts = [st.get(TALKER_POSITIONS_KEY) for st in ctx.states]
        spans = [ctx.spans[r] for r in ctx.req_ids]
        positions = step_positions(positions, ctx.num_computed, spans, prompts)
        kwargs = {"inputs_embeds": embeds, "positions": positions}
        kwargs.update(step_rope_freqs(self.talker.model.rotary, positions, ctx.num_computed, spans, prompts,
                                      num_prefill))
        return kwargs, updates

    def forward(self, kv_caches, attn_meta: AttentionMetadata, inputs_embeds, positions,
                rope_freqs: torch.Tensor | None = None) -> OmniOutput:
        with torch.inference_mode():
            hidden = self.talker(inputs_embeds, positions, kv_caches, attn_meta, rope_freqs)
        return OmniOutput(hidden_states=hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self.talker.compute_logits(hidden)

    def _spoken(self, sampled: Mapping[str, int]) -> dict[str, int]:
        """This step's codes per request; an EOS id (codec_pad / codec_eos) ends the speech and is not a code."""
        return {r: c for r, c in sampled.items() if c not in self.eos_ids}

    def postprocess(self, ctx: StepContext, output: OmniOutput, sampled: dict[str, int]):
        return [None] * len(ctx.req_ids)

    def stage_outputs(
        self, ctx: StepContext, output: OmniOutput, sampled: dict[str, int]
    ) -> dict[str, dict[str, Any]]:
        """{req_id: {"codes": [1] host LongTensor}}: the code each request sampled this step."""
        return {r: {"codes": torch.tensor([c])} for r, c in self._spoken(sampled).items()}

    def client_outputs(self, ctx: StepContext, output: OmniOutput, sampled: dict[str, int]) -> dict[str, dict]:
        return {r: {"codes": torch.tensor([[c]])} for r, c in self._spoken(sampled).items()}


class Token2WavStageModel:
    def __init__(self, token2wav: Token2Wav) -> None:
        self.token2wav = token2wav

    def forward_batch(self, payloads: list[Token2WavWindow], states: list[Mapping[str, Any]]):
        """``audio`` [B, S] (row b = payloads[b]'s kept samples, zero-padded), ``audio_lengths`` [B]; the stage
        keeps no per-request state (a window carries everything its audio depends on)."""
        with torch.inference_mode():
            waves = self.token2wav.decode_windows(payloads)
        lengths = torch.tensor([w.numel() for w in waves])
        return {"audio": pad_sequence(waves, batch_first=True), "audio_lengths": lengths}, [None] * len(payloads)
