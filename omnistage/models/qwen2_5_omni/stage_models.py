"""Qwen2.5-Omni's three parts as stage models (``omnistage.runner.outputs.ARStageModel`` and the generation
stage's ``forward_batch``).

- ``ThinkerStageModel``: token ids in, hidden states out; for requests that want speech (``req.extra["speech"]``)
  it sends the Talker the rows it processed this step: embedding + final hidden, with their positions.
- ``TalkerStageModel``: per request state (set through ``Thinker2TalkerBridge`` updates): ``prompt_rows``
  [P, E], ``answer_rows`` (tuple of [E]), ``voice``, ``text_done``; it caches ``prefill_embeds`` itself. Prefill
  rows come from that state; a decode row is the codec embedding of its input id (the code sampled the step
  before) plus its text row, so a recompute after preemption needs nothing stored. Codes go downstream as the
  request's sampled tokens (no stage output of its own): the code sampled at step t is spoken, none lags.
- ``Token2WavStageModel``: one batched call over Token2Wav windows (see ``token2wav`` / ``streaming``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from omnistage.attention.backend import AttentionMetadata
from omnistage.core.sampling_params import SamplingParams
from omnistage.models.qwen2_5_omni.talker import Talker
from omnistage.models.qwen2_5_omni.talker_inputs import (
    TextSpecials,
    build_prefill,
    text_row_ready,
    text_rows_for_steps,
)
from omnistage.models.qwen2_5_omni.thinker import Thinker
from omnistage.models.qwen2_5_omni.token2wav import Token2Wav, Token2WavWindow
from omnistage.models.qwen2_5_omni.voices import Speaker
from omnistage.runner.outputs import OmniOutput, StepContext

SPEECH_KEY = "speech"  # Request.extra flag: this Thinker request feeds a Talker
SAMPLE_RATE = 24000  # Qwen2.5-Omni's BigVGAN: 100 mel frames per second, hop 240

# transformers' Talker sampling defaults (Qwen2_5OmniForConditionalGeneration.generate).
TALKER_DEFAULT_SAMPLING = SamplingParams(
    temperature=0.9, top_k=40, top_p=0.8, repetition_penalty=1.05, max_tokens=4096
)


def _dims(model: Thinker | Talker) -> tuple[int, int, int]:
    return model.cfg.num_layers, model.cfg.num_kv_heads, model.cfg.head_dim


class ThinkerStageModel:
    # Its only aux output is row-aligned (``embeds`` [N, H]): safe to rebuild after a graph replay.
    supports_full_graph_aux_outputs = True

    def __init__(self, thinker: Thinker) -> None:
        self.thinker = thinker
        self.num_layers, self.num_kv_heads, self.head_dim = _dims(thinker)

    def prepare_inputs(self, ctx: StepContext, input_ids: torch.Tensor, positions: torch.Tensor):
        return {"input_ids": input_ids, "positions": positions}, [None] * len(ctx.req_ids)

    def forward(self, kv_caches, attn_meta: AttentionMetadata, input_ids, positions) -> OmniOutput:
        with torch.inference_mode():
            out = self.thinker(input_ids, positions, kv_caches, attn_meta)
        return OmniOutput(text_hidden_states=out.hidden, multimodal_outputs={"embeds": out.embeds})

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self.thinker.compute_logits(hidden)

    def postprocess(self, ctx: StepContext, output: OmniOutput, sampled: dict[str, int]):
        return [None] * len(ctx.req_ids)

    def stage_outputs(self, ctx: StepContext, output: OmniOutput) -> dict[str, dict[str, Any]]:
        """{req_id: {"positions": [k] (host), "rows": [k, E]}} for speech requests: every row of their span.

        Rows are picked with one gather (the row indices are host data) and owned by the payload.
        """
        picks, owners = [], []
        for req in ctx.requests:
            if not req.extra.get(SPEECH_KEY):
                continue
            s, e = ctx.spans[req.req_id]
            picks.append(torch.arange(s, e))
            owners.append((req.req_id, torch.arange(req.num_computed_tokens, req.num_computed_tokens + e - s)))
        if not picks:
            return {}
        hidden = output.text_hidden_states
        index = torch.cat(picks).to(hidden.device)
        rows = output.multimodal_outputs["embeds"][index] + hidden[index]
        out, start = {}, 0
        for req_id, pos in owners:
            out[req_id] = {"positions": pos, "rows": rows[start : start + pos.numel()]}
            start += pos.numel()
        return out


class TalkerStageModel:
    # transformers' penalty sees the Talker's prompt ids (codec_mask x P, codec_pad, codec_bos) too.
    penalty_includes_prompt = True

    def __init__(self, talker: Talker, specials: TextSpecials, speaker_bos_embeds: Mapping[str, torch.Tensor]) -> None:
        """``specials``: Thinker embeddings of tts_text_end / tts_text_pad; ``speaker_bos_embeds``: the Thinker
        embedding of each voice's bos token (see ``for_speakers``)."""
        self.talker = talker
        self.specials = specials
        self.speaker_bos_embeds = dict(speaker_bos_embeds)
        self.num_layers, self.num_kv_heads, self.head_dim = _dims(talker)
        self.embedding_size = talker.embedding_size
        self.eos_ids = talker.ids.eos_ids

    @classmethod
    def for_speakers(
        cls, talker: Talker, thinker_embed_tokens: torch.nn.Module, speakers: Mapping[str, Speaker]
    ) -> TalkerStageModel:
        """Take the few Thinker embedding rows the Talker reads (text specials, speaker bos rows)."""
        from omnistage.models.qwen2_5_omni.talker_inputs import text_specials

        device = thinker_embed_tokens.weight.device
        with torch.inference_mode():
            specials = text_specials(thinker_embed_tokens, talker.ids)
            bos = {name: thinker_embed_tokens(torch.tensor(s.bos_token, device=device)) for name, s in speakers.items()}
        return cls(talker, specials, bos)

    def text_ready(self, state: Mapping[str, Any], num_output_tokens: int) -> bool:
        """Whether a request with ``num_output_tokens`` sampled codes has the text row of its next step (decode
        step ``num_output_tokens - 1``); a request that is not ready must wait for the Thinker."""
        if num_output_tokens == 0:
            return True  # the prefill carries its own rows
        return text_row_ready(num_output_tokens - 1, len(state.get("answer_rows", ())), bool(state.get("text_done")))

    def _prefill(self, req_id: str, state: Mapping[str, Any]) -> torch.Tensor:
        cached = state.get("prefill_embeds")
        if cached is not None:
            return cached
        if "prompt_rows" not in state or not state.get("answer_rows"):
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
        for i, req_id in enumerate(ctx.req_ids):
            st = ctx.states[i]
            prefill = self._prefill(req_id, st)
            if "prefill_embeds" not in st:
                updates[i] = {"prefill_embeds": prefill}
            s, e = ctx.spans[req_id]
            lo = ctx.requests[i].num_computed_tokens  # this span's first position (host data: no sync)
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
        return {"inputs_embeds": embeds, "positions": positions}, updates

    def forward(self, kv_caches, attn_meta: AttentionMetadata, inputs_embeds, positions) -> OmniOutput:
        with torch.inference_mode():
            hidden = self.talker(inputs_embeds, positions, kv_caches, attn_meta)
        return OmniOutput(text_hidden_states=hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self.talker.compute_logits(hidden)

    def postprocess(self, ctx: StepContext, output: OmniOutput, sampled: dict[str, int]):
        return [None] * len(ctx.req_ids)

    def stage_outputs(self, ctx: StepContext, output: OmniOutput) -> dict[str, dict[str, Any]]:
        return {}  # codes travel as sampled tokens (Talker2Token2WavBridge.on_talker_tokens)


class Token2WavStageModel:
    sample_rate = SAMPLE_RATE

    def __init__(self, token2wav: Token2Wav) -> None:
        self.token2wav = token2wav

    def forward_batch(self, payloads: list[Token2WavWindow]) -> OmniOutput:
        """``audio`` [B, S] (row b = payloads[b]'s kept samples, zero-padded), ``audio_lengths`` [B]."""
        with torch.inference_mode():
            waves = self.token2wav.decode_windows(payloads)
        lengths = torch.tensor([w.numel() for w in waves])
        audio = waves[0].new_zeros(len(waves), int(lengths.max()))
        for b, w in enumerate(waves):
            audio[b, : w.numel()] = w
        return OmniOutput(text_hidden_states=None, multimodal_outputs={"audio": audio, "audio_lengths": lengths})
