"""Qwen3-Omni's 3-D multimodal rotary positions (MRoPE): per-prompt position ids and the rotary tables.

Positions are float: a video's temporal ids are ``grid index * seconds_per_grid * position_id_per_seconds``,
which is fractional for most frame rates, and everything after it inherits the fraction (transformers keeps
them as float32 too). Text rows have equal ids on all three axes, so a 1-D position is the same thing.

``prompt_positions`` follows transformers' ``get_rope_index`` piece by piece, including its rules that
are easy to get wrong: the id after a media span is ``max(last piece) + 1`` (the last piece appended, not the
whole prefix); a video with its audio track interleaves the two by temporal id, video first on ties; a prompt
without images or videos is plain sequential even when it holds audio (then the delta is 0).

``step_positions`` gives a batched step's rows their ids from each request's ``PromptPositions`` (prompt rows
from the table, later rows at ``index + delta``); the Thinker and the Talker stage models both use it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from omnistage.models.layers.rotary import LengthScaling, RotaryEmbedding, cos_sin


@dataclass(frozen=True)
class MediaSpan:
    """One media item of a prompt, as the position rules see it.

    kind: "audio", "image", "video" or "video+audio" (a video interleaved with its own audio track).
    start: index of the item's first special token (``<|audio_start|>`` or ``<|vision_start|>``).
    grid_thw: the vision grid (patches) for image/video, None for audio.
    num_audio: audio placeholder count (audio, video+audio).
    seconds_per_grid: seconds one temporal grid step covers (video, video+audio).
    """

    kind: str
    start: int
    grid_thw: tuple[int, int, int] | None = None
    num_audio: int = 0
    seconds_per_grid: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("audio", "image", "video", "video+audio"):
            raise ValueError(f"unknown media kind {self.kind!r}")
        if self.kind != "audio" and self.grid_thw is None:
            raise ValueError(f"a {self.kind} span needs its grid_thw")


def _vision_grid(st: torch.Tensor, grid_thw: tuple[int, int, int], merge: int, t_ids: torch.Tensor) -> torch.Tensor:
    """[3, t*h*w] ids of a vision span in merge-block order: t = st + t_ids[g], (h, w) = st + block grid."""
    t, h, w = grid_thw[0], grid_thw[1] // merge, grid_thw[2] // merge
    t_ids = t_ids.float().view(-1, 1, 1).expand(t, h, w)
    h_ids = torch.arange(h, dtype=torch.float32).view(1, -1, 1).expand(t, h, w)
    w_ids = torch.arange(w, dtype=torch.float32).view(1, 1, -1).expand(t, h, w)
    return torch.stack([t_ids.flatten(), h_ids.flatten(), w_ids.flatten()]) + st


def _seq(st: torch.Tensor, n: int) -> torch.Tensor:
    return torch.arange(n).view(1, -1).expand(3, -1) + st


def prompt_positions(
    num_tokens: int, spans: Sequence[MediaSpan], spatial_merge_size: int, position_id_per_seconds: float
) -> tuple[torch.Tensor, float]:
    """([num_tokens, 3] float32 ids, rope delta) for one prompt whose media spans are given in order.

    Arithmetic is float32 step by step as transformers does it (a running float32 start id), so fractional
    video ids round the same way. Decode positions continue at ``index + delta`` on all three axes.
    """
    if not any(s.kind != "audio" for s in spans):
        return torch.arange(num_tokens, dtype=torch.float32).view(-1, 1).expand(-1, 3).contiguous(), 0.0
    pieces: list[torch.Tensor] = []
    cursor = 0  # next token index not yet given a position

    def next_id() -> torch.Tensor:
        return pieces[-1].float().max() + 1 if pieces else torch.tensor(0.0)

    for span in spans:
        st = next_id()
        text_len = span.start - cursor
        if text_len < 0:
            raise ValueError(f"media spans overlap or are out of order at token {span.start}")
        if text_len:
            pieces.append(_seq(st, text_len))
            st = st + text_len
        bos = eos = 2 if span.kind == "video+audio" else 1
        pieces.append(_seq(st, bos))
        st = st + bos
        if span.kind == "audio":
            pieces.append(_seq(st, span.num_audio))
            body = span.num_audio
        elif span.kind == "image":
            t_ids = torch.arange(span.grid_thw[0]) * 1 * position_id_per_seconds
            pieces.append(_vision_grid(st, span.grid_thw, spatial_merge_size, t_ids))
            body = pieces[-1].shape[1]
        else:
            # transformers: arange(t) * float32(seconds_per_grid) * position_id_per_seconds
            spg = torch.tensor(span.seconds_per_grid, dtype=torch.float32)
            t_ids = torch.arange(span.grid_thw[0]) * spg * position_id_per_seconds
            video = _vision_grid(st, span.grid_thw, spatial_merge_size, t_ids)
            body = video.shape[1]
            if span.kind == "video":
                pieces.append(video)
            else:
                audio = _seq(st, span.num_audio)
                pieces.extend(_interleave(video, audio))
                body += span.num_audio
        pieces.append(_seq(next_id(), eos))
        cursor = span.start + bos + body + eos
    if cursor > num_tokens:
        raise ValueError(f"media spans run past the prompt end ({cursor} > {num_tokens})")
    if cursor < num_tokens:
        pieces.append(_seq(next_id(), num_tokens - cursor))
    ids = torch.cat([p.float() for p in pieces], dim=1)
    delta = float(ids.max() + 1 - num_tokens)
    return ids.t().contiguous(), delta


def _interleave(video: torch.Tensor, audio: torch.Tensor) -> list[torch.Tensor]:
    """Merge two id streams by temporal id (video first on ties) into the pieces transformers appends:
    one column at a time while both have ids left, then the remaining tail of either as one piece."""
    vt, at = video[0].tolist(), audio[0].tolist()
    out: list[torch.Tensor] = []
    i = j = 0
    while i < len(vt) and j < len(at):
        if vt[i] <= at[j]:
            out.append(video[:, i : i + 1])
            i += 1
        else:
            out.append(audio[:, j : j + 1])
            j += 1
    if i < len(vt):
        out.append(video[:, i:])
    if j < len(at):
        out.append(audio[:, j:])
    return out


def interleaved_order(num_video: int, video_t: Sequence[float], num_audio: int) -> list[bool]:
    """Placeholder order of a video with its audio track: True = video token, False = audio token.

    ``video_t`` is each video token's temporal id (relative to the span start); audio token k has id k.
    """
    if len(video_t) != num_video:
        raise ValueError("one temporal id per video token")
    order: list[bool] = []
    i = j = 0
    while i < num_video and j < num_audio:
        if video_t[i] <= j:
            order.append(True)
            i += 1
        else:
            order.append(False)
            j += 1
    order.extend([True] * (num_video - i))
    order.extend([False] * (num_audio - j))
    return order


@dataclass(frozen=True)
class PromptPositions:
    """One request's 3-D prompt ids and where the rows after the prompt sit (decode: ``index + delta``)."""

    table: torch.Tensor  # [P, 3] float32 (T, H, W) ids of the prompt rows
    delta: float

    def __post_init__(self) -> None:
        if self.table.dim() != 2 or self.table.shape[1] != 3:
            raise ValueError(f"a prompt position table is [P, 3], got {tuple(self.table.shape)}")


