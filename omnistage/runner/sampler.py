"""Batched sampling with per-request parameters and per-request random streams.

Logit transforms run on the whole batch at once, in this order (vLLM's): logit bias, repetition penalty
(HF), frequency / presence penalties (OpenAI), bans (e.g. EOS before min_tokens), temperature, top-k, top-p. Randomness comes from each request's own ``torch.Generator``: the Gumbel/exponential race draws one
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
    # The ids this request generated so far: what the frequency / presence penalties count (OpenAI: "how
    # often the token was sampled"). None = the runner passes only `history`, which is counted instead.
    output: Sequence[int] | None = None


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def _token_matrix(seqs: Sequence[Sequence[int]], vocab: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) index tensors of every id in ``seqs`` that lies inside the vocabulary."""
    # One C-level list->tensor conversion per row (histories can be thousands of tokens).
    hist = [(i, torch.as_tensor(seq, dtype=torch.long)) for i, seq in enumerate(seqs) if len(seq)]
    if not hist:
        empty = torch.empty(0, dtype=torch.long, device=device)
        return empty, empty
    cols = torch.cat([h for _, h in hist])
    row_ids = torch.repeat_interleave(torch.tensor([i for i, _ in hist]), torch.tensor([len(h) for _, h in hist]))
    keep = (cols >= 0) & (cols < vocab)
    return row_ids[keep].to(device), cols[keep].to(device)


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """OpenAI semantics: the bias is added to the model's logit of that token (ids outside the vocabulary
    are ignored here; the API rejects them before admission)."""
    vocab = logits.shape[1]
    entries = [(i, tok, bias) for i, r in enumerate(rows) for tok, bias in r.params.logit_bias if tok < vocab]
    if not entries:
        return logits
    rr, tt, bb = zip(*entries)
    bias = torch.zeros_like(logits)
    bias[torch.tensor(rr, device=logits.device), torch.tensor(tt, device=logits.device)] = torch.tensor(
        bb, dtype=logits.dtype, device=logits.device)
    return logits + bias


def apply_repetition_penalty(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """HF semantics: for seen ids, positive logits are divided by the penalty, negative ones multiplied."""
    penalties = [r.params.repetition_penalty for r in rows]
    if all(p == 1.0 for p in penalties):
        return logits
    seen = torch.zeros_like(logits, dtype=torch.bool)
    row_ids, cols = _token_matrix([r.history if r.params.repetition_penalty != 1.0 else () for r in rows],
                                  logits.shape[1], logits.device)
    seen[row_ids, cols] = True
    p = torch.tensor(penalties, dtype=logits.dtype, device=logits.device)[:, None]
    penalized = torch.where(logits > 0, logits / p, logits * p)
    return torch.where(seen, penalized, logits)


def apply_frequency_presence_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """OpenAI semantics: ``logit[j] -= count[j] * frequency_penalty + (count[j] > 0) * presence_penalty``,
    where ``count[j]`` is how often token j was generated so far."""
    freq = [r.params.frequency_penalty for r in rows]
    pres = [r.params.presence_penalty for r in rows]
    if not any(freq) and not any(pres):
        return logits
    seqs = [(r.output if r.output is not None else r.history) if f or p else ()
            for r, f, p in zip(rows, freq, pres)]
    row_ids, cols = _token_matrix(seqs, logits.shape[1], logits.device)
    counts = torch.zeros_like(logits).index_put_((row_ids, cols), torch.ones_like(cols, dtype=logits.dtype),
                                                 accumulate=True)
    f = torch.tensor(freq, dtype=logits.dtype, device=logits.device)[:, None]
    p = torch.tensor(pres, dtype=logits.dtype, device=logits.device)[:, None]
    return logits - counts * f - (counts > 0).to(logits.dtype) * p


def adjust_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Bias, penalties and bans, batched: what changes a greedy row's pick. Returns float32 logits."""
    logits = apply_logit_bias(logits.float(), rows)
    logits = apply_repetition_penalty(logits, rows)
    logits = apply_frequency_presence_penalties(logits, rows)
    bans = [(i, t) for i, r in enumerate(rows) for t in r.banned]
    if bans:
        ii = torch.tensor(bans, dtype=torch.long, device=logits.device)
        logits = logits.index_put((ii[:, 0], ii[:, 1]), torch.tensor(float("-inf"), device=logits.device))
    return logits


def process_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Bias, penalties, bans, temperature, top-k and top-p, batched. Returns float32 logits (-inf = excluded)."""
    logits = adjust_logits(logits, rows)
    # Greedy rows (including temperatures below GREEDY_TEMPERATURE_EPS) are not scaled: argmax only.
    temps = torch.tensor([1.0 if r.params.greedy else r.params.temperature for r in rows], dtype=logits.dtype,
                         device=logits.device)
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
    if all(r.params.greedy for r in rows):  # (temperature, top-k and top-p keep the argmax)
        return adjust_logits(logits, rows).argmax(-1)
    processed = process_logits(logits, rows)
    greedy = torch.tensor([r.params.greedy for r in rows], device=logits.device)
    probs = processed.softmax(-1)
    noise = torch.ones_like(probs)
    for i, r in enumerate(rows):
        if not r.params.greedy:
            noise[i].exponential_(generator=r.generator)
    drawn = (probs / noise).argmax(-1)
    return torch.where(greedy, processed.argmax(-1), drawn)
