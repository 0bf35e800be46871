"""At the released Qwen3-Omni widths: every width, head count, head_dim, expert count and top-k, the 16 code groups,
Code2Wav's decoder of 1536 and the 152064-token vocabulary of Qwen3-Omni-30B-A3B, one layer per stack (1.74 B
parameters, 3.5 GB in bfloat16; CI's budget holds one such model at a time in float32).

- transformers' greedy spoken answer equals ours with the reference kernels (``fast=False``): text tokens and codec
  codes exactly, the waveform within 1e-4;
- the default configuration (``fast``, the kernels this CPU chooses) equals the reference kernels for concurrent
  requests, greedy and seeded: text tokens and codes exactly, audio within 1e-4;
- Code2Wav's output at these widths (random weights scaled by the builder) stays inside (-1, 1).
"""

from __future__ import annotations

import gc
import shutil

import pytest
import torch
from transformers import AutoTokenizer

from omnistage.checkpoints.real import build_real_checkpoint, parse_depth
from omnistage.core.sampling_params import SamplingParams
from omnistage.pipeline.memory_plan import available_bytes
from omnistage.pipeline.omni import Omni
from omnistage.testing.reference import captured_codes, load_hf_model

DEPTH = "thinker=1,talker=1,code_predictor=1,code2wav=1,audio=1,vision=1"
THINKER_TOKENS = 3
TALKER_TOKENS = 7
PROMPTS = ["Hi there, how are you?", "What is the weather like tomorrow in town?"]
NEEDS_BYTES = 10 << 30  # one float32 model (7 GB) and its activations


@pytest.fixture(scope="module")
def real_ckpt(tmp_path_factory):
    if (available_bytes("cpu") or 0) < NEEDS_BYTES:
        pytest.skip(f"released widths need {NEEDS_BYTES >> 30} GiB of available memory")
    out = build_real_checkpoint(tmp_path_factory.mktemp("released") / "ckpt", depth=parse_depth(DEPTH), seed=0)
    before = torch.get_num_threads()
    torch.set_num_threads(max(2, before))  # one 2048-wide MoE layer is not per-op overhead bound
    yield out
    torch.set_num_threads(before)
    shutil.rmtree(out, ignore_errors=True)


def _params(mode: str) -> dict[str, SamplingParams]:
    n = THINKER_TOKENS
    if mode == "greedy":
        return {"thinker": SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n),
                "talker": SamplingParams(temperature=0.0, max_tokens=TALKER_TOKENS, repetition_penalty=1.0)}
    return {"thinker": SamplingParams(temperature=0.9, top_k=50, max_tokens=n, min_tokens=n, seed=11),
            "talker": SamplingParams(temperature=0.9, top_k=50, max_tokens=TALKER_TOKENS, seed=13)}


def _hf_spoken_answer(ckpt):
    """transformers' greedy generate(return_audio=True) for PROMPTS[0]: (answer ids, codes [Q, T], waveform)."""
    hf = load_hf_model(ckpt)
    try:
        tok = AutoTokenizer.from_pretrained(str(ckpt))
        ids = tok.apply_chat_template([{"role": "user", "content": PROMPTS[0]}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        with captured_codes(hf) as captured, torch.no_grad():
            seq, wav = hf.generate(
                ids, speaker="ethan", return_audio=True, thinker_max_new_tokens=THINKER_TOKENS,
                thinker_min_new_tokens=THINKER_TOKENS, thinker_eos_token_id=hf.config.im_end_token_id,
                thinker_do_sample=False, talker_max_new_tokens=TALKER_TOKENS, talker_do_sample=False,
                talker_repetition_penalty=1.0)
        return seq[0, ids.shape[1]:].tolist(), captured["codes"], wav.reshape(-1).float()
    finally:
        del hf
        gc.collect()


def _ours(ckpt, fast: bool) -> dict:
    with Omni(model=str(ckpt), fast=fast) as omni:
        out = {}
        for mode in ("greedy", "seeded"):
            results = omni.generate(PROMPTS, modalities=["text", "audio"], sampling_params=_params(mode),
                                    speaker="ethan")
            assert all(r.error is None for r in results), [r.error for r in results]
            out[mode] = [(r.token_ids, r.codes, r.audio) for r in results]
    gc.collect()
    return out


@pytest.fixture(scope="module")
def reference_kernels(real_ckpt):
    return _ours(real_ckpt, fast=False)


def test_spoken_answer_equals_transformers_at_the_released_widths(real_ckpt, reference_kernels):
    tokens, codes, wav = _hf_spoken_answer(real_ckpt)
    got_tokens, got_codes, got_audio = reference_kernels["greedy"][0]
    assert got_tokens == tokens
    assert got_codes.shape == codes.shape == (16, TALKER_TOKENS - 1) and torch.equal(got_codes, codes)  # (last: EOS)
    assert got_audio.shape == wav.shape and (got_audio - wav).abs().max().item() <= 1e-4
    # The builder scales the random weights so that the waveform is not saturated at the released widths.
    peak = wav.abs().max().item()
    assert 1e-3 < peak < 0.99, peak


def test_default_kernels_equal_the_reference_kernels_at_the_released_widths(real_ckpt, reference_kernels):
    got = _ours(real_ckpt, fast=True)
    for mode, rows in reference_kernels.items():
        for i, ((tokens, codes, audio), (t, c, a)) in enumerate(zip(rows, got[mode], strict=True)):
            assert t == tokens and len(t) == THINKER_TOKENS, (mode, i)
            assert c.shape == codes.shape and c.shape[0] == 16 and torch.equal(c, codes), (mode, i)
            assert a.shape == audio.shape and (a - audio).abs().max().item() <= 1e-4, (mode, i)