def step_positions(
    positions: torch.Tensor,
    num_computed: Sequence[int],
    spans: Sequence[tuple[int, int]],
    prompts: Sequence[PromptPositions | None],
) -> torch.Tensor:
    """A batched step's rotary positions.

    positions: the runner's ``[N]`` plain indices (N may include padding rows past the real ones); request i
    owns rows ``spans[i]`` (contiguous, in batch order) starting at index ``num_computed[i]``; ``prompts[i]``
    None means plain indices. Returns float ``[N]`` when no row reads a table (text and decode rows: equal ids
    on the three axes), else ``[N, 3]``. Bookkeeping is on the host (no device read); one copy to the device.
    """
    if all(p is None for p in prompts):
        return positions.float()
    n = positions.shape[0]
    lens = torch.tensor([e - s for s, e in spans], dtype=torch.long)
    num_real = int(lens.sum())
    deltas = torch.tensor([0.0 if p is None else p.delta for p in prompts], dtype=torch.float32)
    row_delta = torch.zeros(n, dtype=torch.float32)
    row_delta[:num_real] = torch.repeat_interleave(deltas, lens)
    covered: list[tuple[int, int, int, torch.Tensor]] = []  # step row, prompt index, rows, table
    for (s, e), lo, p in zip(spans, num_computed, prompts):
        k = 0 if p is None else min(e - s, p.table.shape[0] - lo)  # this chunk's rows inside the prompt
        if k > 0:
            row_delta[s : s + k] = 0.0
            covered.append((s, lo, k, p.table))
    if not covered:
        return positions.float() + row_delta.to(positions.device)
    # index of every real row from the spans: its request's first index + its offset in the span
    starts = torch.tensor([s for s, _ in spans], dtype=torch.long)
    first = torch.tensor(list(num_computed), dtype=torch.long)
    base = torch.zeros(n, dtype=torch.float32)
    base[:num_real] = (torch.arange(num_real) + torch.repeat_interleave(first - starts, lens)).float()
    pos3 = (base + row_delta)[:, None].expand(-1, 3).contiguous()
    for s, lo, k, table in covered:
        pos3[s : s + k] = table[lo : lo + k]
    return pos3.to(positions.device)


