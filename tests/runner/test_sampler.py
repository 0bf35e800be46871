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
