"""Qwen3-Omni's three parts as stage models: what the runners call around each forward.

- ``ThinkerStageModel``: token ids (and a request's media) in; hidden states for sampling out; runs the audio
  and vision encoders for the media rows a prefill chunk reaches and gives every row its 3-D position; sends
  the Talker only the rows it uses (embeddings of user-turn text rows, of the assistant header and of fed-back
  answer tokens; accept-layer hidden states of user-turn media rows).
- ``TalkerStageModel``: builds each row's input from the request's intermediate state (prefill rows,
  decode rows = code-predictor frame embedding + text row) and its position (the Talker prompt's own 3-D ids
  for prefill rows of image/video prompts, ``index + delta`` after), runs the code predictor batched over
  every request that decodes this step, keeps the last hidden state for the next step, emits complete frames.
- ``Code2WavStageModel``: streaming decode of every request's new frames, batched, state per request.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from omnistage.attention.backend import AttentionMetadata
from omnistage.core.request import Request
from omnistage.models.qwen3_omni.code2wav import Code2Wav
from omnistage.models.qwen3_omni.code2wav_stream import Code2WavStreamer, Code2WavStreamState
from omnistage.models.qwen3_omni.encoder_cache import MediaEncoders, item_span
from omnistage.models.qwen3_omni.mrope import (
    MediaSpan,
    PromptPositions,
    rows_beyond_length,
    step_positions,
    step_rope_freqs,
)
from omnistage.models.qwen3_omni.processor import MediaItem, thinker_media
from omnistage.models.qwen3_omni.talker import Talker
from omnistage.models.qwen3_omni.talker_inputs import (
    TalkerTokenIds,
    TextSpecials,
    build_talker_prefill,
    talker_decode_input,
    talker_positions,
    talker_prompt_rows,
    talker_text_rows,
    text_row_ready,
)
from omnistage.models.qwen3_omni.thinker import Thinker
from omnistage.runner.outputs import OmniOutput, StepContext

_NO_UPDATES = None
_NO_ROWS = torch.empty(0, dtype=torch.long)  # (shared: read only)


class ThinkerStageModel:
    """The Thinker as a stage model.

    Media (the request state's ``media``, see ``processor.thinker_media``): in each step, the prompt rows
    [lo, hi) a request's chunk covers pick their encoder rows (items encoded on first need, batched across the
    step's requests, cached by content key in ``encoders``: see ``encoder_cache``) and their 3-D positions
    from the request's precomputed table; a chunk may cut through any span. Rows past the prompt (decode) sit
    at ``index + rope_delta``. ``free(req_id)`` (called by the stage on finish/abort/failure) lets go of a
    request's encoder outputs; they are let go by themselves once its prompt is fully prefilled.
    """

    # Row-aligned aux outputs only (embeds, accept-layer rows): safe to rebuild after a graph replay.
    supports_full_graph_aux_outputs = True

    def __init__(self, thinker: Thinker, encoders: MediaEncoders | None = None) -> None:
        self.thinker = thinker
        self.encoders = encoders if encoders is not None else MediaEncoders(None, None)
        cfg = thinker.cfg
        self.num_layers, self.num_kv_heads, self.head_dim = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
        self.hidden_size = cfg.hidden_size

    def free(self, req_id: str) -> None:
        self.encoders.release(req_id)

    # ---- prefix caching (see docs/prefix_caching.md) -------------------------------------------------
    def block_extra_key(self, state: Mapping[str, Any], request: Request, start: int, end: int) -> bytes | None:
        """What besides the token ids decides the KV of rows [start, end): the content key and output
        rows of every media item that fills some of them, and their 3-D positions where those are not the
        plain index (image/video prompts, rows after them). None where a rope that follows the forward's
        length rotated them past its original length (their keys depend on that length)."""
        media = thinker_media(state)
        prompt = None if media is None else media.prompt_positions
        if rows_beyond_length(self.thinker.model.rotary, start, end, prompt, request.num_prompt_tokens):
            return None
        if media is None:
            return b""
        parts = []
        for item in media.items:
            o1, o2 = item_span(item, start, end)
            if o1 < o2:
                parts.append(f"{item.kind}:{item.key}:{o1}:{o2};".encode())
        num_prompt = media.positions.shape[0]
        index = torch.arange(start, end, dtype=torch.float32)
        pos = (index + media.rope_delta)[:, None].expand(-1, 3).clone()
        a, b = start, min(end, num_prompt)
        if a < b:
            pos[: b - a] = media.positions[a:b]
        if not torch.equal(pos, index[:, None].expand(-1, 3)):
            parts.append(pos.numpy().tobytes())
        return b"".join(parts)

    def cache_hit_limit(self, state: Mapping[str, Any], request: Request) -> int | None:
        """A request that speaks needs the accept-layer rows of its user-turn media rows, which only a
        forward pass gives: the cache may serve rows before the first of them only. (Text rows the
        Talker reads are embeddings, re-made from the token ids for cached rows: ``stage_outputs``.)"""
        hidden = state.get("talker_hidden_rows")
        if hidden is None or not bool(hidden.any()):
            return None
        return int(torch.nonzero(hidden)[0, 0])

    def resource_stats(self) -> dict[str, int]:
        """Encoder outputs held for prompts not yet prefilled and the requests holding any (both 0 once every
        prompt is prefilled), and the unheld ones kept for later requests (count, bytes)."""
        return {"encoder_entries": len(self.encoders), "encoder_holders": len(self.encoders.held),
                "encoder_kept_entries": len(self.encoders.kept), "encoder_kept_bytes": self.encoders.kept_bytes}

    def prepare_inputs(self, ctx: StepContext, input_ids: torch.Tensor, positions: torch.Tensor):
        """Positions become float (decode rows of media requests sit at fractional ids after a video):
        ``[N]`` when every row is text-like, ``[N, 3]`` when a chunk covers prompt rows of an image/video
        request; media rows and deepstack rows are added for prefill chunks that reach them."""
        media = [thinker_media(state) for state in ctx.states]
        spans = [ctx.spans[r] for r in ctx.req_ids]
        prompts = [None if m is None else m.prompt_positions for m in media]
        pos = step_positions(positions, ctx.num_computed, spans, prompts)
        kwargs = {"input_ids": input_ids, "positions": pos}
        kwargs.update(step_rope_freqs(self.thinker.model.rotary, pos, ctx.num_computed, spans, prompts,
                                      (r.num_prompt_tokens for r in ctx.requests)))
        if not any(m is not None for m in media):
            return kwargs, [_NO_UPDATES] * len(ctx.req_ids)
        # Encoder rows for the prompt rows [a, b) each request's chunk covers (host bookkeeping).
        needs: list[tuple[str, MediaItem]] = []
        picks: list[tuple[MediaItem, int, int, torch.Tensor]] = []  # item, [o1, o2), step rows
        done: list[str] = []
        for req_id, (s, e), lo, m in zip(ctx.req_ids, spans, ctx.num_computed, media):
            if m is None:
                continue
            num_prompt = m.positions.shape[0]
            a, b = lo, min(lo + (e - s), num_prompt)
            if a >= b:
                continue
            for item in m.items:
                o1, o2 = item_span(item, a, b)
                if o1 < o2:
                    needs.append((req_id, item))
                    picks.append((item, o1, o2, item.rows[o1:o2] - a + s))
            if b == num_prompt:
                done.append(req_id)
        if picks:
            self.encoders.acquire(needs)
            kwargs.update(self._media_rows(picks, positions.device))
        for req_id in done:
            self.encoders.release(req_id)
        return kwargs, [_NO_UPDATES] * len(ctx.req_ids)

    def _media_rows(self, picks: list[tuple[MediaItem, int, int, torch.Tensor]], device: torch.device) -> dict:
        entries = [self.encoders.entries[item.key] for item, _, _, _ in picks]
        out = {
            "mm_rows": torch.cat([rows for _, _, _, rows in picks]).to(device),
            "mm_embeds": torch.cat([en.embeds[o1:o2] for en, (_, o1, o2, _) in zip(entries, picks)]),
        }
        visual = [(en, p) for en, p in zip(entries, picks) if p[0].is_visual and en.deepstack is not None]
        if visual:
            out["deepstack_rows"] = torch.cat([p[3] for _, p in visual]).to(device)
            out["deepstack"] = torch.cat([en.deepstack[:, p[1] : p[2]] for en, p in visual], dim=1)
        return out

    def forward(self, kv_caches, attn_meta: AttentionMetadata, input_ids, positions, **media) -> OmniOutput:
        with torch.inference_mode():
            out = self.thinker(input_ids, positions, kv_caches, attn_meta, **media)
        aux = {"embeds": out.embeds, "accept": out.accept_hidden}
        return OmniOutput(hidden_states=out.hidden, multimodal_outputs=aux)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self.thinker.compute_logits(hidden)

    def postprocess(self, ctx: StepContext, output: OmniOutput, sampled: dict[str, int]):
        return [_NO_UPDATES] * len(ctx.req_ids)

    def stage_outputs(
        self, ctx: StepContext, output: OmniOutput, sampled: dict[str, int]
    ) -> dict[str, dict[str, Any]]:
        """Rows for the Talker, only for requests that asked for audio: layer-0 embeddings ("embeds" at
        "positions") of the user-turn text rows, the assistant header and answer tokens; accept-layer hidden
        states ("hidden" at "hidden_positions") of the user-turn audio/image/video rows.

        Which rows to send is decided on the host (positions follow from ``num_computed_tokens``, the
        prompt masks are host tensors), then one gather per kind on the model's device picks them all: no
        per-request device syncs or copies in the step.
        """
        cached = self._cached_talker_rows(ctx)
        embed_picks, hidden_picks, owners = [], [], []
        for req_id, start, state in zip(ctx.req_ids, ctx.num_computed, ctx.states):
            needed = state.get("talker_rows")
            if needed is None:
                continue
            s, e = ctx.spans[req_id]
            pos = torch.arange(start, start + (e - s))
            if start >= needed.shape[0]:  # answer rows only (decode steps): all of them, none from the media
                embed_picks.append(pos - (start - s))
                owners.append((req_id, pos, _NO_ROWS))
                continue
            in_prompt = pos < needed.shape[0]
            keep = ~in_prompt
            keep[in_prompt] = needed[pos[in_prompt]]
            hidden = torch.zeros_like(in_prompt)
            media_rows = state.get("talker_hidden_rows")
            if media_rows is not None:
                hidden[in_prompt] = media_rows[pos[in_prompt]]
            rows, hrows = torch.nonzero(keep).flatten(), torch.nonzero(hidden).flatten()
            if rows.numel() or hrows.numel():
                embed_picks.append(rows + s)
                hidden_picks.append(hrows + s)
                owners.append((req_id, pos[rows], pos[hrows]))
        if not owners:
            return cached
        mm = output.multimodal_outputs
        # Index-select copies: payloads own their rows, never a view of this step's buffers.
        embeds = mm["embeds"][torch.cat(embed_picks).to(mm["embeds"].device)]
        hidden_index = torch.cat(hidden_picks) if hidden_picks else _NO_ROWS
        hidden = mm["accept"][hidden_index.to(mm["accept"].device)] if hidden_index.numel() else None
        out, e0, h0 = {}, 0, 0
        for req_id, pos, hpos in owners:
            out[req_id] = {"positions": pos, "embeds": embeds[e0 : e0 + pos.numel()]}
            e0 += pos.numel()
            if hpos.numel():
                out[req_id].update(hidden_positions=hpos, hidden=hidden[h0 : h0 + hpos.numel()])
                h0 += hpos.numel()
        for req_id, rows in cached.items():  # rows from the cache go first, in position order
            mine = out.get(req_id)
            if mine is None:
                out[req_id] = rows
            else:
                mine["positions"] = torch.cat([rows["positions"], mine["positions"]])
                mine["embeds"] = torch.cat([rows["embeds"], mine["embeds"]])
        return out

    def _cached_talker_rows(self, ctx: StepContext) -> dict[str, dict[str, Any]]:
        """The Talker's rows among a request's cache-served rows [0, num_cached): all are embedding rows
        (``cache_hit_limit`` keeps accept-layer rows out of the cache's reach), made by one embedding lookup
        of their token ids — equal to what the forward would have produced for them."""
        if not ctx.num_cached:
            return {}
        owners, ids = [], []
        for req_id, request, state, c in zip(ctx.req_ids, ctx.requests, ctx.states, ctx.num_cached):
            needed = state.get("talker_rows")
            if c == 0 or needed is None:
                continue
            media_rows = state.get("talker_hidden_rows")
            if media_rows is not None and bool(media_rows[:c].any()):
                raise RuntimeError(f"request {req_id!r}: accept-layer rows were served from the prefix cache")
            pos = torch.arange(c)
            in_prompt = pos < needed.shape[0]
            keep = ~in_prompt
            keep[in_prompt] = needed[pos[in_prompt]]
            pos = pos[keep]
            if pos.numel():
                owners.append((req_id, pos))
                ids.append(torch.tensor(request.all_token_ids[:c], dtype=torch.long)[pos])
        if not owners:
            return {}
        device = self.thinker.model.embed_tokens.weight.device
        with torch.inference_mode():
            embeds = self.thinker.embed(torch.cat(ids).to(device))
        out, e0 = {}, 0
        for req_id, pos in owners:
            out[req_id] = {"positions": pos, "embeds": embeds[e0 : e0 + pos.numel()]}
            e0 += pos.numel()
        return out


class TalkerStageModel:
    supports_full_graph_aux_outputs = True
    # transformers penalises only generated codec ids (its talker prompt is embeddings, not ids).
    penalty_includes_prompt = False
    # The sampled ids are layer-0 codes, not text: clients get whole frames ("codes") instead.
    emits_token_ids = False

    def __init__(self, talker: Talker, ids: TalkerTokenIds, specials: TextSpecials) -> None:
        self.talker = talker
        self.ids = ids
        self.specials = specials
        cfg = talker.cfg
        self.num_layers, self.num_kv_heads, self.head_dim = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
        self.hidden_size = cfg.hidden_size
        self.codec_eos_id = talker.codec_eos_id
        self.num_code_groups = talker.num_code_groups
        self._step_frames: tuple[StepContext, OmniOutput, dict[str, torch.Tensor]] | None = None  # (_frames)

    # ---- prefix caching (see docs/prefix_caching.md) -------------------------------------------------
    def block_extra_key(self, state: Mapping[str, Any], request: Request, start: int, end: int) -> bytes | None:
        """The digest of the prefill rows [start, end) (the projected Thinker rows, the codec-side rows,
        the speaker: everything the token ids do not say) and their 3-D positions; None past the prefill
        (decode rows depend on sampled codes: never cached)."""
        prefill = state.get("prefill_embeds")
        if prefill is None or end > prefill.shape[0]:
            return None
        positions = state.get("prefill_positions")
        if rows_beyond_length(self.talker.model.rotary, start, end, positions, prefill.shape[0]):
            return None
        rows = prefill[start:end].detach().contiguous().cpu()
        h = hashlib.sha256(rows.view(torch.uint8).numpy().tobytes())
        h.update(str(rows.dtype).encode())
        if positions is not None:
            h.update(positions.table[start:end].contiguous().numpy().tobytes())
        return h.digest()

    # ---- input construction (called by the Thinker -> Talker bridge) --------------------------------
    def build_prefill(
        self, prompt_ids: Sequence[int], rows: Mapping[int, torch.Tensor], hidden_rows: Mapping[int, torch.Tensor],
        first_answer: torch.Tensor, speaker_id: int, media_spans: Sequence[MediaSpan] = (),
    ) -> tuple[torch.Tensor, list[int], PromptPositions | None]:
        """(prefill rows, their ids, their 3-D positions or None when plain) from the Thinker rows sent:
        ``rows`` layer-0 embeddings and ``hidden_rows`` accept-layer rows by prompt position, ``media_spans``
        the Talker prompt's spans (``talker_inputs.talker_media_spans``)."""
        embed_rows, media_rows = talker_prompt_rows(prompt_ids, self.ids)
        missing = sorted(set(torch.nonzero(embed_rows).flatten().tolist()) - rows.keys()
                         | set(torch.nonzero(media_rows).flatten().tolist()) - hidden_rows.keys())
        if missing:  # a gap would be read as zeros: wrong speech, not an error, unless refused here
            raise RuntimeError(f"the Talker's prompt rows at positions {missing[:8]} never arrived from the Thinker "
                               f"({len(missing)} missing)")
        ids = torch.tensor(list(prompt_ids), dtype=torch.long, device=first_answer.device)
        with torch.inference_mode():
            prefill, input_ids = build_talker_prefill(
                self.talker, self.ids, ids, _prompt_table(len(prompt_ids), rows, first_answer),
                _prompt_table(len(prompt_ids), hidden_rows, first_answer) if hidden_rows else None,
                first_answer, speaker_id, self.specials,
            )
        positions = talker_positions(
            media_spans, prefill.shape[0], self.talker.spatial_merge_size, self.talker.position_id_per_seconds
        )
        return prefill, input_ids.tolist(), positions

    def project_text(self, rows: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self.talker.project_text(rows)

    @staticmethod
    def _num_answers(state: Mapping[str, Any]) -> int:
        """The Thinker's answer rows so far (its layer-0 embeddings, row 0 = first answer token)."""
        rows = state.get("answer_embeds")
        return 0 if rows is None else rows.shape[0]

    def input_ready(self, state: Mapping[str, Any], request: Request) -> bool:
        """Whether the next decode step's text row exists (else the stage pauses the request)."""
        step = request.num_output_tokens - 1
        return text_row_ready(step, self._num_answers(state), bool(state.get("text_done", False)))

    # ---- one step ----------------------------------------------------------------------------------
    def prepare_inputs(self, ctx: StepContext, input_ids: torch.Tensor, positions: torch.Tensor):
        rows = input_ids.shape[0]
        embeds = torch.zeros(rows, self.hidden_size, dtype=self.specials.pad.dtype, device=input_ids.device)
        frames = torch.full((rows, self.num_code_groups), -1, dtype=torch.long, device=input_ids.device)
        updates: list[dict[str, Any] | None] = [None] * len(ctx.req_ids)
        new_rows: list[tuple[int, int, int]] = []  # (batch index, token row, decode step)
        for i, req_id in enumerate(ctx.req_ids):
            st = ctx.states[i]
            s, e = ctx.spans[req_id]
            lo = ctx.num_computed[i]  # this span's first position (host value, no device sync)
            hi = lo + (e - s)
            prefill = st.get("prefill_embeds")
            if prefill is None:
                raise RuntimeError(f"talker request {req_id!r} scheduled before its prefill was built")
            num_prefill = prefill.shape[0]
            # Decode inputs are kept as a tuple of rows (appending is O(1) in data copied; a growing
            # tensor would copy every earlier row at every step) and stacked only to replay them.
            stored = st.get("decode_embeds", ())
            num_stored = len(stored)
            a, b = lo, min(hi, num_prefill)
            if a < b:
                embeds[s : s + b - a] = prefill[a:b]
            a, b = max(lo, num_prefill), min(hi, num_prefill + num_stored)
            if a < b:  # recompute after preemption replays stored decode inputs
                embeds[s + a - lo : s + b - lo] = torch.stack(stored[a - num_prefill : b - num_prefill])
            if hi > num_prefill + num_stored:
                if hi != num_prefill + num_stored + 1:
                    raise RuntimeError(f"talker request {req_id!r}: more than one new decode row in a step")
                if "last_hidden" not in st:
                    raise RuntimeError(f"talker request {req_id!r}: decode without the previous hidden state")
                new_rows.append((i, e - 1, hi - 1 - num_prefill))
        if new_rows:
            idx = [i for i, _, _ in new_rows]
            token_rows = torch.tensor([r for _, r, _ in new_rows], device=input_ids.device)
            hidden_prev = torch.stack([ctx.states[i]["last_hidden"] for i in idx])
            # (the Thinker's answer rows, projected here: a step's rows at once, not each request's as it arrived)
            text = talker_text_rows([(step, ctx.states[i].get("answer_embeds"), bool(ctx.states[i].get("text_done")))
                                     for i, _, step in new_rows], self.project_text, self.specials)
            # Residual codes follow the talker's greedy/sampling choice, each sampled row from its own generator.
            generators = [None if ctx.sampling_rows[i].params.greedy else ctx.sampling_rows[i].generator for i in idx]
            with torch.inference_mode():
                codes, embed_sum = self.talker.complete_frames(hidden_prev, input_ids[token_rows], generators)
            step_in = talker_decode_input(embed_sum, text)
            embeds[token_rows] = step_in
            frames[token_rows] = codes
            for k, i in enumerate(idx):
                updates[i] = {"decode_embeds": (*ctx.states[i].get("decode_embeds", ()), step_in[k].clone())}
        prompts = [st.get("prefill_positions") for st in ctx.states]
        spans = [ctx.spans[r] for r in ctx.req_ids]
        positions = step_positions(positions, ctx.num_computed, spans, prompts)
        kwargs = {"inputs_embeds": embeds, "positions": positions, "frames": frames}
        kwargs.update(step_rope_freqs(self.talker.model.rotary, positions, ctx.num_computed, spans, prompts,
                                      (st["prefill_embeds"].shape[0] for st in ctx.states)))
        return kwargs, updates

    def forward(self, kv_caches, attn_meta: AttentionMetadata, inputs_embeds, positions, frames,
                rope_freqs: torch.Tensor | None = None) -> OmniOutput:
        with torch.inference_mode():
            hidden, logits = self.talker.forward_with_logits(inputs_embeds, positions, kv_caches, attn_meta,
                                                             rope_freqs)
        return OmniOutput(hidden_states=hidden, multimodal_outputs={"codes.audio": frames}, logits=logits)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self.talker.compute_logits(hidden)

    def postprocess(self, ctx: StepContext, output: OmniOutput, sampled: dict[str, int]):
        """Keep the hidden state the next decode's code predictor starts from."""
        hidden = output.hidden_states
        return [
            {"last_hidden": hidden[ctx.spans[r][1] - 1].clone()} if r in sampled else None for r in ctx.req_ids
        ]

    def _frames(self, ctx: StepContext, output: OmniOutput) -> dict[str, torch.Tensor]:
        """Complete frames of this step per request, [k, Q] host tensors (owned copies), made once a step (the
        stage's and the client's outputs both read them)."""
        kept = self._step_frames
        if kept is not None and kept[0] is ctx and kept[1] is output:
            return kept[2]
        # One host copy of the step's frames, then per-request slices by the real spans.
        frames = output.multimodal_outputs["codes.audio"][: ctx.num_tokens_unpadded].cpu()
        complete = (frames[:, 0] >= 0).tolist()
        out = {}
        for req_id in ctx.req_ids:
            s, e = ctx.spans[req_id]
            if e - s == 1:  # a decode row: its frame, if it made one (a copy: owned, not a view of the step)
                if complete[s]:
                    out[req_id] = frames[s:e].clone()
                continue
            mine = frames[s:e]
            mine = mine[mine[:, 0] >= 0]  # boolean indexing copies
            if mine.shape[0]:
                out[req_id] = mine
        self._step_frames = (ctx, output, out)
        return out

    def stage_outputs(
        self, ctx: StepContext, output: OmniOutput, sampled: dict[str, int]
    ) -> dict[str, dict[str, Any]]:
        return {r: {"frames": f} for r, f in self._frames(ctx, output).items()}

    def client_outputs(self, ctx: StepContext, output: OmniOutput, sampled: dict[str, int]) -> dict[str, dict]:
        return {r: {"codes": f.T.contiguous()} for r, f in self._frames(ctx, output).items()}


def _prompt_table(num_rows: int, rows: Mapping[int, torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """[num_rows, H] with the given rows at their positions; zeros stand in for rows that were never sent
    (the Talker does not read them)."""
    table = like.new_zeros(num_rows, like.shape[-1])
    if rows:
        table[torch.tensor(list(rows), dtype=torch.long, device=like.device)] = torch.stack(list(rows.values()))
    return table


class Code2WavStageModel:
    """Code2Wav as a generation stage model: each request's chunks of new frames are decoded by the streaming
    decoder, batched across requests at different positions; the per-request decoder state lives in the
    runner's record (created on the first chunk, freed with the request) and the stream equals one-shot
    decoding of all frames."""

    def __init__(self, code2wav: Code2Wav) -> None:
        self.code2wav = code2wav
        self.streamer = Code2WavStreamer(code2wav)

    def forward_batch(self, payloads: list[torch.Tensor], states: list[Mapping[str, Any]]):
        width = max(p.shape[1] for p in payloads)
        device = self.code2wav.code_embedding.weight.device
        codes = torch.full((len(payloads), payloads[0].shape[0], width), -1, dtype=torch.long, device=device)
        for b, p in enumerate(payloads):
            codes[b, :, : p.shape[1]] = p
        out = self.streamer.decode(codes, [p.shape[1] for p in payloads], [s.get("stream") for s in states])
        # The decoder's states are rows of one batch tensor: each request keeps its own copy.
        updates = [{"stream": Code2WavStreamState(st.frames, st.buffer.clone())} for st in out.states]
        return {"audio": out.wave, "audio_lengths": out.wave_lengths}, updates
