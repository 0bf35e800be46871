import pytest

from omnistage.core import SamplingParams


def test_defaults_and_greedy():
    p = SamplingParams()
    assert not p.greedy and p.max_tokens == 256 and p.stop_token_ids == ()
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=0).greedy


def test_stop_ids_list_becomes_tuple_and_params_are_hashable():
    p = SamplingParams(stop_token_ids=[3, 4])
    assert p.stop_token_ids == (3, 4)
    assert hash(p) == hash(SamplingParams(stop_token_ids=(3, 4)))


def test_replace_validates_again():
    p = SamplingParams(temperature=0.5, seed=3)
    q = p.replace(max_tokens=8)
    assert q.max_tokens == 8 and q.temperature == 0.5 and q.seed == 3 and p.max_tokens == 256
    with pytest.raises(ValueError, match="top_p"):
        p.replace(top_p=0.0)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"stop_token_ids": [1, -3]}, "stop_token_ids"),
        ({"stop_token_ids": "abc"}, "stop_token_ids"),
        ({"seed": "x"}, "seed"),
        ({"seed": 2**64}, "seed"),  # torch's manual_seed overflows: must fail here, not in the engine
        ({"seed": -(2**63) - 1}, "seed"),
        ({"temperature": 1e39}, "temperature"),  # inf in float32
        ({"repetition_penalty": 1e-300}, "repetition_penalty"),  # 0 in float32
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"frequency_penalty": float("inf")}, "frequency_penalty"),
        ({"logit_bias": {5: 101}}, "logit_bias"),
        ({"logit_bias": {-1: 1}}, "logit_bias"),
        ({"logit_bias": {"5": 1}}, "logit_bias"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias"),
        ({"logit_bias": 3}, "logit_bias"),
        ({"ignore_eos": 1}, "ignore_eos"),
    ],
)
def test_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_top_k_off_values_are_accepted():
    assert SamplingParams(top_k=0).top_k == 0 and SamplingParams(top_k=-1).top_k == -1
    assert SamplingParams(top_k=5).top_k == 5


@pytest.mark.parametrize("temperature", [1e-300, 1e-6])
def test_tiny_temperatures_are_greedy(temperature):
    # Below the epsilon a float32 division overflows; greedy is the limit such a temperature asks for.
    assert SamplingParams(temperature=temperature).greedy
    assert not SamplingParams(temperature=1e-5).greedy


@pytest.mark.parametrize("seed", [0, 2**64 - 1, -(2**63), -1])
def test_every_seed_torch_accepts_is_accepted(seed):
    import torch

    torch.Generator().manual_seed(SamplingParams(seed=seed).seed)


def test_logit_bias_mapping_becomes_sorted_pairs_and_stays_hashable():
    p = SamplingParams(logit_bias={9: -1, 2: 100})
    assert p.logit_bias == ((2, 100.0), (9, -1.0))
    assert hash(p) == hash(SamplingParams(logit_bias=[(9, -1.0), (2, 100.0)]))
