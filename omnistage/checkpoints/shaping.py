"""Shape a random checkpoint so the built-in model behaves like a model that talks: words, ends, speaks.

Unshaped random weights answer with byte soup that runs to the token limit (greedy loops) and a Talker that
stops at a random frame, often the first. A few rows are rescaled at build time so that, under the packaged
default sampling, answers are whole words, most end on their own after tens of tokens, and the speech lasts
as long as the text (plus a short tail):

- Thinker ``lm_head``: rows of tokens that are not whole corpus words or punctuation are scaled down, so
  they rarely win; the ``<|im_end|>`` row is scaled up, so it wins at a few percent of the steps.
- Talker end of speech: after the answer's last text row the Talker is fed ``tts_eos`` and then ``tts_pad``
  rows (``text_projection`` of the Thinker's embeddings of those ids). The Thinker embedding of ``tts_pad``
  (read by nothing else) is scaled until its projected row dominates the Talker's input, and the
  ``codec_head`` row of ``codec_eos`` is pointed along it: end of speech becomes likely once the text is
  spoken and stays rare before.
- The pad rows also sit in the Talker's prefill, next to the speaker's codec embedding; the speaker rows
  are scaled to the same size, or every voice would sound the same.

Only values of existing tensors change: the checkpoint stays a valid Qwen3-Omni checkpoint (transformers
computes the same thing as omnistage on it). Token ids come from the config and the tokenizer.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from omnistage.checkpoints.corpus import training_corpus

# Chosen on the tiny preset (seed 0) over 24 short prompts with the packaged default sampling (Talker seeded
# per prompt): 20/24 answers end with EOS, median 33.5 tokens, median 2.5 s of speech, which mostly ends
# 1-4 frames after the text. Unshaped: 0/24 end within 256 tokens. tests/checkpoints/test_shaping.py checks it.
NON_WORD_GAIN = 0.3
THINKER_EOS_GAIN = 1.4
PAD_ROW_NORM = 100.0  # the Talker's decode input is ~30 (sum of 16 codec embeddings of norm 8)
SPEAKER_ROW_NORM = 100.0
CODEC_EOS_GAIN = 0.8
PUNCTUATION = (".", ",", "!", "?")


def word_token_ids(tok: Tokenizer) -> list[int]:
    """Ids of tokens that decode to a space + a whole word of the training corpus, or to punctuation."""
    words = set()
    for text in training_corpus():
        words.update(re.findall(r"[A-Za-z]+", text))
    out = []
    for i in range(tok.get_vocab_size(with_added_tokens=True)):
        s = tok.decode([i])
        if (re.fullmatch(r" [A-Za-z]+", s) and s[1:] in words) or s in PUNCTUATION:
            out.append(i)
    return out


def _project_text(state: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The Talker's text_projection (fc2(silu(fc1 x)), as in the model) on Thinker embedding rows."""
    p = "talker.text_projection."
    h = F.silu(x @ state[p + "linear_fc1.weight"].T + state[p + "linear_fc1.bias"])
    return h @ state[p + "linear_fc2.weight"].T + state[p + "linear_fc2.bias"]


def _scaled_to_projected_norm(state: dict[str, torch.Tensor], row: torch.Tensor, target: float) -> torch.Tensor:
    """The multiple of `row` whose projected row has norm `target` (bisection on the scale)."""
    lo, hi = 0.0, 1.0
    while _project_text(state, row * hi).norm() < target:
        hi *= 2
        if hi > 1e6:
            raise RuntimeError("the text projection does not grow with its input")
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _project_text(state, row * mid).norm() < target else (lo, mid)
    return row * hi


def shape_weights(state: dict[str, torch.Tensor], config: dict, tok: Tokenizer) -> None:
    """Rescale rows of the float32, hub-named `state` in place (see the module docstring)."""
    head = state["thinker.lm_head.weight"]
    eos = int(config["im_end_token_id"])
    words = torch.zeros(head.shape[0], dtype=torch.bool)
    words[word_token_ids(tok)] = True
    keep = words.clone()
    keep[eos] = True
    head[~keep] *= NON_WORD_GAIN
    head[eos] *= THINKER_EOS_GAIN

    if "talker.codec_head.weight" not in state:
        return
    embed = state["thinker.model.embed_tokens.weight"]
    pad = int(config["tts_pad_token_id"])
    embed[pad] = _scaled_to_projected_norm(state, embed[pad], PAD_ROW_NORM)
    pad_row = _project_text(state, embed[pad])
    # Remove the part every projected text row shares, so ordinary text rows do not lean towards the end.
    shared = _project_text(state, embed[words]).mean(0)
    shared = shared / shared.norm()
    direction = pad_row - (pad_row @ shared) * shared
    direction = direction / direction.norm()
    talker = config["talker_config"]
    state["talker.codec_head.weight"][int(talker["codec_eos_token_id"])] = (
        CODEC_EOS_GAIN * direction / state["talker.model.norm.weight"]  # the final RMSNorm's gain is undone
    )
    codec = state["talker.model.codec_embedding.weight"]
    speakers = torch.tensor(sorted(int(i) for i in talker["speaker_id"].values()))
    codec[speakers] *= SPEAKER_ROW_NORM / codec[speakers].norm(dim=-1, keepdim=True)
