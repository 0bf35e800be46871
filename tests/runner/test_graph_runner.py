"""v2 graph runner: static-buffer decode path vs v1, live hook context, output ownership, aux contract,
capture/replay values (CPU stand-in + real CUDA graph), and the Thinker on the tiny checkpoint."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from test_ar_runner import PROMPTS, IdentityModel, reference_tokens, run

from omnistage.core.request import Request
from omnistage.core.sampling_params import SamplingParams
from omnistage.core.scheduler import ARScheduler
from omnistage.core.scheduler_config import SchedulerConfig
from omnistage.runner.ar_runner import ARRunner
from omnistage.runner.aux_tree import AuxOutputError
from omnistage.runner.cuda_graph import CudaStepGraph, EagerStepGraph, flatten_output, rebuild_output
from omnistage.runner.graph_runner import (
    CUDAGraphARRunner,
    GraphRunnerConfig,
    OwnershipError,
    decode_attention_metadata,
)
from omnistage.runner.outputs import OmniOutput
from omnistage.runner.ownership import OwnedBatchTensor

BUCKETS = (1, 2, 4)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class DeclaredModel(IdentityModel):
    supports_full_graph_aux_outputs = True


class PaddingSpy(DeclaredModel):
    """Records (padded, unpadded) row counts of every step."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def prepare_inputs(self, ctx, input_ids, positions):
        self.sizes.append((ctx.num_tokens_padded, ctx.num_tokens_unpadded))
        return super().prepare_inputs(ctx, input_ids, positions)


def make_graph(model, num_blocks=64, max_model_len=64, budget=8, config=None, device="cpu"):
    sched = ARScheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=max_model_len,
                                        block_size=4, num_blocks=num_blocks))
    runner = CUDAGraphARRunner(model, num_blocks=num_blocks, block_size=4, device=device,
                                graph_config=config or GraphRunnerConfig(decode_buckets=BUCKETS))
    return sched, runner


def make_v1(num_blocks=64, max_model_len=64, budget=8):
    sched = ARScheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=max_model_len,
                                        block_size=4, num_blocks=num_blocks))
    return sched, ARRunner(IdentityModel(), num_blocks=num_blocks, block_size=4)


# Staggered arrivals with different lengths: decode batches of 1..4 rows (3 pads to 4), joins during decode,
# leaves that move the last request into the hole (reorder).
ARRIVALS = {
    0: [("a", *PROMPTS["a"], 9), ("b", *PROMPTS["b"], 4)],
    3: [("c", *PROMPTS["c"], 12)],
    6: [("d", *PROMPTS["d"], 5)],
    14: [("e", [4, 4], 7, 6)],
}


def copy_arrivals():
    return {k: list(v) for k, v in ARRIVALS.items()}


@pytest.mark.parametrize("model_cls", [IdentityModel, PaddingSpy])
def test_static_path_matches_v1_with_joins_leaves_reorders_and_padding(model_cls):
    sched1, v1 = make_v1()
    expected = run(sched1, v1, copy_arrivals())
    sched, runner = make_graph(model_cls())
    got = run(sched, runner, copy_arrivals())
    assert got == expected
    for req_id, prompt, salt, n in [args for v in ARRIVALS.values() for args in v]:
        assert got[req_id] == reference_tokens(prompt, salt, n), req_id
    assert runner.stats.static_steps >= 10 and runner.stats.eager_steps >= 3
    assert len({tuple(o) for o in runner.model.seen_orders}) > 4
    if model_cls is PaddingSpy:
        assert runner.captured_buckets == [1, 2, 4]
        assert runner.stats.replays > runner.stats.captures
        assert (4, 3) in runner.model.sizes  # a padded decode step ran
    else:
        assert runner.captured_buckets == []
    assert len(runner.records) == 0 and len(runner.batch) == 0
    assert sched.kv_stats().num_free_blocks == sched.kv_stats().num_blocks


def test_static_path_survives_preemption():
    arrivals = {0: [(r, *PROMPTS[r], 10) for r in "acd"]}
    sched1, v1 = make_v1(num_blocks=5, max_model_len=16)
    expected = run(sched1, v1, {k: list(v) for k, v in arrivals.items()})
    sched, runner = make_graph(DeclaredModel(), num_blocks=5, max_model_len=16)
    assert run(sched, runner, {k: list(v) for k, v in arrivals.items()}) == expected
    assert runner.stats.replays > 0


