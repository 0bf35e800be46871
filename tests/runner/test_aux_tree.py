import pytest
import torch

from omnistage.runner.aux_tree import AuxOutputError, flatten_aux, unflatten_aux, validate_aux
from omnistage.runner.ownership import snapshot


def sample_tree(n: int = 3):
    torch.manual_seed(0)
    return {
        "hidden": torch.randn(n, 4),
        "layers": [torch.randn(n, 2, 2), (torch.arange(n), torch.randn(n, 1, dtype=torch.float64))],
        "codes": {"audio": torch.randint(0, 9, (n, 16))},
    }


def test_flatten_rebuild_round_trip_keeps_leaf_objects_and_types():
    tree = sample_tree()
    leaves, spec = flatten_aux(tree)
    assert len(leaves) == 5
    # dict keys are visited in sorted order, so equal dicts built in another order flatten the same
    assert leaves[0] is tree["codes"]["audio"] and leaves[1] is tree["hidden"]
    rebuilt = unflatten_aux(leaves, spec)
    assert list(rebuilt) == sorted(tree)
    assert type(rebuilt["layers"]) is list and type(rebuilt["layers"][1]) is tuple
    assert rebuilt["layers"][1][1] is tree["layers"][1][1]
    reordered = {"codes": tree["codes"], "layers": tree["layers"], "hidden": tree["hidden"]}
    assert flatten_aux(reordered)[1] == spec
    # a single tensor is a valid tree too
    t = torch.ones(2, 3)
    leaves, spec = flatten_aux(t)
    assert unflatten_aux(leaves, spec) is t


def test_rebuild_with_new_leaves_and_wrong_leaf_count():
    leaves, spec = flatten_aux(sample_tree())
    fresh = [torch.full_like(x, i) for i, x in enumerate(leaves)]
    rebuilt = unflatten_aux(fresh, spec)
    assert torch.equal(rebuilt["hidden"], torch.full((3, 4), 1.0))
    assert torch.equal(rebuilt["layers"][1][0], torch.full((3,), 3))
    with pytest.raises(AuxOutputError, match="5 leaves, got 4"):
        unflatten_aux(fresh[:4], spec)


def test_validate_accepts_and_returns_spec():
    tree = sample_tree(3)
    spec = validate_aux(tree, num_tokens=3)
    # a different token count keeps the same spec (only dims after the token axis are recorded)
    assert validate_aux(sample_tree(7), num_tokens=7, expected_spec=spec) == spec


@pytest.mark.parametrize("tree", [None, {}, [], (), {"a": []}, {"a": {"b": ()}}])
def test_empty_tree(tree):
    with pytest.raises(AuxOutputError):
        validate_aux(tree, num_tokens=3)


@pytest.mark.parametrize(
    "leaf, match",
    [
        ("layer-3", "str, not a tensor"),
        (3, "int, not a tensor"),
        (None, "NoneType"),
        (torch.tensor(1.0), "0-dim"),
    ],
)
def test_non_tensor_leaf(leaf, match):
    tree = sample_tree()
    tree["layers"].append(leaf)
    with pytest.raises(AuxOutputError, match=match):
        validate_aux(tree, num_tokens=3)


def test_non_str_dict_key():
    with pytest.raises(AuxOutputError, match="non-str keys"):
        flatten_aux({0: torch.ones(2, 1)})


def test_leaf_off_the_token_axis():
    tree = sample_tree(3)
    tree["codes"]["audio"] = tree["codes"]["audio"].t()  # [16, 3]: token axis is not first
    with pytest.raises(AuxOutputError, match="first dim 16, expected the token axis 3"):
        validate_aux(tree, num_tokens=3)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda t: t.pop("hidden"), "captured dict"),
        (lambda t: t.update(extra=torch.ones(3, 1)), "captured dict"),
        (lambda t: t["layers"].append(torch.ones(3)), r"at \['layers'\]"),
        (lambda t: t.update(layers=tuple(t["layers"])), "captured list"),
        (lambda t: t.update(hidden=[t["hidden"]]), "captured a tensor leaf"),
        (lambda t: t.update(hidden=t["hidden"].double()), "torch.float32"),
        (lambda t: t.update(hidden=torch.ones(3, 5)), r"\[T, \*\[4\]\]"),
    ],
)
def test_structure_differs_from_capture(mutate, match):
    spec = validate_aux(sample_tree(), num_tokens=3)
    tree = sample_tree()
    mutate(tree)
    with pytest.raises(AuxOutputError, match="differs from the captured") as info:
        validate_aux(tree, num_tokens=3, expected_spec=spec)
    assert info.match(match)


def toy_model(x: torch.Tensor):
    return 2 * x, {"aux": [x + 1, x + 2]}


def test_replayed_leaves_hold_this_replays_values_cpu_emulation():
    """Static buffers rewritten in place stand in for graph outputs: capture x=1, replay x=7."""
    x = torch.ones(4, 3)
    main, aux = toy_model(x)
    spec = validate_aux(aux, num_tokens=4)
    leaves, _ = flatten_aux(aux)
    static_out = [main, *leaves]
    before = snapshot(leaves[0])

    def replay():  # a graph replay writes into the same output storage
        new_main, new_aux = toy_model(x)
        for buf, val in zip(static_out, [new_main, *flatten_aux(new_aux)[0]]):
            buf.copy_(val)

    x.fill_(7.0)
    replay()
    rebuilt = unflatten_aux(static_out[1:], spec)
    assert torch.equal(static_out[0], torch.full((4, 3), 14.0))
    assert torch.equal(rebuilt["aux"][0], torch.full((4, 3), 8.0))
    assert torch.equal(rebuilt["aux"][1], torch.full((4, 3), 9.0))
    assert torch.equal(before, torch.full((4, 3), 2.0))  # a snapshot keeps the capture-time values


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_replayed_leaves_hold_this_replays_values_cuda_graph():
    x = torch.ones(8, 3, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the graph
        toy_model(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        main, aux = toy_model(x)
    spec = validate_aux(aux, num_tokens=8)
    leaves, _ = flatten_aux(aux)
    x.fill_(7.0)
    graph.replay()
    rebuilt = unflatten_aux(leaves, spec)
    torch.cuda.synchronize()
    assert torch.equal(main.cpu(), torch.full((8, 3), 14.0))
    assert torch.equal(rebuilt["aux"][0].cpu(), torch.full((8, 3), 8.0))
    assert torch.equal(rebuilt["aux"][1].cpu(), torch.full((8, 3), 9.0))
