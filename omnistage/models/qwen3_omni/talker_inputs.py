"""Talker input construction for one request, as the Thinker's output streams in.

Prefill = the user turns of the prompt (every row whose latest ``<|im_start|>`` is followed by the user role
id; text rows -> ``text_projection(thinker embedding)``, audio/image/video rows -> ``hidden_projection(thinker
accept-layer hidden)``), then 9 assistant rows: text side ``<|im_start|> assistant \\n``, 4x tts_pad, tts_bos,
first answer token (all projected); codec side three zero rows, nothink, think_bos, think_eos, speaker,
codec_pad, codec_bos (talker codec embeddings).

Decode step k (k = 0, 1, ...) adds one text row: projected answer token k+1, then tts_eos once, then tts_pad.
"Answer tokens" are the generated tokens the Thinker embedded, i.e. fed back as input: every generated token
but the last (the EOS, or the final token of a length-capped answer, is never embedded and never spoken).

Positions: the Talker's own 3-D ids over its own prompt (user rows + the 9 assistant rows), from the Thinker
prompt's media spans re-indexed to it (``talker_media_spans``, ``talker_positions``); decode rows continue at
``index + rope delta``. Prompts without images or videos have plain positions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from omnistage.models.qwen3_omni.mrope import MediaSpan, PromptPositions, prompt_positions
from omnistage.models.qwen3_omni.talker import Talker

ASSISTANT_TEXT_ROWS = 9


@dataclass(frozen=True)
class TalkerTokenIds:
    im_start: int
    user: int
    assistant: int
    tts_pad: int
    tts_bos: int
    tts_eos: int
    codec_nothink: int
    codec_think_bos: int
    codec_think_eos: int
    codec_pad: int
    codec_bos: int
    multimodal: tuple[int, ...]  # thinker ids whose talker row comes from the accept-layer hidden

    def __post_init__(self) -> None:
        if len({self.im_start, self.user, self.assistant}) != 3:
            raise ValueError("im_start, user and assistant token ids must differ")

    @classmethod
    def from_config(cls, config: Any) -> TalkerTokenIds:
        t = config.talker_config
        th = config.thinker_config
        return cls(
            im_start=config.im_start_token_id,
            user=config.user_token_id,
            assistant=config.assistant_token_id,
            tts_pad=config.tts_pad_token_id,
            tts_bos=config.tts_bos_token_id,
            tts_eos=config.tts_eos_token_id,
            codec_nothink=t.codec_nothink_id,
            codec_think_bos=t.codec_think_bos_id,
            codec_think_eos=t.codec_think_eos_id,
            codec_pad=t.codec_pad_id,
            codec_bos=t.codec_bos_id,
            multimodal=(th.audio_token_id, th.image_token_id, th.video_token_id),
        )


@dataclass(frozen=True)
class TextSpecials:
    """Projected tts_pad / tts_bos / tts_eos rows, [H_talker] each; compute once per model."""

    pad: torch.Tensor
    bos: torch.Tensor
    eos: torch.Tensor


def text_specials(talker: Talker, thinker_embed_tokens: torch.nn.Module, ids: TalkerTokenIds) -> TextSpecials:
    """text_projection(thinker embedding of [tts_pad, tts_bos, tts_eos])."""
    weight = thinker_embed_tokens.weight
    special = torch.tensor([ids.tts_pad, ids.tts_bos, ids.tts_eos], device=weight.device)
    pad, bos, eos = talker.project_text(thinker_embed_tokens(special)).unbind(0)
    return TextSpecials(pad=pad, bos=bos, eos=eos)


def user_rows_mask(prompt_ids: torch.Tensor, ids: TalkerTokenIds) -> torch.Tensor:
    """[P] bool: rows belonging to user turns (the role after the latest ``<|im_start|>`` is ``user``).

    Rows before the first ``<|im_start|>`` take the role at index 1, exactly as transformers' generate does.
    """
    p = prompt_ids.shape[0]
    pos = torch.arange(p, device=prompt_ids.device)
    starts = torch.where(prompt_ids == ids.im_start, pos, torch.full_like(pos, -1))
    latest = torch.cummax(starts, dim=0).values.clamp_min(0)
    roles = prompt_ids[(latest + 1).clamp_max(p - 1)]
    return roles == ids.user


def talker_prompt_rows(prompt_ids: Sequence[int], ids: TalkerTokenIds) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt rows the Talker reads, as two [P] bool masks: rows whose layer-0 embedding it reads (user-turn
    text rows and the final assistant header) and rows whose accept-layer hidden state it reads (user-turn audio,
    image and video rows)."""
    t = torch.tensor(list(prompt_ids), dtype=torch.long)
    if t.numel() < 3 or t[-3] != ids.im_start or t[-2] != ids.assistant:
        raise ValueError(
            "speech output needs a chat prompt that ends with the assistant header "
            "'<|im_start|>assistant\\n' (render it with add_generation_prompt=True)"
        )
    user = user_rows_mask(t, ids)
    media = torch.isin(t, torch.tensor(ids.multimodal))
    embeds = user & ~media
    embeds[-3:] = True
    return embeds, user & media


