"""Talker + code predictor parity with transformers' generate(return_audio=True) (float32, same checkpoint).

Checked against what transformers really fed and computed (captured by hooks): the prefill rows and ids,
tts_pad / trailing text rows, talker logits and code-predictor logits teacher-forced, every decode input, and
the free-running greedy codes (exact), for a thinker that stops on its token limit and one that stops on EOS.
"""

from __future__ import annotations

import pytest
import torch
from omni_reference import PagedRequests, reference, single_thread

from omnistage.models.qwen3_omni.talker import Talker
from omnistage.models.qwen3_omni.talker_inputs import (
    TalkerTokenIds,
    build_talker_prefill,
    talker_decode_input,
    talker_text_rows,
    text_row_ready,
    text_specials,
)

RUNS = [("tiny", "length"), ("tiny", "eos"), ("tiny-gqa", "length")]
TOL = 1e-4


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with single_thread():
        yield


def argmax(logits: torch.Tensor, group: int) -> torch.Tensor:
    return logits.argmax(-1)


def _answer(ref):
    """Thinker embeddings of the embedded answer tokens: every generated token but the last."""
    p = ref.prompt_ids.shape[0]
    gen = ref.sequences[p:]
    if (gen == ref.thinker_eos).any():
        gen = gen[: int(torch.nonzero(gen == ref.thinker_eos)[0]) + 1]
    return ref.thinker.embed(gen[:-1])


def _prefill(ref):
    talker, thinker = ref.talker, ref.thinker
    ids = TalkerTokenIds.from_config(ref.config)
    specials = text_specials(talker, thinker.model.embed_tokens, ids)
    p = ref.prompt_ids.shape[0]
    answer = _answer(ref)
    embeds, input_ids = build_talker_prefill(
        talker, ids, ref.prompt_ids, thinker.embed(ref.prompt_ids), None, answer[0], ref.speaker_id, specials
    )
    assert embeds.shape[0] == input_ids.shape[0] and p > 0
    return embeds, input_ids, specials, talker.project_text(answer)


def talker_text_row(step: int, rows: torch.Tensor, done: bool, specials) -> torch.Tensor:
    """One decode step's text row from projected answer rows (``talker_text_rows`` of one step)."""
    return talker_text_rows([(step, rows, done)], lambda x: x, specials)[0]


def _cache(talker: Talker) -> PagedRequests:
    return PagedRequests(talker.cfg.num_layers, talker.cfg.num_kv_heads, talker.cfg.head_dim)


@pytest.mark.parametrize("preset, stop", RUNS)
@torch.no_grad()
def test_prefill_and_text_rows_match_generate(preset, stop):
    ref = reference(preset, stop)
    kw = ref.cap.talker_kwargs
    embeds, input_ids, specials, answer_rows = _prefill(ref)
    assert embeds.shape == kw["inputs_embeds"][0].shape
    assert (embeds - kw["inputs_embeds"][0]).abs().max().item() <= 1e-5
    assert torch.equal(input_ids, kw["talker_input_ids"][0])
    assert (specials.pad - kw["tts_pad_embed"][0, 0]).abs().max().item() <= 1e-6
    trailing = kw["trailing_text_hidden"][0]
    # Our rows for every decode step the reference ran, beyond the trailing rows too (-> tts_pad).
    steps = len(ref.cap.talker_steps) - 1
    rows = torch.stack(
        [talker_text_row(k, answer_rows, True, specials) for k in range(max(steps, trailing.shape[0]))]
    )
    assert (rows[: trailing.shape[0]] - trailing).abs().max().item() <= 1e-5
    assert torch.equal(rows[trailing.shape[0] - 1], specials.eos)
    assert all(torch.equal(r, specials.pad) for r in rows[trailing.shape[0] :])


