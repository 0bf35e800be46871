"""transformers' Qwen2.5-Omni as the float32 reference (tests, benchmarks), and the explicit Talker mask.

``generate`` drops an all-ones attention mask before the model runs, and the Talker adds the codec pad/bos
embeddings to its last two prefill rows only when it gets a mask; so an unpadded request runs without them
while the same request padded in a batch runs with them. ``explicit_talker_mask`` makes every Talker forward
receive the mask ``generate`` would have carried (ones over cache + new rows) — the reference behaviour
omnistage follows (see ``omnistage.models.qwen2_5_omni.talker_inputs``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path

import torch


@functools.cache
def _load(path: str):
    from transformers import Qwen2_5OmniForConditionalGeneration
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the talker's text-side ids lie past its vocab, as in the real config
    try:
        model = Qwen2_5OmniForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    finally:
        hf_logging.set_verbosity(level)
    return model.eval()


def load_hf_reference(path: str | Path):
    """``Qwen2_5OmniForConditionalGeneration`` in float32, eval mode, cached per resolved path (shared: do not
    modify). Greedy speech with the checkpoint's own ids: ``generate(ids, speaker=..., thinker_do_sample=False,
    talker_do_sample=False, talker_eos_token_id=[codec_pad, codec_eos], talker_max_new_tokens=n)``."""
    return _load(str(Path(path).resolve()))


@contextlib.contextmanager
def explicit_talker_mask(model) -> Iterator[None]:
    """Within the block, every Talker forward without a mask gets an all-ones one of its full length."""
    talker = model.talker
    original = talker.forward

    @functools.wraps(original)  # generate() validates its kwargs against the forward's signature
    def forward(*args, **kwargs):
        if kwargs.get("attention_mask") is None:
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            past = cache.get_seq_length() if cache is not None else 0
            rows = kwargs.get("inputs_embeds")
            rows = kwargs["input_ids"] if rows is None else rows
            kwargs["attention_mask"] = torch.ones(rows.shape[0], past + rows.shape[1], dtype=torch.long)
        return original(*args, **kwargs)

    talker.forward = forward
    try:
        yield
    finally:
        del talker.forward
