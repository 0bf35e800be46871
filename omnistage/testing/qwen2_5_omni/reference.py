"""transformers' Qwen2.5-Omni as the float32 reference (tests, benchmarks), and the explicit Talker mask.

``generate`` drops an all-ones attention mask before the model runs, and the Talker adds the codec pad/bos
embeddings to its last two prefill rows only when it gets a mask; so an unpadded request runs without them
while the same request padded in a batch runs with them. ``explicit_talker_mask`` makes every Talker forward
receive the mask ``generate`` would have carried (ones over cache + new rows) — the reference behaviour
omnistage follows (see ``omnistage.models.qwen2_5_omni.talker_inputs``).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from omnistage.models.qwen2_5_omni.loading import quiet_config_checks
from omnistage.testing.reference import fresh_rotaries


@functools.cache
def tiny_checkpoint() -> Path:
    """The tiny Qwen2.5-Omni checkpoint (seed 0), built once per process into a temporary directory that is
    removed at exit (the tests' shared checkpoint)."""
    from omnistage.checkpoints.qwen2_5_omni.builder import build_checkpoint

    out = Path(tempfile.mkdtemp(prefix="omnistage-q25-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    return build_checkpoint(out, preset="tiny", seed=0)


@functools.cache
def _load(path: str):
    from transformers import Qwen2_5OmniForConditionalGeneration

    with quiet_config_checks():
        model = Qwen2_5OmniForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def load_hf_reference(path: str | Path):
    """``Qwen2_5OmniForConditionalGeneration`` in float32, eval mode, cached per resolved path (shared: do not
    modify). Greedy speech with the checkpoint's own ids: ``generate(ids, speaker=..., thinker_do_sample=False,
    talker_do_sample=False, talker_eos_token_id=[codec_pad, codec_eos], talker_max_new_tokens=n)``; each call
    hands it back as freshly loaded (``reference.fresh_rotaries``)."""
    return fresh_rotaries(_load(str(Path(path).resolve())))


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

    with _shadowed(talker, "forward", forward):
        yield


def reference_speech(
    path: str | Path, prompt_ids: list[int], text_tokens: int, codes: int, seed: int, speaker: str = "Chelsie"
) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy ``generate`` with speech for one prompt: (its generated text ids, waveform), the ODE
    noise seeded as omnistage seeds a request's (``seed``), the checkpoint's EOS ids ending the text, the codec
    pad / end ids the speech; 1.05 is transformers' own default Talker repetition penalty."""
    hf = load_hf_reference(path)
    tc = hf.config.talker_config
    eos = json.loads((Path(path) / "generation_config.json").read_text())["eos_token_id"]
    torch.manual_seed(seed)
    with torch.no_grad(), explicit_talker_mask(hf):
        seq, wav = hf.generate(
            torch.tensor([prompt_ids]), speaker=speaker, thinker_max_new_tokens=text_tokens,
            thinker_eos_token_id=eos, thinker_do_sample=False, talker_do_sample=False, talker_max_new_tokens=codes,
            talker_eos_token_id=[tc.tts_codec_pad_token_id, tc.tts_codec_end_token_id],
        )
    return seq[0, len(prompt_ids):].tolist(), wav.reshape(-1)


@contextlib.contextmanager
def codes_only(model) -> Iterator[None]:
    """Within the block, ``generate`` stops at the Talker's codes: Token2Wav is not run (one silent sample per
    code comes back instead of the waveform)."""
    with _shadowed(model.token2wav, "forward", lambda code, **_: torch.zeros(code.shape[-1])):
        yield


@contextlib.contextmanager
def _shadowed(owner: Any, attr: str, value: Any) -> Iterator[None]:
    """``owner.<attr>`` is ``value`` within the block; after it, whatever the instance held before (another
    wrapper, e.g. a benchmark's timer) or, if nothing, its class's attribute again."""
    had = attr in vars(owner)
    before = vars(owner).get(attr)
    setattr(owner, attr, value)
    try:
        yield
    finally:
        if had:
            setattr(owner, attr, before)
        else:
            delattr(owner, attr)
