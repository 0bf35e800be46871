import pytest
import torch

from omnistage.core.sampling_params import SamplingParams
from omnistage.runner.sampler import SamplingRow, make_generator, process_logits, sample

V = 50


def logits_for(n, seed=0):
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_exact_argmax_and_draws_nothing():
    logits = logits_for(4)
    g = make_generator(1)
    state = g.get_state()
    rows = [SamplingRow(SamplingParams(temperature=0.0), g) for _ in range(4)]
    assert torch.equal(sample(logits, rows), logits.argmax(-1))
    assert torch.equal(g.get_state(), state)


def test_a_request_samples_the_same_whatever_its_batch_mates():
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=7)
    target = logits_for(1, seed=3)
    alone = [sample(target, [SamplingRow(params, make_generator(7))]).item() for _ in range(1)]
    seq_alone, g = [], make_generator(7)
    for _ in range(20):
        seq_alone.append(sample(target, [SamplingRow(params, g)]).item())
    seq_mixed, g = [], make_generator(7)
    for step in range(20):
        others = logits_for(3, seed=100 + step)
        mates = [SamplingRow(SamplingParams(temperature=1.0), make_generator(step)),
                 SamplingRow(SamplingParams(temperature=0.0), None),
                 SamplingRow(SamplingParams(temperature=1.3, seed=step), make_generator(step + 1))]
        # The request sits at a different row each step.
        pos = step % 4
        batch = torch.cat([others[:pos], target, others[pos:]])
        rows = mates[:pos] + [SamplingRow(params, g)] + mates[pos:]
        seq_mixed.append(sample(batch, rows)[pos].item())
    assert seq_alone == seq_mixed
    assert alone[0] == seq_alone[0]
    assert len(set(seq_alone)) > 1  # it really samples


def test_top_k_top_p_and_bans_restrict_the_support():
    logits = torch.arange(V, dtype=torch.float32)[None].repeat(3, 1)
    rows = [
        SamplingRow(SamplingParams(temperature=1.0, top_k=3), None),
        SamplingRow(SamplingParams(temperature=1.0, top_p=1e-6), None),
        SamplingRow(SamplingParams(temperature=1.0), None, banned=[V - 1, V - 2]),
    ]
    out = process_logits(logits, rows)
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [V - 3, V - 2, V - 1]
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [V - 1]
    assert not torch.isfinite(out[2, V - 2 :]).any() and torch.isfinite(out[2, : V - 2]).all()
    g = make_generator(0)
    for _ in range(20):
        assert sample(logits[:1], [SamplingRow(rows[0].params, g)]).item() in (V - 3, V - 2, V - 1)


def test_repetition_penalty_matches_hf_semantics():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    row = SamplingRow(SamplingParams(temperature=0.0, repetition_penalty=2.0), None, history=[0, 1])
    out = process_logits(logits, [row])
    assert out.tolist() == [[1.0, -4.0, 1.0, 0.5]]


def test_row_count_mismatch_is_an_error():
    with pytest.raises(ValueError, match="sampling rows"):
        sample(logits_for(2), [SamplingRow(SamplingParams(), None)])


@pytest.mark.parametrize("temperature", [1e-300, 1e-45, 1e-6, 9.9e-6])
def test_tiny_temperatures_are_greedy_not_nan(temperature):
    logits = logits_for(3)
    g = make_generator(5)
    state = g.get_state()
    rows = [SamplingRow(SamplingParams(temperature=temperature), g) for _ in range(3)]
    assert rows[0].params.greedy
    out = process_logits(logits, rows)
    assert not out.isnan().any()
    assert torch.equal(sample(logits, rows), logits.argmax(-1))
    assert torch.equal(g.get_state(), state)  # nothing was drawn


def test_huge_temperature_stays_finite():
    logits = logits_for(1)
    row = SamplingRow(SamplingParams(temperature=3e38), make_generator(0), banned=[0])
    out = process_logits(logits, [row])
    assert not out.isnan().any() and out[0, 0] == float("-inf")
    assert sample(logits, [row]).item() != 0


def _openai_penalties(logits, counts, freq, pres):
    """The formula of OpenAI's guide, one token at a time."""
    out = logits.clone()
    for tok, c in counts.items():
        out[tok] -= c * freq + (1.0 if c > 0 else 0.0) * pres
    return out


def test_frequency_and_presence_penalties_follow_openai_per_row():
    logits = logits_for(3, seed=4)
    output = [3, 3, 3, 7, 9, 9]
    prompt = [1, 2, 3]
    rows = [
        SamplingRow(SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.25), None,
                    history=prompt + output, output=output),
        SamplingRow(SamplingParams(temperature=0.0), None, history=prompt + output, output=output),  # untouched
        SamplingRow(SamplingParams(temperature=0.0, frequency_penalty=-1.0, presence_penalty=2.0), None,
                    history=[5, 5]),  # no separate output: the history is what was generated
    ]
    out = process_logits(logits, rows)
    counts = {t: output.count(t) for t in set(output)}
    assert torch.allclose(out[0], _openai_penalties(logits[0], counts, 0.5, 0.25))
    assert torch.equal(out[1], logits[1])
    assert torch.allclose(out[2], _openai_penalties(logits[2], {5: 2}, -1.0, 2.0))
    assert out[0, 1] == logits[0, 1]  # a prompt-only id is not counted when the output is given


def test_presence_penalty_changes_the_greedy_choice():
    logits = torch.tensor([[5.0, 4.5, 0.0]])
    seen = SamplingRow(SamplingParams(temperature=0.0, presence_penalty=1.0), None, history=[0], output=[0])
    assert sample(logits, [seen]).item() == 1
    assert sample(logits, [SamplingRow(SamplingParams(temperature=0.0), None, history=[0])]).item() == 0


def test_logit_bias_is_added_per_request_and_ignores_ids_outside_the_vocab():
    logits = logits_for(2, seed=6)
    biased = SamplingParams(temperature=0.0, logit_bias={4: 100.0, 7: -100, V + 10: 50.0})
    out = process_logits(logits, [SamplingRow(biased, None), SamplingRow(SamplingParams(temperature=0.0), None)])
    expected = logits[0].clone()
    expected[4] += 100.0
    expected[7] -= 100.0
    assert torch.equal(out[0], expected)
    assert torch.equal(out[1], logits[1])
    assert sample(logits[:1], [SamplingRow(biased, None)]).item() == 4


def test_logit_bias_applies_before_the_repetition_penalty():
    # vLLM's order: the bias is part of the logits the penalty then scales.
    logits = torch.tensor([[1.0, 0.0]])
    row = SamplingRow(SamplingParams(temperature=0.0, logit_bias={0: -3.0}, repetition_penalty=2.0), None,
                      history=[0])
    assert process_logits(logits, [row]).tolist() == [[-4.0, 0.0]]