def step_rope_freqs(
    rotary: RotaryEmbedding,
    positions: torch.Tensor,
    num_computed: Sequence[int],
    spans: Sequence[tuple[int, int]],
    prompts: Sequence[PromptPositions | None],
    num_prompt: Iterable[int],
) -> dict[str, torch.Tensor]:
    """``{"rope_freqs": each row's inverse frequencies}`` where ``rotary``'s follow the forward's length
    (``rotary.LengthScaling``), else nothing. A row's length is the forward's in transformers' generate: a
    prompt row's is its prompt's largest position + 1 (the prefill is one forward however the step chunks it),
    a later row's its own position + 1 (one decode forward each, also when recomputed after preemption).

    positions: the step's ``[N]`` or ``[N, 3]`` float positions (``step_positions``); request i owns rows
    ``spans[i]`` from index ``num_computed[i]``, its prompt has ``num_prompt[i]`` rows at ``prompts[i]``
    (None: plain indices; read only where the rope follows the length, so a caller may pass a generator). Padding
    rows get the base frequencies."""
    if rotary.length is None:
        return {}
    top = (positions if positions.dim() == 1 else positions.amax(dim=-1)).float().cpu()
    lengths = torch.zeros(positions.shape[0])
    for (s, e), lo, p, n in zip(spans, num_computed, prompts, num_prompt):
        in_prompt = torch.arange(lo, lo + e - s) < n
        lengths[s:e] = torch.where(in_prompt, _prompt_length(p, n), top[s:e] + 1.0)
    distinct, row_of = torch.unique(lengths, return_inverse=True)  # (a prefill's rows share one length)
    return {"rope_freqs": rotary.row_frequencies(distinct.tolist())[row_of].to(positions.device)}


def _prompt_length(prompt: PromptPositions | None, num_prompt: int) -> float:
    """The prefill forward's length: its largest position + 1."""
    return float(num_prompt) if prompt is None else float(prompt.table.max()) + 1.0


def rows_beyond_length(rotary: RotaryEmbedding, start: int, end: int, prompt: PromptPositions | None,
                       num_prompt: int) -> bool:
    """Whether any of a request's rows [start, end) has a forward length (``step_rope_freqs``) past the original
    one of ``rotary``'s length scaling: their keys then depend on how long that forward was, not on the rows
    alone (never, for a rope that does not follow the length)."""
    if rotary.length is None:
        return False
    original = rotary.length.original
    if start < num_prompt and _prompt_length(prompt, num_prompt) > original:
        return True
    delta = 0.0 if prompt is None else prompt.delta
    return end > num_prompt and end + delta > original  # the last decode row's position + 1


def mrope_sections(text_config: Any, head_dim: int) -> list[int]:
    """The config's ``mrope_section``, else transformers' default [24, 20, 20] (sized for head_dim 128)."""
    rope = getattr(text_config, "rope_parameters", None) or {}
    sections = rope.get("mrope_section")
    if sections:
        return list(sections)
    if head_dim != 128:
        raise ValueError(f"the text config has no mrope_section and head_dim {head_dim} != 128")
    return [24, 20, 20]


def mrope_axis_of_frequency(head_dim: int, sections: Sequence[int]) -> torch.Tensor:
    """[head_dim / 2] axis (0 = T, 1 = H, 2 = W) that drives each rotary frequency.

    Interleaved layout: H takes frequencies 1, 4, 7, ... below ``3 * sections[1]``, W takes 2, 5, 8, ... below
    ``3 * sections[2]``, T the rest.
    """
    half = head_dim // 2
    if len(sections) != 3 or sum(sections) != half:
        raise ValueError(f"mrope_section {list(sections)} must have 3 entries summing to head_dim / 2 = {half}")
    axis = torch.zeros(half, dtype=torch.long)
    for dim, offset in ((1, 1), (2, 2)):
        axis[offset : sections[dim] * 3 : 3] = dim
    return axis


def mrope_cos_sin(
    positions: torch.Tensor, rotary: RotaryEmbedding, axis: torch.Tensor, dtype: torch.dtype,
    freqs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [N, 3] (T, H, W ids) -> cos, sin [N, head_dim] for ``apply_rotary``, with ``rotary``'s
    frequencies (or each row's: ``freqs`` [N, head_dim / 2]) and scale."""
    pos = positions.float()[:, axis.to(positions.device)]  # [N, head_dim / 2]: each frequency's own axis
    angles = pos * (rotary.inv_freq if freqs is None else freqs).to(positions.device)
    return cos_sin(torch.cat((angles, angles), dim=-1), rotary.scale, dtype)


class MRopeRotary(RotaryEmbedding):
    """Rotary tables for ``[N]`` positions (equal ids on every axis: plain RoPE) or ``[N, 3]`` (T, H, W) ids."""

    def __init__(self, head_dim: int, theta: float, sections: Sequence[int], inv_freq: Sequence[float] | None = None,
                 scale: float = 1.0, length: LengthScaling | None = None) -> None:
        super().__init__(head_dim, theta, inv_freq, scale, length)
        self.axis = torch.nn.Buffer(mrope_axis_of_frequency(head_dim, sections), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype,
                freqs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 2:
            return mrope_cos_sin(positions, self, self.axis, dtype, freqs)
        return super().forward(positions, dtype, freqs)