def test_text_row_streaming_rules():
    ref = reference("tiny")
    specials = text_specials(
        ref.talker, ref.thinker.model.embed_tokens, TalkerTokenIds.from_config(ref.config)
    )
    rows = torch.arange(3 * 64, dtype=torch.float32).view(3, 64)
    assert text_row_ready(1, 3, False) and not text_row_ready(2, 3, False) and text_row_ready(5, 3, True)
    assert torch.equal(talker_text_row(0, rows, False, specials), rows[1])
    with pytest.raises(ValueError, match="not available"):
        talker_text_row(2, rows, False, specials)
    assert torch.equal(talker_text_row(2, rows, True, specials), specials.eos)
    assert torch.equal(talker_text_row(3, rows, True, specials), specials.pad)
    # several steps at once: the answer rows through one projection call, the specials as they are
    calls = []
    both = talker_text_rows([(0, rows, False), (4, rows, True), (1, rows, False), (2, None, True)],
                            lambda x: calls.append(x.shape[0]) or x * 2, specials)
    assert calls == [2] and torch.equal(both[0], rows[1] * 2) and torch.equal(both[2], rows[2] * 2)
    assert torch.equal(both[1], specials.pad) and torch.equal(both[3], specials.pad)


@pytest.mark.parametrize("preset, stop", RUNS)
@torch.no_grad()
def test_teacher_forced_talker_and_code_predictor_logits(preset, stop):
    """Feed transformers' own talker inputs; compare talker logits per step, code-predictor logits per group
    on the reference codes, and our decode-input construction against what generate fed next."""
    ref = reference(preset, stop)
    talker = ref.talker
    _, _, specials, answer_rows = _prefill(ref)
    steps = ref.cap.talker_steps
    frames = ref.codes
    q = talker.num_code_groups
    assert len(ref.cap.cp_steps) == frames.shape[0] * (q - 1)
    pr = _cache(talker)
    pos = 0
    hidden = None
    talker_diff = cp_diff = input_diff = 0.0
    for k, step in enumerate(steps):
        x = step["inputs_embeds"][0]
        if k > 0:
            # Code predictor on the previous hidden and the reference frame, teacher-forced.
            frame = frames[k - 1]
            seen = []

            def record(logits, group, seen=seen):
                seen.append(logits)
                return logits.argmax(-1)

            codes, embed_sum = talker.code_predictor.predict(
                hidden, frame[:1], talker.embed_codec(frame[:1]), record, forced_codes=frame[None, 1:]
            )
            assert torch.equal(codes[0], frame)
            for g, logits in enumerate(seen):
                ref_logits = ref.cap.cp_steps[(k - 1) * (q - 1) + g]["logits"][0, -1]
                cp_diff = max(cp_diff, (logits[0] - ref_logits).abs().max().item())
            ours_in = talker_decode_input(
                embed_sum, talker_text_row(k - 1, answer_rows, True, specials)[None]
            )
            input_diff = max(input_diff, (ours_in - x).abs().max().item())
        n = x.shape[0]
        h = talker(x, torch.arange(pos, pos + n), pr.kv, pr.meta(["r"], [n]))
        pos += n
        logits = talker.compute_logits(h, suppress=False)
        talker_diff = max(talker_diff, (logits - step["logits"][0]).abs().max().item())
        hidden = h[-1:]
    assert talker_diff <= TOL, talker_diff
    assert cp_diff <= TOL, cp_diff
    assert input_diff <= 1e-5, input_diff


