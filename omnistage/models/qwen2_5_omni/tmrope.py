"""Qwen2.5-Omni's TMRoPE: 3-D prompt position ids and rope delta as transformers' ``get_rope_index`` computes
them, and the placeholder order of a video with its audio track.

Differences from Qwen3-Omni's rules (``qwen3_omni.mrope``), which this module otherwise shares (``MediaSpan``,
the float ``[P, 3]`` table and ``step_positions``):

- ids are integers: a video's temporal id is ``int(grid index * float32(seconds_per_grid) * 25)`` (truncated);
- a video with its audio track is cut into ``seconds_per_chunk`` (2 s, 50 temporal ids) chunks by temporal id,
  each chunk's video tokens then its audio tokens; its two opening tokens (``<|vision_bos|><|audio_bos|>``) share
  one id, as do its two closing ones;
- a prompt without images or videos is plain sequential even when it holds audio (delta 0).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from omnistage.models.qwen3_omni.mrope import MediaSpan, PromptPositions


def chunk_bounds(values: Sequence[float], per_chunk: int) -> list[tuple[int, int]]:
    """[start, end) index ranges of ``values`` (increasing temporal ids) per chunk of ``per_chunk`` ids, exactly
    as transformers' ``get_chunked_index``: a chunk closes at the first value reaching the next multiple (one
    multiple per value, so a jump over several chunks closes only one)."""
    out, start, chunk = [], 0, 1
    for i, v in enumerate(values):
        if v >= chunk * per_chunk:
            out.append((start, i))
            start, chunk = i, chunk + 1
    out.append((start, len(values)))
    return out


def _video_t(grid_t: int, seconds_per_grid: float, position_id_per_seconds: int) -> torch.Tensor:
    spg = torch.tensor(seconds_per_grid, dtype=torch.float32)
    return (torch.arange(grid_t) * spg * position_id_per_seconds).long()


def _vision_ids(st: int, grid_thw: tuple[int, int, int], merge: int, t_ids: torch.Tensor) -> torch.Tensor:
    """[3, t*h*w] ids in merge-block order."""
    t, h, w = grid_thw[0], grid_thw[1] // merge, grid_thw[2] // merge
    t_ids = t_ids.view(-1, 1, 1).expand(t, h, w)
    h_ids = torch.arange(h).view(1, -1, 1).expand(t, h, w)
    w_ids = torch.arange(w).view(1, 1, -1).expand(t, h, w)
    return torch.stack([t_ids.flatten(), h_ids.flatten(), w_ids.flatten()]) + st


def _seq(st: int, n: int) -> torch.Tensor:
    return torch.arange(n).view(1, -1).expand(3, -1) + st


def prompt_positions(
    num_tokens: int, spans: Sequence[MediaSpan], merge: int, position_id_per_seconds: int, seconds_per_chunk: float
) -> tuple[torch.Tensor, float]:
    """([num_tokens, 3] float32 ids, rope delta) for one prompt whose media spans are given in order."""
    if not any(s.kind != "audio" for s in spans):
        return torch.arange(num_tokens, dtype=torch.float32).view(-1, 1).expand(-1, 3).contiguous(), 0.0
    pieces: list[torch.Tensor] = []

    def next_id() -> int:
        return int(pieces[-1].max()) + 1 if pieces else 0

    cursor = 0
    per_chunk = int(position_id_per_seconds * seconds_per_chunk)
    for span in spans:
        text_len = span.start - cursor
        if text_len < 0:
            raise ValueError(f"media spans overlap or are out of order at token {span.start}")
        if text_len:
            pieces.append(_seq(next_id(), text_len))
        paired = span.kind == "video+audio"
        st = next_id()
        pieces += [_seq(st, 1)] * (2 if paired else 1)
        st = next_id()
        if span.kind == "audio":
            pieces.append(_seq(st, span.num_audio))
            body = span.num_audio
        elif span.kind == "image":
            t_ids = torch.arange(span.grid_thw[0]) * position_id_per_seconds
            pieces.append(_vision_ids(st, span.grid_thw, merge, t_ids))
            body = pieces[-1].shape[1]
        else:
            video = _vision_ids(st, span.grid_thw, merge,
                                _video_t(span.grid_thw[0], span.seconds_per_grid, position_id_per_seconds))
            body = video.shape[1]
            if not paired:
                pieces.append(video)
            else:
                audio = _seq(st, span.num_audio)
                v_chunks = chunk_bounds((video[0] - st).tolist(), per_chunk)
                a_chunks = chunk_bounds((audio[0] - st).tolist(), per_chunk)
                for j in range(max(len(v_chunks), len(a_chunks))):
                    if j < len(v_chunks):
                        pieces.append(video[:, v_chunks[j][0] : v_chunks[j][1]])
                    if j < len(a_chunks):
                        pieces.append(audio[:, a_chunks[j][0] : a_chunks[j][1]])
                body += span.num_audio
        eos = next_id()
        pieces += [_seq(eos, 1)] * (2 if paired else 1)
        cursor = span.start + (4 if paired else 2) + body
    if cursor > num_tokens:
        raise ValueError(f"media spans run past the prompt end ({cursor} > {num_tokens})")
    if cursor < num_tokens:
        pieces.append(_seq(next_id(), num_tokens - cursor))
    ids = torch.cat(pieces, dim=1)
    delta = float(int(ids.max()) + 1 - num_tokens)
    return ids.t().float().contiguous(), delta


def video_audio_order(
    grid: tuple[int, int, int], merge: int, seconds_per_grid: float, num_audio: int, position_id_per_seconds: int,
    seconds_per_chunk: float,
) -> list[bool]:
    """Placeholder order of a video with its audio track (True = video token), as ``Qwen2_5OmniProcessor``
    writes it: per chunk, its video tokens then its audio tokens (chunks by the float64 temporal ids)."""
    per_frame = (grid[1] // merge) * (grid[2] // merge)
    video_t = [g * seconds_per_grid * position_id_per_seconds for g in range(grid[0]) for _ in range(per_frame)]
    per_chunk = int(position_id_per_seconds * seconds_per_chunk)
    v_chunks = chunk_bounds(video_t, per_chunk)
    a_chunks = chunk_bounds(list(range(num_audio)), per_chunk)
    order: list[bool] = []
    for j in range(max(len(v_chunks), len(a_chunks))):
        if j < len(v_chunks):
            order += [True] * (v_chunks[j][1] - v_chunks[j][0])
        if j < len(a_chunks):
            order += [False] * (a_chunks[j][1] - a_chunks[j][0])
    return order


def talker_positions(thinker: PromptPositions) -> PromptPositions:
    """The Talker prompt's ids: the Thinker prompt's, then its two extra rows (speaker bos, first answer token)
    continuing the closing text; the same delta. (transformers runs ``get_rope_index`` over the Thinker's ids
    plus those two, and a prompt always ends in text: the assistant header.)"""
    last = thinker.table[-1]
    if not bool((last == last[0]).all()):
        raise ValueError("a Thinker prompt ends in text (equal ids on every axis)")
    extra = last[0] + torch.tensor([1.0, 2.0])
    return PromptPositions(torch.cat((thinker.table, extra[:, None].expand(-1, 3))), thinker.delta)
