"""AR runner attribution with a model double that writes request identity into every output row."""

import pytest
import torch

from omnistage.core.request import Request
from omnistage.core.sampling_params import SamplingParams
from omnistage.core.scheduler import ARScheduler
from omnistage.core.scheduler_config import SchedulerConfig
from omnistage.runner.ar_runner import ARRunner, StepOrderError
from omnistage.runner.outputs import OmniOutput

VOCAB = 97


def expected_next(salt: int, token: int, position: int) -> int:
    return (salt * 7 + token + position) % VOCAB


class IdentityModel:
    """hidden[row] = [salt, token, position] of the request that owns the row (salt from its buffer state)."""

    num_layers, num_kv_heads, head_dim = 1, 1, 2

    def __init__(self):
        self.seen_orders = []

    def prepare_inputs(self, ctx, input_ids, positions):
        self.seen_orders.append(list(ctx.req_ids))
        salts = torch.full((input_ids.shape[0],), -1.0)
        for req_id, state in zip(ctx.req_ids, ctx.states):
            s, e = ctx.spans[req_id]
            salts[s:e] = float(state["salt"])
        return {"input_ids": input_ids, "positions": positions, "salts": salts}, [None] * len(ctx.req_ids)

    def forward(self, kv_caches, attn_meta, input_ids, positions, salts):
        hidden = torch.stack([salts, input_ids.float(), positions.float()], dim=1)
        return OmniOutput(hidden_states=hidden, multimodal_outputs={"rows": hidden.clone()})

    def compute_logits(self, hidden):
        target = (hidden[:, 0].long() * 7 + hidden[:, 1].long() + hidden[:, 2].long()) % VOCAB
        return torch.nn.functional.one_hot(target, VOCAB).float()

    def postprocess(self, ctx, output, sampled):
        return [
            {"stats": {"last": sampled[r], "steps": ctx.states[i].get("stats", {}).get("steps", 0) + 1}}
            if r in sampled else None
            for i, r in enumerate(ctx.req_ids)
        ]

    def stage_outputs(self, ctx, output, sampled):
        rows = output.multimodal_outputs["rows"]
        return {r: {"rows": rows[s:e]} for r, (s, e) in ctx.spans.items()}


CREATED: dict[str, Request] = {}


def make(pad_buckets=None, budget=8, num_blocks=64, max_model_len=64):
    sched = ARScheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=max_model_len,
                                        block_size=4, num_blocks=num_blocks))
    runner = ARRunner(IdentityModel(), num_blocks=num_blocks, block_size=4, pad_buckets=pad_buckets)
    return sched, runner