def talker_media_spans(
    spans: Sequence[MediaSpan], prompt_ids: Sequence[int], ids: TalkerTokenIds
) -> tuple[MediaSpan, ...]:
    """The Thinker prompt's media spans as the Talker's position rules see them in the Talker's own prompt.

    Only user-turn rows are in that prompt: spans elsewhere drop out, the others are re-indexed (a span lies
    within one turn, so its rows stay contiguous). A video with its audio track is taken as transformers'
    Talker takes it: ``generate`` does not pass ``use_audio_in_video`` to its Talker, whose rope scan then
    reads such a span as a video interleaved with its audio only while an image is still ahead of it in the
    prompt; otherwise every row of the span gets plain sequential ids, as text does.
    """
    user = user_rows_mask(torch.tensor(list(prompt_ids), dtype=torch.long), ids)
    index = torch.cumsum(user.long(), 0) - 1  # the Talker prompt row of each user row
    kept = [dataclasses.replace(s, start=int(index[s.start])) for s in spans if bool(user[s.start])]
    image_after = [any(k.kind == "image" for k in kept[i + 1 :]) for i in range(len(kept))]
    return tuple(s for s, later in zip(kept, image_after) if s.kind != "video+audio" or later)


def talker_positions(
    spans: Sequence[MediaSpan], num_rows: int, spatial_merge_size: int, position_id_per_seconds: float
) -> PromptPositions | None:
    """The Talker prompt's 3-D ids (``num_rows`` = user rows + 9 assistant rows); None when they are plain."""
    if all(s.kind == "audio" for s in spans):
        return None
    table, delta = prompt_positions(num_rows, spans, spatial_merge_size, position_id_per_seconds)
    return PromptPositions(table, delta)


def assistant_start(prompt_ids: torch.Tensor, ids: TalkerTokenIds) -> int:
    """Index of the last ``<|im_start|> assistant`` pair; the prompt must end with that header + one token."""
    pairs = (prompt_ids[:-1] == ids.im_start) & (prompt_ids[1:] == ids.assistant)
    hits = torch.nonzero(pairs).flatten()
    if hits.numel() == 0:
        raise ValueError("prompt has no '<|im_start|>assistant' header; the Talker needs one")
    start = int(hits[-1])
    if start + 3 != prompt_ids.shape[0]:
        raise ValueError(
            "the prompt must end with '<|im_start|>assistant\\n' (3 tokens) for the Talker; "
            f"found the header at {start} of {prompt_ids.shape[0]} tokens"
        )
    return start


