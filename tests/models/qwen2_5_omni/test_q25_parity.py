"""Qwen2.5-Omni parity with transformers (tiny checkpoint, float32): Thinker logits and greedy tokens, Talker
greedy codes from the same Thinker output (explicit mask), Token2Wav waveform from the same codes and noise."""

from __future__ import annotations

import pytest
import torch
from q25_reference import (
    SPEAKER,
    TALKER_NEW_TOKENS,
    THINKER_NEW_TOKENS,
    PagedKV,
    Reference,
    loaded,
    prompt_ids,
    reference,
)

from omnistage.core.sampling_params import SamplingParams
from omnistage.models.qwen2_5_omni.talker_inputs import (
    build_prefill,
    prefill_ids,
    text_rows_for_steps,
    text_specials,
)
from omnistage.models.qwen2_5_omni.token2wav import NoiseStream
from omnistage.runner.sampler import SamplingRow, apply_repetition_penalty
from omnistage.testing.qwen2_5_omni.reference import codes_only

TOL = 1e-4


def _thinker_chunks(chunks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt through our Thinker in the given chunks: (logits, talker rows) over all rows."""
    th = loaded().thinker
    ids = prompt_ids()[0]
    kv = PagedKV.for_model(th)
    logits, rows, pos = [], [], 0
    for n in chunks:
        out = th(ids[pos : pos + n], torch.arange(pos, pos + n), kv.kv, kv.meta(["r"], [n]))
        logits.append(th.compute_logits(out.hidden))
        rows.append(out.talker_rows)
        pos += n
    assert pos == ids.shape[0]
    return torch.cat(logits), torch.cat(rows)


@torch.no_grad()
def test_thinker_prompt_logits_and_talker_rows():
    ref = reference()
    p = ref.prompt_ids.shape[0]
    for chunks in ([p], [5, p - 12, 7], [1] * p):
        logits, rows = _thinker_chunks(chunks)
        assert (logits - ref.prompt_logits).abs().max().item() <= TOL, chunks
        # The Talker's prompt rows: embedding + final hidden, as generate() hands them over.
        assert (rows - ref.prompt_rows).abs().max().item() <= TOL, chunks


def _our_thinker_greedy(ref: Reference, ban_eos: bool) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Greedy decode with our Thinker: (tokens, prompt rows, rows of every fed-back token)."""
    th = loaded().thinker
    kv = PagedKV.for_model(th)
    ids = ref.prompt_ids
    p = ids.shape[0]
    out = th(ids, torch.arange(p), kv.kv, kv.meta(["r"], [p]))
    prompt_rows, fed, tokens = out.talker_rows, [], []
    last = out.hidden[-1:]
    for step in range(THINKER_NEW_TOKENS):
        logits = th.compute_logits(last)
        if ban_eos:
            logits[:, ref.thinker_eos] = float("-inf")
        tok = int(logits.argmax(-1))
        tokens.append(tok)
        if tok == ref.thinker_eos or step + 1 == THINKER_NEW_TOKENS:
            break
        out = th(torch.tensor([tok]), torch.tensor([p + step]), kv.kv, kv.meta(["r"], [1]))
        fed.append(out.talker_rows)
        last = out.hidden
    return tokens, prompt_rows, torch.cat(fed)


@pytest.mark.parametrize("stop", ["length", "eos"])
@torch.no_grad()
def test_thinker_greedy_tokens_and_fed_back_rows(stop):
    ref = reference(stop)
    tokens, prompt_rows, fed = _our_thinker_greedy(ref, ban_eos=stop == "length")
    assert tokens == ref.generated.tolist()
    if stop == "eos":
        assert tokens[-1] == ref.thinker_eos and len(tokens) < THINKER_NEW_TOKENS
    # Every generated token but the last is fed back; its row is what the Talker speaks.
    assert fed.shape[0] == len(tokens) - 1 == ref.answer_rows.shape[0]
    assert (fed - ref.answer_rows).abs().max().item() <= TOL
    assert (prompt_rows - ref.prompt_rows).abs().max().item() <= TOL


def _our_talker_greedy(prompt_rows: torch.Tensor, answer_rows: torch.Tensor, penalty: float) -> list[int]:
    """Prefill + paged decode of our Talker, greedy with transformers' penalty / suppression / EOS rules."""
    ld = loaded()
    tk, th = ld.talker, ld.thinker
    specials = text_specials(th.model.embed_tokens, tk.ids)
    bos = ld.hf.speaker_map[SPEAKER]["bos_token"]
    prefill = build_prefill(tk, prompt_rows, th.embed(torch.tensor(bos)), answer_rows[0])
    kv = PagedKV.for_model(tk)
    n = prefill.shape[0]
    hidden = tk(prefill, torch.arange(n), kv.kv, kv.meta(["r"], [n]))[-1:]
    history = prefill_ids(prompt_rows.shape[0], tk.ids)
    params = SamplingParams(temperature=0.0, repetition_penalty=penalty)
    codes: list[int] = []
    for step in range(TALKER_NEW_TOKENS):
        logits = apply_repetition_penalty(tk.compute_logits(hidden).float(), [SamplingRow(params, None, history + codes)])
        code = int(logits.argmax(-1))
        if code in tk.ids.eos_ids:
            break
        codes.append(code)
        text = text_rows_for_steps(torch.tensor([step]), [answer_rows], [True], specials)
        hidden = tk(tk.embed_codec(torch.tensor([code])) + text, torch.tensor([n + step]), kv.kv, kv.meta(["r"], [1]))
    return codes


@pytest.mark.parametrize("stop,penalty", [("length", 1.0), ("eos", 1.0), ("length", 1.05)])
@torch.no_grad()
def test_talker_greedy_codes_equal_reference(stop, penalty):
    """Same Thinker output (the reference's rows) -> exactly the reference Talker's codes, including the
    repetition penalty over the prompt's codec_mask/pad/bos ids and the text rows running out into
    tts_text_end / tts_text_pad (the Thinker's answer is shorter than the Talker's run)."""
    ref = reference(stop, penalty)
    assert ref.talker_prompt_len == ref.prompt_ids.shape[0] + 2
    assert len(ref.codes) > ref.answer_rows.shape[0] + 2  # the run goes past the end of the text
    assert _our_talker_greedy(ref.prompt_rows, ref.answer_rows, penalty) == ref.codes


@torch.no_grad()
def test_talker_codes_from_our_thinker_equal_reference():
    ref = reference("eos")
    _, prompt_rows, fed = _our_thinker_greedy(ref, ban_eos=False)
    assert _our_talker_greedy(prompt_rows, fed, 1.0) == ref.codes


@torch.no_grad()
def test_reference_without_mask_skips_codec_pad_bos():
    """The batch-1 trap we do not follow: generate() drops the all-ones mask and the reference Talker then
    runs without the codec pad/bos embeddings, which changes its very first code."""
    ld = loaded()
    tc = ld.config.talker_config
    ref = reference()
    with codes_only(ld.hf):
        ld.hf.generate(
            prompt_ids(), speaker=SPEAKER, thinker_max_new_tokens=THINKER_NEW_TOKENS,
            thinker_min_new_tokens=THINKER_NEW_TOKENS, thinker_eos_token_id=ref.thinker_eos, thinker_do_sample=False,
            talker_do_sample=False, talker_max_new_tokens=2, talker_repetition_penalty=1.0,
            talker_eos_token_id=[tc.tts_codec_pad_token_id, tc.tts_codec_end_token_id],
        )
    unmasked = ld.cap.talker_result[0, ref.talker_prompt_len :].tolist()
    assert unmasked[0] != ref.codes[0]


@torch.no_grad()
def test_token2wav_waveform_matches_reference():
    """Same codes, same initial noise (our per-request generator seeded like the reference's global one)."""
    ld = loaded()
    codes = torch.tensor(reference().codes[:27])  # odd length: a partial last DiT block
    spk = ld.hf.speaker_map[SPEAKER]
    seed = 1234
    torch.manual_seed(seed)
    mel_ref = ld.hf.token2wav.code2wav_dit_model.sample(spk["cond"].float(), spk["ref_mel"].float(), codes[None])
    wave_ref = ld.hf.token2wav.code2wav_bigvgan_model(mel_ref)
    t2w = ld.token2wav
    noise = NoiseStream(torch.Generator().manual_seed(seed), t2w.mel_dim)
    # Drawn in pieces as a stream would (one code, then the rest): the same values as one draw.
    noise = torch.cat((noise.take(t2w.repeats), noise.take((codes.numel() - 1) * t2w.repeats)))
    with torch.inference_mode():
        mel = t2w.mel(codes[None], noise[None], [SPEAKER])
        wave = t2w(codes[None], noise[None], [SPEAKER])[0]
    assert (mel - mel_ref).abs().max().item() <= TOL
    assert wave.shape == wave_ref.shape == (codes.numel() * t2w.repeats * t2w.hop,)
    assert (wave - wave_ref).abs().max().item() <= TOL
    # Non-degenerate audio: not silent, rarely clipped.
    assert wave.std().item() > 0.05 and (wave.abs() >= 1).float().mean().item() < 0.01