def add(sched, runner, req_id, prompt, salt, max_tokens=6):
    req = Request(req_id, prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
    sched.add_request(req)
    runner.add_request(req, {"salt": salt, "meta": {"label": req_id}})
    CREATED[req_id] = req


def run(sched, runner, arrivals, aborts=None):
    """Step until done; arrivals/aborts: {step: [...]}. Checks every stage-output row belongs to its request."""
    aborts = aborts or {}
    outputs, step = {}, 0
    while sched.has_unfinished() or arrivals:
        for args in arrivals.pop(step, []):
            add(sched, runner, *args)
        for req_id in aborts.get(step, []):
            sched.abort_requests([req_id])
            runner.free(req_id)
        step += 1
        so = sched.schedule()
        if so.is_empty:
            continue
        runner.execute_model(so)
        res = runner.sample_tokens()
        for req_id, payload in res.stage_outputs.items():
            salt = runner.state(req_id)["salt"] if req_id in runner.records else None
            if salt is not None:
                assert torch.all(payload["rows"][:, 0] == salt), f"row of another request reached {req_id}"
            assert payload["rows"].shape[0] == so.num_scheduled_tokens[req_id]
        for u in sched.update_from_output(so, res.sampled):
            outputs.setdefault(u.req_id, []).extend(u.new_token_ids)
            if u.finished:
                state = runner.state(u.req_id)
                assert state["meta"] == {"label": u.req_id}  # sibling survived every merge
                assert state["stats"]["steps"] == len(outputs[u.req_id])
                runner.free(u.req_id)
    return outputs


def reference_tokens(prompt, salt, max_tokens=6):
    tokens, pos = list(prompt), len(prompt) - 1
    out = []
    for _ in range(max_tokens):
        t = expected_next(salt, tokens[-1], pos)
        out.append(t)
        tokens.append(t)
        pos += 1
    return out


PROMPTS = {"a": ([5, 6, 7], 1), "b": ([9] * 11, 2), "c": ([1, 2], 3), "d": ([3, 3, 3, 3, 3], 4)}


@pytest.mark.parametrize("pad_buckets", [None, (4, 8, 16)])
def test_tokens_follow_their_request_through_joins_leaves_and_reorders(pad_buckets):
    sched, runner = make(pad_buckets)
    arrivals = {0: [("a", *PROMPTS["a"]), ("b", *PROMPTS["b"])], 2: [("c", *PROMPTS["c"])],
                3: [("d", *PROMPTS["d"], 3)]}
    outputs = run(sched, runner, arrivals)
    for req_id, (prompt, salt) in PROMPTS.items():
        n = 3 if req_id == "d" else 6
        assert outputs[req_id] == reference_tokens(prompt, salt, n), req_id
    # the order really changed while requests left and joined
    orders = [tuple(o) for o in runner.model.seen_orders]
    assert len(set(orders)) > 3
    assert len(runner.records) == 0 and len(runner.batch) == 0
    assert sched.kv_stats().num_free_blocks == sched.kv_stats().num_blocks


def test_abort_mid_flight_frees_state_and_leaves_others_untouched():
    sched, runner = make()
    arrivals = {0: [(r, *PROMPTS[r]) for r in "abc"]}
    outputs = run(sched, runner, arrivals, aborts={3: ["b"]})
    for r in "ac":
        assert outputs[r] == reference_tokens(*PROMPTS[r])
    assert "b" not in runner.records and "b" not in runner.batch
    assert sched.kv_stats().num_free_blocks == sched.kv_stats().num_blocks


def test_preemption_recompute_gives_same_tokens():
    # 5 blocks of 4 slots cannot hold three growing requests at once: the scheduler must preempt.
    sched, runner = make(num_blocks=16, max_model_len=16)
    sched2, runner2 = make(num_blocks=5, max_model_len=16)
    arrivals = {0: [(r, *PROMPTS[r], 10) for r in "acd"]}
    CREATED.clear()
    preempting = run(sched2, runner2, {k: list(v) for k, v in arrivals.items()})
    assert sum(CREATED[r].num_preemptions for r in "acd") > 0
    assert preempting == run(sched, runner, arrivals)
    assert sched2.kv_stats().num_free_blocks == sched2.kv_stats().num_blocks
    assert len(runner2.records) == 0


def test_execute_and_sample_must_alternate():
    sched, runner = make()
    with pytest.raises(StepOrderError):
        runner.sample_tokens()
    add(sched, runner, "a", *PROMPTS["a"])
    so = sched.schedule()
    runner.execute_model(so)
    with pytest.raises(StepOrderError):
        runner.execute_model(so)
    runner.sample_tokens()
    with pytest.raises(StepOrderError):
        runner.sample_tokens()


def _add_seeded(sched, runner, req_id, prompt, salt, max_tokens=10):
    req = Request(req_id, prompt, SamplingParams(temperature=1.0, seed=1000 + salt, max_tokens=max_tokens))
    sched.add_request(req)
    runner.add_request(req, {"salt": salt, "meta": {"label": req_id}})
    CREATED[req_id] = req


def test_seeded_sampling_continues_its_random_stream_across_preemption():
    """A preempted request keeps its runner record (and so its generator): its sampled tokens equal those of
    the same seeded request in a pool large enough that nothing is preempted."""

    def run_seeded(num_blocks):
        sched, runner = make(num_blocks=num_blocks, max_model_len=16)
        for r in "acd":
            _add_seeded(sched, runner, r, *PROMPTS[r])
        return run(sched, runner, {}), runner

    CREATED.clear()
    preempting, runner = run_seeded(num_blocks=5)
    assert sum(CREATED[r].num_preemptions for r in "acd") > 0
    roomy, _ = run_seeded(num_blocks=16)
    assert preempting == roomy
    # The noise really matters: a greedy run picks other tokens.
    assert any(roomy[r] != reference_tokens(PROMPTS[r][0], PROMPTS[r][1], 10) for r in "acd")
    assert len(runner.records) == 0


def test_a_cancelled_step_leaves_every_record_as_it_was():
    sched, runner = make(budget=32)
    for r in "ab":
        _add_seeded(sched, runner, r, *PROMPTS[r], max_tokens=4)
    so = sched.schedule()
    runner.execute_model(so)
    sched.update_from_output(so, runner.sample_tokens().sampled)  # prefill: the records now carry stats
    before = {r: dict(runner.state(r)) for r in "ab"}
    so = sched.schedule()
    runner.execute_model(so)  # fails "after" this (e.g. a later request in the step raised)
    runner.cancel_step()
    sched.cancel_step(so)
    assert {r: dict(runner.state(r)) for r in "ab"} == before
    again = sched.schedule()
    assert again.num_scheduled_tokens == so.num_scheduled_tokens  # the same work is scheduled again
    runner.execute_model(again)
    sched.update_from_output(again, runner.sample_tokens().sampled)
    assert all(runner.state(r)["stats"]["steps"] == 2 for r in "ab")


def test_a_finished_request_that_still_holds_a_record_is_an_error():
    sched, runner = make()
    add(sched, runner, "a", *PROMPTS["a"])
    sched.abort_requests("a")  # the scheduler forgot it, the runner was not told
    with pytest.raises(RuntimeError, match="still hold runner records"):
        runner.execute_model(sched.schedule())