def build_talker_prefill(
    talker: Talker,
    ids: TalkerTokenIds,
    prompt_ids: torch.Tensor,
    thinker_embeds: torch.Tensor,
    thinker_accept_hidden: torch.Tensor | None,
    first_answer_embed: torch.Tensor,
    speaker_id: int,
    specials: TextSpecials,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's talker prefill: (inputs_embeds [L, H], input_ids [L]).

    prompt_ids [P]; thinker_embeds [P, H_thinker] (layer-0 embeddings of the prompt); thinker_accept_hidden
    [P, H_thinker] or None when the prompt has no audio/image/video rows; first_answer_embed [H_thinker] (the
    thinker embedding of the first generated token). input_ids are the thinker ids of the user rows followed by
    9x tts_pad (transformers only reads them for multimodal 3-D positions).
    """
    p = prompt_ids.shape[0]
    if thinker_embeds.shape[0] != p:
        raise ValueError(f"thinker_embeds has {thinker_embeds.shape[0]} rows for a {p}-token prompt")
    start = assistant_start(prompt_ids, ids)
    user = user_rows_mask(prompt_ids, ids)
    mm = torch.isin(prompt_ids, torch.tensor(ids.multimodal, device=prompt_ids.device))
    user_mm = user & mm
    user_text = user & ~mm
    hidden = talker.cfg.hidden_size
    dtype = thinker_embeds.dtype
    user_rows = thinker_embeds.new_empty(int(user.sum()), hidden)
    order = torch.cumsum(user.long(), 0) - 1  # row index within the user part
    user_rows[order[user_text]] = talker.project_text(thinker_embeds[user_text]).to(dtype)
    if bool(user_mm.any()):
        if thinker_accept_hidden is None:
            raise ValueError("prompt has multimodal rows but thinker_accept_hidden was not given")
        user_rows[order[user_mm]] = talker.project_hidden(thinker_accept_hidden[user_mm]).to(dtype)

    header = talker.project_text(torch.cat((thinker_embeds[start:], first_answer_embed[None]), dim=0))
    text_side = torch.cat(
        (header[:3], specials.pad.expand(4, -1), specials.bos[None], header[3:4]),
        dim=0,
    )
    codec_ids = torch.tensor(
        [
            ids.codec_nothink,
            ids.codec_think_bos,
            ids.codec_think_eos,
            speaker_id,
            ids.codec_pad,
            ids.codec_bos,
        ],
        device=prompt_ids.device,
    )
    codec_side = torch.cat((text_side.new_zeros(3, hidden), talker.embed_codec(codec_ids)), dim=0)
    inputs_embeds = torch.cat((user_rows, text_side + codec_side), dim=0)
    input_ids = torch.cat(
        (
            prompt_ids[user],
            torch.full((ASSISTANT_TEXT_ROWS,), ids.tts_pad, dtype=prompt_ids.dtype, device=prompt_ids.device),
        )
    )
    return inputs_embeds, input_ids


def text_row_ready(step: int, num_answer_rows: int, answer_done: bool) -> bool:
    """Whether decode step ``step`` has its text row: answer token step+1 exists, or the answer is complete."""
    return answer_done or step + 1 < num_answer_rows


def talker_text_rows(
    steps: Sequence[tuple[int, torch.Tensor | None, bool]], project: Callable[[torch.Tensor], torch.Tensor],
    specials: TextSpecials,
) -> torch.Tensor:
    """Text-conditioning rows [len(steps), H] for decode steps (step (0-based), the answer rows so far [n, E] or
    None, whether the answer is done): answer row step + 1 through ``project`` (every step's at once: one call,
    row by row the same rows), else tts_eos right after the last answer row and tts_pad after that.

    Row 0 of the answers is the first answer token, which the prefill already consumed; ``n`` is final once the
    Thinker has finished (an error while the row is still streaming)."""
    rows: list[torch.Tensor | None] = [None] * len(steps)
    answers: list[tuple[int, torch.Tensor]] = []
    for k, (step, answer_rows, answer_done) in enumerate(steps):
        if step < 0:
            raise ValueError(f"decode step must be >= 0, got {step}")
        n = 0 if answer_rows is None else answer_rows.shape[0]
        if step + 1 < n:
            answers.append((k, answer_rows[step + 1]))
        elif not answer_done:
            raise ValueError(f"text row {step + 1} is not available yet ({n} answer rows, answer still streaming)")
        else:
            rows[k] = specials.eos if step + 1 == n else specials.pad
    if answers:
        for (k, _), row in zip(answers, project(torch.stack([row for _, row in answers])).unbind(0), strict=True):
            rows[k] = row
    return torch.stack(rows)


def talker_decode_input(embed_sum: torch.Tensor, text_rows: torch.Tensor) -> torch.Tensor:
    """The talker's input rows for a decode step: codec embedding sum of the frame + the text row."""
    return embed_sum + text_rows.to(embed_sum.dtype)
