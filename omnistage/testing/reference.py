"""The transformers reference model for parity tests, loaded once per checkpoint directory; building a
transformers processor from parts."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path

import torch


def load_hf_model(path: str | Path):
    """`Qwen3OmniMoeForConditionalGeneration` in float32, eval mode, not cached (the caller owns it: e.g. a
    released-width model freed before the engine under test loads)."""
    from transformers import Qwen3OmniMoeForConditionalGeneration
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # mrope keys draw a spurious rope_parameters warning
    try:
        model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32)
    finally:
        hf_logging.set_verbosity(level)
    return model.eval()


def load_hf_reference(path: str | Path):
    """`Qwen3OmniMoeForConditionalGeneration` in float32, eval mode, cached per resolved path.

    Shared between callers: do not modify it. Greedy audio generation needs the checkpoint's own ids, e.g.
    `generate(ids, return_audio=True, thinker_max_new_tokens=n, thinker_eos_token_id=config.im_end_token_id,
    thinker_do_sample=False, talker_do_sample=False, talker_repetition_penalty=1.0, speaker="ethan",
    talker_max_new_tokens=m)`. Each call hands it back as freshly loaded (``fresh_rotaries``).
    """
    return fresh_rotaries(_cached(str(Path(path).resolve())))


_cached = functools.cache(load_hf_model)


def fresh_rotaries(model):
    """``model`` with its rotary modules as loaded: transformers' dynamic rope modules keep the frequencies of the
    longest forward they saw until a forward shorter than their original length resets them, so a cached model's
    next generate would depend on the previous one's."""
    for m in model.modules():
        if hasattr(m, "original_inv_freq") and hasattr(m, "max_seq_len_cached"):
            m.register_buffer("inv_freq", m.original_inv_freq.clone(), persistent=False)
            m.max_seq_len_cached = m.original_max_seq_len
    return model


@contextlib.contextmanager
def captured_codes(hf) -> Iterator[dict]:
    """While open, each ``hf.generate(..., return_audio=True)`` leaves the codes it hands Code2Wav ([Q, T], the
    first batch row) under ``"codes"`` of the yielded dict (the model's own method is back on exit)."""
    captured: dict = {}
    original = hf.code2wav.chunked_decode

    def catch(codes, **kw):
        captured["codes"] = codes[0].clone()
        return original(codes, **kw)

    hf.code2wav.chunked_decode = catch
    try:
        yield captured
    finally:
        del hf.code2wav.chunked_decode  # back to the class's method


@contextlib.contextmanager
def lenient_processor_components() -> Iterator[None]:
    """Within the block, a transformers processor accepts components of any class (the media tests give it a
    stand-in for its torchvision-only video processor)."""
    from transformers.processing_utils import ProcessorMixin

    original = ProcessorMixin.check_argument_for_proper_class
    ProcessorMixin.check_argument_for_proper_class = lambda self, name, arg: type(arg)
    try:
        yield
    finally:
        ProcessorMixin.check_argument_for_proper_class = original
