"""Talker input rows for one request, built as the Thinker's output streams in.

All rows live in the Thinker's width and are projected by the Talker (``thinker_to_talker_proj``). A *Thinker
row* is a processed token's layer-0 embedding plus its final hidden state.

Prefill (P prompt tokens -> P + 2 rows), as transformers' ``Qwen2_5OmniForConditionalGeneration.generate``:
- rows 0..P-1: the Thinker rows of the whole prompt (every turn, not only user turns);
- row P: the Thinker *embedding* of the speaker's ``bos_token`` (spk_dict.pt) + codec embedding of codec_pad;
- row P+1: the Thinker row of the first answer token + codec embedding of codec_bos.
Prompt ids (what the repetition penalty sees): ``codec_mask`` x P, ``codec_pad``, ``codec_bos``.

Decode step k (k = 0, 1, ...): codec embedding of the code sampled at step k-1 (codec_bos's successor) plus the
text row k: the Thinker row of answer token k+1 while one exists, then the embedding of tts_text_end once, then
of tts_text_pad forever. "Answer tokens" are the generated tokens the Thinker fed back, i.e. every generated
token but the last: the last one (EOS, or the final token of a length-capped answer) is never processed, has no
hidden state and is never spoken. An answer with no fed-back token (the Thinker stopped after one token) has no
first answer row, so no speech.

The codec pad/bos embeddings on rows P and P+1 — the batch-1 trap: transformers' Talker adds them only when it
receives an attention mask, and ``generate`` drops an all-ones mask before the forward. So an unpadded request
(batch of one, or a batch of equal lengths) runs without them, while the same request padded inside a batch of
different lengths runs with them. omnistage always adds them: a request's speech must not depend on what else is
in the batch, and the explicit-mask path is the one that matches the prompt ids the model is given (rows P and
P+1 *are* codec_pad and codec_bos). Parity tests run the reference with the mask passed explicitly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from omnistage.models.qwen2_5_omni.talker import Talker, TalkerTokenIds


@dataclass(frozen=True)
class TextSpecials:
    """Thinker embeddings of tts_text_end / tts_text_pad ([E] each): the text rows after the answer."""

    eos: torch.Tensor
    pad: torch.Tensor


def text_specials(thinker_embed_tokens: torch.nn.Module, ids: TalkerTokenIds) -> TextSpecials:
    weight = thinker_embed_tokens.weight
    eos, pad = thinker_embed_tokens(torch.tensor([ids.text_eos, ids.text_pad], device=weight.device)).unbind(0)
    return TextSpecials(eos=eos, pad=pad)


def prefill_ids(num_prompt: int, ids: TalkerTokenIds) -> list[int]:
    """The Talker's prompt token ids for a ``num_prompt``-token Thinker prompt (P + 2 ids)."""
    return [ids.codec_mask] * num_prompt + [ids.codec_pad, ids.codec_bos]


def build_prefill(
    talker: Talker, prompt_rows: torch.Tensor, speaker_bos_embed: torch.Tensor, first_answer_row: torch.Tensor
) -> torch.Tensor:
    """[P + 2, E] prefill rows. prompt_rows [P, E] Thinker rows; speaker_bos_embed [E] the Thinker embedding of
    the speaker's bos token; first_answer_row [E] the Thinker row of the first answer token."""
    if prompt_rows.dim() != 2 or prompt_rows.shape[0] == 0:
        raise ValueError(f"prompt_rows must be a non-empty [P, E] tensor, got {tuple(prompt_rows.shape)}")
    ids = talker.ids
    codec = talker.embed_codec(torch.tensor([ids.codec_pad, ids.codec_bos], device=prompt_rows.device))
    tail = torch.stack((speaker_bos_embed, first_answer_row)).to(codec.dtype) + codec
    return torch.cat((prompt_rows.to(codec.dtype), tail))


def text_row_ready(step: int, num_answer_rows: int, answer_done: bool) -> bool:
    """Whether decode step ``step`` has its text row: answer row step+1 exists, or the answer is complete."""
    return answer_done or step + 1 < num_answer_rows


def text_rows_for_steps(
    steps: torch.Tensor, answer_rows: Sequence[Sequence[torch.Tensor]], done: Sequence[bool], specials: TextSpecials
) -> torch.Tensor:
    """Text rows [B, E] for B requests' decode steps (``steps`` [B], host ints).

    answer_rows[b]: the n_b Thinker rows ([E] each; a [n_b, E] tensor or a tuple) of request b's fed-back answer
    tokens so far (row 0 = first answer token, which the prefill consumed); done[b]: its Thinker has finished,
    so n_b is final.
    """
    out = []
    for step, rows, finished in zip(steps.tolist(), answer_rows, done):
        idx = step + 1
        n = len(rows)
        if idx < n:
            out.append(rows[idx])
        elif not finished:
            raise ValueError(f"text row {idx} is not available yet ({n} answer rows, answer still streaming)")
        else:
            out.append(specials.eos if idx == n else specials.pad)
    return torch.stack(out)
