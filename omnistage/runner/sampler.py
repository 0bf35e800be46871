"""Batched sampling with per-request parameters and per-request random streams.

Logit transforms (repetition penalty, min-tokens masking, temperature, top-k, top-p) run on the whole batch
at once. Randomness comes from each request's own ``torch.Generator``: the Gumbel/exponential race draws one
noise row per request from that request's generator, so what a request samples never depends on which other
requests share its batch. Greedy rows take the argmax of the processed logits and draw nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from omnistage.core.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """What the sampler needs to know about one row of logits."""

    params: SamplingParams
    generator: torch.Generator | None
    history: Sequence[int] = ()  # prompt + output ids, for the repetition penalty
    banned: Sequence[int] = ()  # ids masked this step (e.g. EOS before min_tokens)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def apply_repetition_penalty(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """HF semantics: for seen ids, positive logits are divided by the penalty, negative ones multiplied."""
    penalties = [r.params.repetition_penalty for r in rows]
    if all(p == 1.0 for p in penalties):
        return logits
    vocab = logits.shape[1]
    seen = torch.zeros_like(logits, dtype=torch.bool)
    # One C-level list->tensor conversion per penalised row (histories can be thousands of tokens).
    hist = [(i, torch.as_tensor(r.history, dtype=torch.long)) for i, r in enumerate(rows)
            if r.params.repetition_penalty != 1.0 and len(r.history)]
    if hist:
        cols = torch.cat([h for _, h in hist])
        row_ids = torch.repeat_interleave(torch.tensor([i for i, _ in hist]), torch.tensor([len(h) for _, h in hist]))
        keep = cols < vocab
        seen[row_ids[keep].to(logits.device), cols[keep].to(logits.device)] = True
    p = torch.tensor(penalties, dtype=logits.dtype, device=logits.device)[:, None]
    penalized = torch.where(logits > 0, logits / p, logits * p)
    return torch.where(seen, penalized, logits)


def process_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Penalty, bans, temperature, top-k and top-p, batched. Returns float32 logits (-inf = excluded)."""
    logits = apply_repetition_penalty(logits.float(), rows)
    bans = [(i, t) for i, r in enumerate(rows) for t in r.banned]
    if bans:
        ii = torch.tensor(bans, dtype=torch.long, device=logits.device)
        logits = logits.index_put((ii[:, 0], ii[:, 1]), torch.tensor(float("-inf"), device=logits.device))
    temps = torch.tensor(
        [r.params.temperature if r.params.temperature > 0 else 1.0 for r in rows], device=logits.device
    )
    logits = logits / temps[:, None]
    vocab = logits.shape[1]
    top_k = torch.tensor(
        [r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rows], device=logits.device
    )
    top_p = torch.tensor([r.params.top_p for r in rows], device=logits.device)
    if bool((top_k < vocab).any()) or bool((top_p < 1.0).any()):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        drop = ranks >= top_k[:, None]
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always survives).
        mass_before = probs.cumsum(-1) - probs
        # top_p == 1 must keep everything: float32 cumsums reach 1.0 before the tail ends.
        drop |= (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    return logits


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """One token per row: ``[B, V]`` logits -> ``[B]`` ids."""
    if logits.shape[0] != len(rows):
        raise ValueError(f"{logits.shape[0]} logit rows but {len(rows)} sampling rows")
    if not rows:
        return torch.empty(0, dtype=torch.long, device=logits.device)
    processed = process_logits(logits, rows)
    greedy = torch.tensor([r.params.greedy for r in rows], device=logits.device)
    if bool(greedy.all()):
        return processed.argmax(-1)
    probs = processed.softmax(-1)
    noise = torch.ones_like(probs)
    for i, r in enumerate(rows):
        if not r.params.greedy:
            noise[i].exponential_(generator=r.generator)
    drawn = (probs / noise).argmax(-1)
    return torch.where(greedy, processed.argmax(-1), drawn)