@pytest.mark.parametrize("preset, stop", RUNS)
@torch.no_grad()
def test_free_running_greedy_codes_equal_reference(preset, stop):
    ref = reference(preset, stop)
    talker = ref.talker
    embeds, _, specials, answer_rows = _prefill(ref)
    max_new = ref.cap.talker_kwargs["max_new_tokens"]
    pr = _cache(talker)
    n = embeds.shape[0]
    hidden = talker(embeds, torch.arange(n), pr.kv, pr.meta(["r"], [n]))[-1:]
    code0 = talker.compute_logits(hidden).argmax(-1)
    sampled, frames = [int(code0)], []
    step = 0
    while len(sampled) < max_new and int(code0) != talker.codec_eos_id:
        codes, embed_sum = talker.predict_codes(hidden, code0, argmax)
        frames.append(codes[0])
        x = talker_decode_input(embed_sum, talker_text_row(step, answer_rows, True, specials)[None])
        hidden = talker(x, torch.tensor([n + step]), pr.kv, pr.meta(["r"], [1]))
        code0 = talker.compute_logits(hidden).argmax(-1)
        sampled.append(int(code0))
        step += 1
    assert sampled == ref.cap.talker_result.sequences[0].tolist()
    assert torch.equal(torch.stack(frames), ref.codes)


@torch.no_grad()
def test_suppressed_ids_match_generate():
    ref = reference("tiny")
    talker = ref.talker
    expected = set(ref.cap.talker_kwargs["suppress_tokens"])
    assert set(torch.nonzero(talker.suppressed).flatten().tolist()) == expected
    logits = talker.compute_logits(torch.randn(2, talker.cfg.hidden_size))
    assert torch.isinf(logits[:, sorted(expected)]).all()
    assert torch.isfinite(logits[:, talker.codec_eos_id]).all()


@pytest.mark.parametrize("preset", ["tiny", "tiny-gqa"])
@torch.no_grad()
def test_code_predictor_batch_equals_single_rows(preset):
    """Requests predicted together in one call get exactly what each gets alone (distinct data per row)."""
    talker = reference(preset).talker
    torch.manual_seed(0)
    b = 3
    hidden = torch.randn(b, talker.cfg.hidden_size)
    code0 = torch.tensor([3, 17, 40])
    groups = []

    def sample(logits, group):
        groups.append(group)
        return logits.argmax(-1)

    codes, embed_sum = talker.predict_codes(hidden, code0, sample)
    assert groups == list(range(1, talker.num_code_groups))
    assert codes.shape == (b, talker.num_code_groups) and torch.equal(codes[:, 0], code0)
    for i in range(b):
        c, e = talker.predict_codes(hidden[i : i + 1], code0[i : i + 1], argmax)
        assert torch.equal(c[0], codes[i])
        assert (e[0] - embed_sum[i]).abs().max().item() <= 1e-5
    # embed_sum is the talker embedding of code0 plus each group's own table for codes 1..Q-1.
    cp = talker.code_predictor
    manual = talker.embed_codec(codes[:, 0]) + sum(
        cp.embed_group(codes[:, g], g) for g in range(1, cp.num_code_groups)
    )
    assert (manual - embed_sum).abs().max().item() <= 1e-5


@torch.no_grad()
def test_talker_batched_decode_matches_solo():
    """Two requests' talker rows in one flattened step (one prefill, one decode, plus padding) = solo runs."""
    ref = reference("tiny")
    talker = ref.talker
    embeds, _, _, _ = _prefill(ref)
    n = embeds.shape[0]
    torch.manual_seed(1)
    extra = torch.randn(2, talker.cfg.hidden_size)
    solo_pr = _cache(talker)
    solo = talker(torch.cat((embeds, extra)), torch.arange(n + 2), solo_pr.kv, solo_pr.meta(["a"], [n + 2]))
    pr = _cache(talker)
    talker(torch.cat((embeds, extra[:1])), torch.arange(n + 1), pr.kv, pr.meta(["a"], [n + 1]))
    rows = torch.cat((extra[1:], embeds, torch.zeros(2, talker.cfg.hidden_size)))
    positions = torch.cat((torch.tensor([n + 1]), torch.arange(n), torch.zeros(2, dtype=torch.long)))
    out = talker(rows, positions, pr.kv, pr.meta(["a", "b"], [1, n], padded=n + 3))
    assert (out[0] - solo[n + 1]).abs().max().item() <= TOL
    assert (out[1 : n + 1] - solo[:n]).abs().max().item() <= TOL