class LiveSpy(DeclaredModel):
    """Records the context objects each hook receives."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def prepare_inputs(self, ctx, input_ids, positions):
        self.calls.append(("prepare", ctx, None, None))
        return super().prepare_inputs(ctx, input_ids, positions)

    def postprocess(self, ctx, output, sampled):
        self.calls.append(("post", ctx, ctx.states, output))
        return super().postprocess(ctx, output, sampled)

    def stage_outputs(self, ctx, output, sampled):
        self.calls.append(("stage", ctx, ctx.states, output))
        return super().stage_outputs(ctx, output, sampled)


def test_hooks_after_replay_receive_the_live_step_context():
    model = LiveSpy()
    sched, runner = make_graph(model)
    live = {}
    for args in ARRIVALS[0] + ARRIVALS[3]:
        live[args[0]] = Request(args[0], args[1], SamplingParams(temperature=0, max_tokens=args[3]))
        sched.add_request(live[args[0]])
        runner.add_request(live[args[0]], {"salt": args[2]})
    contexts = []
    while sched.has_unfinished():
        so = sched.schedule()
        model.calls.clear()
        runner.execute_model(so)
        live_order = runner.batch.scheduled_order(so.num_scheduled_tokens)
        gathered = [runner.state(r) for r in runner.model.calls[0][1].req_ids]
        res = runner.sample_tokens()
        (_, c0, _, _), (_, c1, s1, o1), (_, c2, s2, o2) = model.calls
        assert c0 is c1 is c2 and s1 is s2 and o1 is o2
        assert c0.req_ids == live_order
        for i, r in enumerate(c0.req_ids):
            assert c0.requests[i] is live[r]
            assert dict(s1[i]) == dict(gathered[i])
        # Values are this step's rows in this step's order, real rows only.
        assert o1.hidden_states.shape[0] == c0.num_tokens_unpadded
        for r in c0.req_ids:
            s, e = c0.spans[r]
            assert torch.all(o1.hidden_states[s:e, 0] == runner.state(r)["salt"])
        contexts.append(c0)
        for u in sched.update_from_output(so, res.sampled):
            if u.finished:
                runner.free(u.req_id)
    assert len({id(c) for c in contexts}) == len(contexts)
    assert runner.stats.replays >= 5 and runner.stats.captures == len(runner.captured_buckets)


class ViewKeeper(DeclaredModel):
    """Keeps views of graph outputs in the buffer and in stage outputs (the runner must copy them)."""

    def postprocess(self, ctx, output, sampled):
        updates = super().postprocess(ctx, output, sampled)
        hidden = output.hidden_states
        return [
            {**(u or {}), "last_row": hidden[ctx.spans[r][1] - 1]} for u, r in zip(updates, ctx.req_ids)
        ]

    def stage_outputs(self, ctx, output, sampled):
        out = super().stage_outputs(ctx, output, sampled)
        for r in out:
            out[r]["fresh"] = OwnedBatchTensor(torch.full((1,), float(ctx.index(r))))
        return out


def _decode_two(model):
    sched, runner = make_graph(model)
    for req_id, salt in (("x", 1), ("y", 2)):
        req = Request(req_id, [3, 4], SamplingParams(temperature=0, max_tokens=6))
        sched.add_request(req)
        runner.add_request(req, {"salt": salt})
    results = []
    for _ in range(4):
        so = sched.schedule()
        runner.execute_model(so)
        res = runner.sample_tokens()
        sched.update_from_output(so, res.sampled)
        results.append((so, res, {r: dict(runner.state(r)) for r in ("x", "y")}))
    return runner, results


def test_outputs_read_after_the_next_step_keep_their_values():
    runner, results = _decode_two(ViewKeeper())
    assert runner.stats.replays >= 2  # steps 2..4 reuse the bucket-2 graph's output storage
    leaves = runner._graphs[2].leaves
    for step, (_so, res, states) in enumerate(results):
        for r in ("x", "y"):
            rows = res.stage_outputs[r]["rows"]
            position = 2 + step - 1 if step else 1  # step 0 is the prefill: last prompt row at position 1
            assert rows[-1, 2].item() == position, (step, r)
            assert states[r]["last_row"][2].item() == position
            assert all(rows.untyped_storage().data_ptr() != leaf.untyped_storage().data_ptr() for leaf in leaves)
    # Stored last_row entries were copied out of the graph output too.
    assert runner.state("x")["last_row"][2].item() == 4


def test_owned_outputs_are_handed_over_without_copy_and_a_false_claim_is_caught():
    runner, results = _decode_two(ViewKeeper())
    fresh = results[-1][1].stage_outputs["y"]["fresh"]
    assert isinstance(fresh, torch.Tensor) and fresh.item() in (0.0, 1.0)

    class Liar(DeclaredModel):
        def stage_outputs(self, ctx, output, sampled):
            return {r: {"rows": OwnedBatchTensor(output.hidden_states[s:e])} for r, (s, e) in ctx.spans.items()}

    with pytest.raises(OwnershipError):
        _decode_two(Liar())


def test_owned_tensor_passes_through_as_the_same_object():
    _, runner = make_graph(DeclaredModel())
    t = torch.arange(3.0)
    out = runner._hand_over({"a": OwnedBatchTensor(t), "b": [runner._ids[:2]], "c": 5})
    assert out["a"] is t
    assert out["b"][0].untyped_storage().data_ptr() != runner._ids.untyped_storage().data_ptr()
    assert out["c"] == 5


def _with_aux(base, aux_fn, declared):
    class Model(base):
        supports_full_graph_aux_outputs = declared

        def __init__(self):
            super().__init__()
            self.calls = 0

        def forward(self, kv_caches, attn_meta, input_ids, positions, salts):
            out = super().forward(kv_caches, attn_meta, input_ids, positions, salts)
            self.calls += 1
            out.multimodal_outputs.update(aux_fn(input_ids, self.calls))
            return out

    return Model()


def _run_all():
    return {k: list(v) for k, v in {0: [("a", *PROMPTS["a"], 5), ("c", *PROMPTS["c"], 5)]}.items()}


@pytest.mark.parametrize(
    "aux_fn, match",
    [
        (lambda x, _: {"count": 3}, "not a tensor"),
        (lambda x, _: {"short": torch.zeros(1, 2)}, "first dim 1"),
        (lambda x, _: {"scalar": torch.tensor(1.0)}, "0-dim"),
        (lambda x, calls: {f"k{min(calls, 3)}": x.float()}, "structure differs"),
    ],
)
def test_declared_model_with_invalid_aux_raises(aux_fn, match):
    sched, runner = make_graph(_with_aux(IdentityModel, aux_fn, declared=True))
    with pytest.raises(AuxOutputError, match=match):
        run(sched, runner, _run_all())


def test_declared_model_with_empty_aux_raises():
    class Empty(DeclaredModel):
        def forward(self, kv_caches, attn_meta, input_ids, positions, salts):
            out = super().forward(kv_caches, attn_meta, input_ids, positions, salts)
            return OmniOutput(out.hidden_states)

        def stage_outputs(self, ctx, output, sampled):
            return {}

    sched, runner = make_graph(Empty())
    with pytest.raises(AuxOutputError, match="empty"):
        run(sched, runner, _run_all())


def test_undeclared_nonconforming_model_runs_eagerly_and_says_so(caplog):
    caplog.set_level(logging.INFO, logger="omnistage.runner")
    sched, runner = make_graph(_with_aux(IdentityModel, lambda x, _: {"count": 3}, declared=False))
    got = run(sched, runner, _run_all())
    assert got["a"] == reference_tokens(*PROMPTS["a"], 5) and got["c"] == reference_tokens(*PROMPTS["c"], 5)
    assert runner.captured_buckets == [] and runner.stats.static_steps > 0
    records = [r for r in caplog.records if r.name == "omnistage.runner"]
    assert len(records) == 1
    assert "not full-graph captured" in records[0].getMessage() and "not a tensor" in records[0].getMessage()


def test_unpadded_multimodal_fields_coexist_with_padded_hidden():
    """An undeclared model may return a real-rows-only field next to padded hidden states."""

    class Unpadded(IdentityModel):
        def prepare_inputs(self, ctx, input_ids, positions):
            kwargs, updates = super().prepare_inputs(ctx, input_ids, positions)
            kwargs["tags"] = kwargs["salts"][: ctx.num_tokens_unpadded].clone()
            return kwargs, updates

        def forward(self, kv_caches, attn_meta, input_ids, positions, salts, tags):
            out = super().forward(kv_caches, attn_meta, input_ids, positions, salts)
            assert out.hidden_states.shape[0] >= tags.shape[0]
            out.multimodal_outputs["tags"] = tags
            return out

        def stage_outputs(self, ctx, output, sampled):
            out = super().stage_outputs(ctx, output, sampled)
            tags = output.multimodal_outputs["tags"]
            assert tags.shape[0] == ctx.num_tokens_unpadded == output.hidden_states.shape[0]
            for r, (s, e) in ctx.spans.items():
                assert torch.all(tags[s:e] == out[r]["rows"][:, 0])
            return out

    sched, runner = make_graph(Unpadded())
    arrivals = {0: [(r, *PROMPTS[r], 4) for r in "abc"]}
    got = run(sched, runner, arrivals)
    assert got["b"] == reference_tokens(*PROMPTS["b"], 4)


def test_graph_config_validation():
    for bad in [dict(decode_buckets=()), dict(decode_buckets=(2, 1)), dict(decode_buckets=(0,)),
                dict(max_model_len=0), dict(full_graph="yes")]:
        with pytest.raises(ValueError):
            GraphRunnerConfig(**bad)


def test_full_graph_disabled_runs_static_path_eagerly():
    sched, runner = make_graph(DeclaredModel(), config=GraphRunnerConfig(decode_buckets=BUCKETS, full_graph=False))
    got = run(sched, runner, _run_all())
    assert got["a"] == reference_tokens(*PROMPTS["a"], 5)
    assert runner.captured_buckets == [] and runner.stats.static_steps > 0


def test_decode_metadata_pads_to_scratch():
    block_size, num_blocks = 4, 8
    table = torch.tensor([[3, 5, 8], [8, 8, 8]])  # row 1 is padding (all scratch block)
    seq = torch.tensor([6, 0])
    pos = torch.tensor([5, 0])
    w = torch.arange(12)
    meta = decode_attention_metadata(table, seq, pos, w // 4, w % 4, torch.arange(2), torch.zeros(2, dtype=torch.long),
                                     block_size, num_blocks)
    scratch = num_blocks * block_size
    assert meta.slot_mapping.tolist() == [5 * 4 + 1, scratch]
    g = meta.groups[0]
    assert g.kv_slots[0, :6].tolist() == [12, 13, 14, 15, 20, 21]
    assert torch.all(g.kv_slots[0, 6:] == scratch) and torch.all(g.kv_slots[1] == scratch)
    assert g.mask[0, 0, 0].tolist() == [True] * 6 + [False] * 6
    assert g.mask[1, 0, 0].tolist() == [True] + [False] * 11


def _aux_fn(x, box):
    def fn():
        out = OmniOutput(x * 2, {"codes": {"a": x + 1}}, {"more": [x + 2]})
        leaves, spec = flatten_output(out, x.shape[0], box.get("spec"))
        box["spec"] = spec
        return leaves
    return fn


def _check_replay_values(graph, device):
    x = torch.ones(4, 3, device=device)
    box = {}
    leaves = graph.capture(_aux_fn(x, box))
    first = rebuild_output(leaves, box["spec"])
    assert first.hidden_states[0, 0] == 2 and first.multimodal_outputs["codes"]["a"][0, 0] == 2
    assert first.intermediate["more"][0][0, 0] == 3
    x.fill_(7)
    assert leaves[0][0, 0].item() == 2  # a static output holds the last run's values until the next replay
    same = graph.replay()
    assert all(a is b for a, b in zip(same, leaves))
    out = rebuild_output(same, box["spec"])
    assert torch.all(out.hidden_states == 14)
    assert torch.all(out.multimodal_outputs["codes"]["a"] == 8)
    assert torch.all(out.intermediate["more"][0] == 9)


def test_cpu_stand_in_replay_tracks_new_inputs():
    _check_replay_values(EagerStepGraph(), "cpu")


@needs_cuda
def test_cuda_graph_replay_tracks_new_inputs():
    _check_replay_values(CudaStepGraph(torch.device("cuda")), "cuda")


class CudaIdentityModel(DeclaredModel):
    def prepare_inputs(self, ctx, input_ids, positions):
        kwargs, updates = super().prepare_inputs(ctx, input_ids, positions)
        kwargs["salts"] = kwargs["salts"].to(input_ids.device)
        return kwargs, updates


@needs_cuda
def test_cuda_runner_captures_and_matches_reference():
    sched, runner = make_graph(CudaIdentityModel(), device="cuda")
    got = run(sched, runner, copy_arrivals())
    for req_id, prompt, salt, n in [args for v in ARRIVALS.values() for args in v]:
        assert got[req_id] == reference_tokens(prompt, salt, n), req_id
    assert runner.captured_buckets == [1, 2, 4] and runner.stats.replays > 0


# ---- the real Thinker on the tiny checkpoint --------------------------------------------------------


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models are dominated by per-op overhead; extra intra-op threads only add contention."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_thinker(tmp_path_factory):
    checkpoint = pytest.importorskip("omnistage.checkpoints.builder")
    from safetensors.torch import load_file

    from omnistage.models.qwen3_omni.thinker import Thinker

    path = checkpoint.build_checkpoint(tmp_path_factory.mktemp("tiny"), preset="tiny", seed=0)
    config = checkpoint.make_hf_config(json.loads((path / "config.json").read_text()))
    thinker = Thinker(config)
    wanted = thinker.state_dict()
    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        for k, v in load_file(str(f)).items():
            if k.startswith("thinker.") and k[len("thinker."):] in wanted:
                tensors[k[len("thinker."):]] = v.float()
    thinker.load_state_dict(tensors, strict=True)
    return thinker.eval()


def _drive_thinker(runner, vocab):
    sched = ARScheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64,
                                        block_size=4, num_blocks=64))
    g = torch.Generator().manual_seed(0)
    prompts = {r: torch.randint(0, vocab, (n,), generator=g).tolist() for r, n in zip("abcd", (7, 12, 3, 9))}
    arrivals = {0: "ab", 2: "c", 5: "d"}
    outputs, step = {}, 0
    while sched.has_unfinished() or arrivals:
        for r in arrivals.pop(step, ""):
            params = SamplingParams(temperature=0, max_tokens=8 if r != "b" else 4, ignore_eos=True)
            req = Request(r, prompts[r], params)
            sched.add_request(req)
            runner.add_request(req)
        step += 1
        so = sched.schedule()
        if so.is_empty:
            continue
        runner.execute_model(so)
        res = runner.sample_tokens()
        for u in sched.update_from_output(so, res.sampled):
            outputs.setdefault(u.req_id, []).extend(u.new_token_ids)
            if u.finished:
                runner.free(u.req_id)
    return outputs


def test_thinker_v1_and_v2_give_identical_greedy_tokens(tiny_thinker):
    from omnistage.models.qwen3_omni.stage_models import ThinkerStageModel

    class DeclaredThinker(ThinkerStageModel):
        supports_full_graph_aux_outputs = True

    torch.manual_seed(0)
    vocab = tiny_thinker.vocab_size
    v1 = ARRunner(ThinkerStageModel(tiny_thinker), num_blocks=64, block_size=4)
    v2 = CUDAGraphARRunner(DeclaredThinker(tiny_thinker), num_blocks=64, block_size=4,
                            graph_config=GraphRunnerConfig(decode_buckets=BUCKETS, max_model_len=64))
    expected = _drive_thinker(v1, vocab)
    got = _drive_thinker(v2, vocab)
    assert got == expected
    assert all(len(t) == (4 if r == "b" else 8) for r, t in got.items())
    assert v2.stats.replays > 0 and v2.captured_buckets
