import random
import zlib

import pytest
from sched_driver import FakeRunner

from omnistage.core import ARScheduler, Phase, Request, RequestStatus, SamplingParams, SchedulerConfig


def make_sched(**kw) -> ARScheduler:
    base = dict(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64, block_size=4, num_blocks=64)
    base.update(kw)
    return ARScheduler(SchedulerConfig(**base))


def make_req(req_id: str, prompt_len: int, max_tokens: int = 5, t: float = 0.0, **sp) -> Request:
    # A fixed per-id start (not hash(): str hashes are salted per process, and about 1 run in 90 gave "a" and "b"
    # the same prompt start, which prefix caching, on by default, then served from cache).
    prompt = [(zlib.crc32(req_id.encode()) + i * 7) % 90 + 100 for i in range(prompt_len)]
    return Request(req_id, prompt, SamplingParams(max_tokens=max_tokens, **sp), arrival_time=t)


def run_alone(req: Request, **cfg) -> list[int]:
    """Reference output: the same request alone in a scheduler with a roomy pool."""
    sched = make_sched(**cfg)
    clone = Request(req.req_id, list(req.prompt_token_ids), req.sampling_params, arrival_time=0.0)
    sched.add_request(clone)
    runner = FakeRunner(sched)
    runner.run()
    runner.assert_clean()
    return clone.output_token_ids


def test_basic_run_respects_budget_and_finishes_everything():
    sched = make_sched(max_num_batched_tokens=16)
    reqs = [make_req(f"r{i}", n, max_tokens=4 + i, t=i) for i, n in enumerate([3, 20, 9, 1, 15])]
    for r in reqs:
        sched.add_request(r)
    runner = FakeRunner(sched)
    runner.run()
    runner.assert_clean()
    assert max(o.total_num_scheduled_tokens for o in runner.outputs) == 16
    for i, r in enumerate(reqs):
        assert r.status is RequestStatus.FINISHED_LENGTH and r.finish_reason == "length"
        assert r.num_output_tokens == 4 + i
        assert r.output_token_ids == run_alone(r)  # batch invariance


def test_chunked_prefill_interleaves_with_decodes():
    sched = make_sched(max_num_batched_tokens=10)
    a = make_req("a", 4, max_tokens=12, t=0)
    sched.add_request(a)
    runner = FakeRunner(sched)
    runner.step()  # a: prefill 4 tokens, sampled
    assert a.num_output_tokens == 1
    b = make_req("b", 30, max_tokens=2, t=1)
    sched.add_request(b)
    chunks = []
    while not sched.get_request("b").output_token_ids:
        out, _ = runner.step()
        # a decodes first in every step, then b takes the rest of the budget.
        assert list(out.num_scheduled_tokens)[0] == "a"
        assert out.num_scheduled_tokens["a"] == 1 and out.phases["a"] is Phase.DECODE
        assert "a" in out.sample_req_ids
        assert out.phases["b"] is Phase.PREFILL
        chunks.append(out.num_scheduled_tokens["b"])
        assert ("b" in out.sample_req_ids) == (sum(chunks) == 30)
    assert chunks == [9, 9, 9, 3]
    # b was new only in its first step.
    firsts = [o for o in runner.outputs if "b" in o.new_req_ids]
    assert len(firsts) == 1
    runner.run()
    runner.assert_clean()
    assert a.output_token_ids == run_alone(a) and b.output_token_ids == run_alone(b)


def test_without_chunked_prefill_a_prompt_that_does_not_fit_waits():
    sched = make_sched(max_num_batched_tokens=64, enable_chunked_prefill=False, num_blocks=40)
    a = make_req("a", 4, max_tokens=6, t=0)
    sched.add_request(a)
    runner = FakeRunner(sched)
    runner.step()
    b = make_req("b", 64, max_tokens=1, t=1)  # needs the whole budget; a's decode takes 1 token
    sched.add_request(b)
    while sched.get_request("a") is not None and not sched.get_request("a").is_finished:
        out, _ = runner.step()
        assert "b" not in out.num_scheduled_tokens
    out, _ = runner.step()
    assert out.num_scheduled_tokens == {"b": 64}
    runner.run()
    runner.assert_clean()
    assert b.num_output_tokens == 1


def test_max_num_seqs_bounds_the_batch():
    sched = make_sched(max_num_seqs=2)
    reqs = [make_req(f"r{i}", 5, max_tokens=3, t=i) for i in range(6)]
    for r in reqs:
        sched.add_request(r)
    runner = FakeRunner(sched)
    runner.run()
    runner.assert_clean()
    assert max(len(o.num_scheduled_tokens) for o in runner.outputs) == 2
    # FCFS: requests are first admitted in arrival order.
    first_seen = []
    for o in runner.outputs:
        first_seen += [r for r in o.num_scheduled_tokens if r in o.new_req_ids]
    assert first_seen == [f"r{i}" for i in range(6)]
    assert all(r.output_token_ids == run_alone(r) for r in reqs)


def test_preemption_recomputes_and_completes():
    # 8 blocks of 4 tokens; three requests of 6 prompt tokens growing to 16 tokens cannot all fit.
    sched = make_sched(num_blocks=8, max_model_len=32)
    reqs = [make_req(f"r{i}", 6, max_tokens=10, t=i) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    runner = FakeRunner(sched)
    runner.run()
    runner.assert_clean()
    assert sum(r.num_preemptions for r in reqs) >= 1
    # The most recently arrived request is the first victim.
    first_preempt = next(o for o in runner.outputs if o.preempted_req_ids)
    assert first_preempt.preempted_req_ids == {"r2"} and not first_preempt.finished_req_ids
    assert not first_preempt.new_req_ids  # no admission in a step that preempted
    # It comes back as a new request that recomputes prompt + outputs so far.
    idx = runner.outputs.index(first_preempt)
    back = next(o for o in runner.outputs[idx + 1 :] if "r2" in o.new_req_ids)
    assert back.num_computed_tokens["r2"] == 0
    # All known tokens (prompt + outputs so far) in one step, then sampled: the recompute is complete.
    assert back.num_scheduled_tokens["r2"] > reqs[2].num_prompt_tokens
    assert back.phases["r2"] is Phase.PREFILL and "r2" in back.sample_req_ids
    for r in reqs:
        assert r.num_output_tokens == 10 and r.status is RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == run_alone(r)


def test_preemption_of_an_already_scheduled_decode_returns_its_budget():
    # r_late arrives later but is admitted first (it is the only one at the start); the prefill of
    # r_early then needs blocks, so r_late, already scheduled for a decode in this step, is preempted.
    sched = make_sched(num_blocks=5, max_model_len=20, max_num_batched_tokens=8)
    late = make_req("late", 3, max_tokens=12, t=10.0)
    sched.add_request(late)
    runner = FakeRunner(sched)
    runner.step()
    early = Request("early", [101] * 15, SamplingParams(max_tokens=5), arrival_time=0.0)
    sched.add_request(early)
    runner.run()
    runner.assert_clean()
    assert late.num_preemptions >= 1
    assert late.output_token_ids == run_alone(late)


def test_stop_conditions():
    script = {
        "eos": [150, 151, 2, 152],
        "min": [2, 2, 2, 2, 153],
        "stopid": [9, 154, 9, 155],
        "ign": [2, 2, 2, 2, 2, 2],
        "len": [160, 161, 162, 163, 164],
    }
    sched = make_sched()
    params = {
        "eos": SamplingParams(max_tokens=10),
        "min": SamplingParams(max_tokens=10, min_tokens=3),
        "stopid": SamplingParams(max_tokens=10, min_tokens=1, stop_token_ids=[9]),
        "ign": SamplingParams(max_tokens=4, ignore_eos=True),
        "len": SamplingParams(max_tokens=3),
    }
    reqs = {
        k: Request(k, [120, 121], params[k], eos_token_ids=(2,), arrival_time=i) for i, k in enumerate(script)
    }
    for r in reqs.values():
        sched.add_request(r)
    runner = FakeRunner(sched, token_fn=lambda req, kv: script[req.req_id][req.num_output_tokens])
    runner.run()
    runner.assert_clean()
    expected = {
        "eos": ([150, 151, 2], "stop"),
        "min": ([2, 2, 2, 2], "stop"),
        "stopid": ([9, 154, 9], "stop"),
        "ign": ([2, 2, 2, 2], "length"),
        "len": ([160, 161, 162], "length"),
    }
    assert {k: (r.output_token_ids, r.finish_reason) for k, r in reqs.items()} == expected


def test_max_model_len_and_multi_token_updates():
    sched = make_sched(max_model_len=12)
    r = make_req("a", 10, max_tokens=50)
    sched.add_request(r)
    out = sched.schedule()
    [upd] = sched.update_from_output(out, {"a": [150]})
    assert upd.new_token_ids == [150] and not upd.finished
    out = sched.schedule()
    [upd] = sched.update_from_output(out, {"a": [151, 152]})  # tokens past the limit are dropped
    assert (upd.new_token_ids, upd.finished, upd.finish_reason) == ([151], True, "length")
    assert r.output_token_ids == [150, 151]
    out = sched.schedule()
    assert out.finished_req_ids == {"a"} and out.is_empty
    assert sched.kv_stats().num_free_blocks == 64

    sched = make_sched()
    r = Request("b", [120], SamplingParams(max_tokens=10), eos_token_ids=(2,))
    sched.add_request(r)
    [upd] = sched.update_from_output(sched.schedule(), {"b": [150, 2, 151]})
    assert (upd.new_token_ids, upd.finish_reason) == ([150, 2], "stop")


def test_abort_in_every_state():
    sched = make_sched(max_num_seqs=2)
    runner = FakeRunner(sched)
    run1, run2 = make_req("run1", 6, max_tokens=50, t=0), make_req("run2", 6, max_tokens=50, t=1)
    queued = make_req("queued", 6, t=2)
    idle = Request("idle", [], SamplingParams(), arrival_time=3)
    for r in (run1, run2, queued):
        sched.add_request(r)
    sched.add_request(idle, wait_for_input=True)
    assert idle.status is RequestStatus.WAITING_FOR_INPUT
    runner.step()
    runner.step()
    assert queued.status is RequestStatus.WAITING and run1.status is RequestStatus.RUNNING
    sched.pause_for_input("run2")
    assert run2.status is RequestStatus.WAITING_FOR_INPUT
    used = sched.kv_stats().num_used_blocks

    sched.abort_requests(["queued", "idle", "run1", "run2", "unknown"])
    for r in (run1, run2, queued, idle):
        assert r.status is RequestStatus.FINISHED_ABORTED and r.finish_reason == "abort"
        assert sched.get_request(r.req_id) is r  # visible until reported
    assert sched.kv_stats().num_free_blocks == 64 and used > 0  # running/paused freed at once
    assert not sched.has_unfinished() and sched.has_finished_to_report()
    assert sched.add_input("idle", [5], finished=True) is False  # late input is ignored
    out, _ = runner.step()
    assert out.is_empty and out.finished_req_ids == {"queued", "idle", "run1", "run2"}
    assert sched.get_request("run1") is None
    runner.run()
    runner.assert_clean()


def test_abort_between_schedule_and_update():
    sched = make_sched()
    a, b = make_req("a", 5, t=0), make_req("b", 5, t=1)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    sched.abort_requests("a")
    # The runner still sampled for "a"; those tokens are ignored.
    updates = sched.update_from_output(out, {"a": [150], "b": [151]})
    assert [u.req_id for u in updates] == ["b"] and a.output_token_ids == []
    runner = FakeRunner(sched)
    runner.kv_tokens["b"] = list(b.prompt_token_ids)
    runner.blocks["b"] = sched.kv.block_ids("b")
    out, _ = runner.step()
    assert out.finished_req_ids == {"a"}
    runner.run()
    runner.assert_clean()


def test_input_arrives_in_chunks():
    sched = make_sched()
    runner = FakeRunner(sched)
    other = make_req("other", 3, max_tokens=8, t=0)
    r = Request("s", [], SamplingParams(max_tokens=3), arrival_time=1)
    sched.add_request(other)
    sched.add_request(r, wait_for_input=True)
    out, _ = runner.step()
    assert "s" not in out.num_scheduled_tokens and r.status is RequestStatus.WAITING_FOR_INPUT
    assert sched.num_waiting == 1

    sched.add_input("s", [110, 111, 112, 113, 114], finished=False)
    out, _ = runner.step()
    # The last arrived token is held back until the input is complete (it is the one to sample from).
    assert out.num_scheduled_tokens["s"] == 4 and "s" not in out.sample_req_ids
    out, _ = runner.step()
    assert "s" not in out.num_scheduled_tokens and r.status is RequestStatus.WAITING_FOR_INPUT
    assert "other" in out.num_scheduled_tokens  # others are not blocked

    sched.add_input("s", [115, 116, 117], finished=False)
    assert r.status is RequestStatus.RUNNING
    out, _ = runner.step()
    assert out.num_scheduled_tokens["s"] == 3 and "s" not in out.sample_req_ids
    assert out.phases["s"] is Phase.PREFILL

    sched.add_input("s", [], finished=True)
    out, _ = runner.step()
    assert out.num_scheduled_tokens["s"] == 1 and "s" in out.sample_req_ids
    assert out.phases["s"] is Phase.PREFILL  # a one-token rest of the prompt is still prefill
    assert r.num_output_tokens == 1
    with pytest.raises(ValueError, match="already marked finished"):
        sched.add_input("s", [1], finished=True)
    runner.run()
    runner.assert_clean()
    assert r.prompt_token_ids == [110, 111, 112, 113, 114, 115, 116, 117]
    assert r.output_token_ids == run_alone(r)


def test_input_that_arrives_all_at_once_while_registered():
    sched = make_sched()
    r = Request("s", [], SamplingParams(max_tokens=2))
    sched.add_request(r, wait_for_input=True)
    runner = FakeRunner(sched)
    out, _ = runner.step()
    assert out.is_empty
    sched.add_input("s", [101, 102, 103], finished=True)
    assert r.status is RequestStatus.WAITING
    out, _ = runner.step()
    assert out.num_scheduled_tokens == {"s": 3} and out.sample_req_ids == {"s"}
    runner.run()
    runner.assert_clean()


def test_paused_request_keeps_blocks_and_does_not_block_others():
    sched = make_sched()
    runner = FakeRunner(sched)
    a, b = make_req("a", 4, max_tokens=8, t=0), make_req("b", 4, max_tokens=8, t=1)
    sched.add_request(a)
    sched.add_request(b)
    runner.step()
    sched.pause_for_input("a")
    blocks = sched.kv.block_ids("a")
    for _ in range(3):
        out, _ = runner.step()
        assert list(out.num_scheduled_tokens) == ["b"]
        assert "a" not in out.finished_req_ids
    assert sched.kv.block_ids("a") == blocks and a.num_output_tokens == 1
    assert sched.num_running == 1 and sched.num_waiting == 1 and sched.is_paused("a")
    sched.resume("a")
    assert a.status is RequestStatus.RUNNING
    out, _ = runner.step()
    assert out.num_scheduled_tokens["a"] == 1 and out.phases["a"] is Phase.DECODE
    assert "a" in out.num_scheduled_tokens and "a" not in out.new_req_ids
    runner.run()
    runner.assert_clean()
    assert a.output_token_ids == run_alone(a) and b.output_token_ids == run_alone(b)
    with pytest.raises(ValueError, match="not running"):
        sched.pause_for_input("a")


def test_stage_driven_finish():
    sched = make_sched()
    r = make_req("a", 4, max_tokens=20)
    sched.add_request(r)
    runner = FakeRunner(sched)
    runner.step()
    assert sched.finish_request("a", "stop")
    assert r.status is RequestStatus.FINISHED_STOPPED and sched.kv_stats().num_free_blocks == 64
    assert not sched.finish_request("a", "stop")
    with pytest.raises(ValueError, match="finish reason"):
        sched.finish_request("a", "bogus")
    runner.run()
    runner.assert_clean()


def test_errors_and_step_pairing():
    sched = make_sched(max_model_len=16)
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(make_req("long", 17))
    sched.add_request(make_req("a", 4))
    with pytest.raises(ValueError, match="already registered"):
        sched.add_request(make_req("a", 4))
    with pytest.raises(ValueError, match="empty prompt"):
        sched.add_request(Request("e", []))
    sched.add_request(Request("w", [], SamplingParams()), wait_for_input=True)
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_input("w", [1] * 17, finished=True)
    with pytest.raises(ValueError, match="without any token"):
        sched.add_input("w", [], finished=True)
    assert sched.get_request("w").num_prompt_tokens == 0  # failed input changed nothing

    out = sched.schedule()
    with pytest.raises(RuntimeError, match="before update_from_output"):
        sched.schedule()
    with pytest.raises(ValueError, match="no sampled tokens"):
        sched.update_from_output(out, {})
    with pytest.raises(ValueError, match="not scheduled for sampling"):
        sched.update_from_output(out, {"a": [1], "w": [3]})
    sched.update_from_output(out, {"a": [150]})
    with pytest.raises(RuntimeError, match="expected step"):
        sched.update_from_output(out, {"a": [150]})


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"block_size": 0}, "block_size"),
        ({"num_blocks": 1}, "max_model_len"),
        ({"enable_chunked_prefill": False, "max_num_batched_tokens": 100}, "enable_chunked_prefill"),
        ({"max_model_len": 1.5}, "max_model_len"),
    ],
)
def test_config_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**kwargs)


RANDOM_CONFIGS = {
    "chunked": dict(max_num_seqs=5, max_num_batched_tokens=12, max_model_len=40, block_size=4, num_blocks=14),
    "unchunked": dict(
        max_num_seqs=4,
        max_num_batched_tokens=40,
        max_model_len=40,
        block_size=3,
        num_blocks=16,
        enable_chunked_prefill=False,
    ),
}


def random_traffic(seed: int, cfg: dict) -> tuple[dict[str, Request], set[str]]:
    """Arrivals, chunked input, pauses, resumes and aborts against a tight pool, with checks every step."""
    rng = random.Random(seed)
    sched = make_sched(**cfg)
    runner = FakeRunner(sched)
    reqs: dict[str, Request] = {}
    streams: dict[str, list[int]] = {}  # prompt tokens not yet delivered
    aborted: set[str] = set()

    def before_step(step: int) -> None:
        if step < 60 and rng.random() < 0.4:
            req_id = f"r{len(reqs)}"
            prompt = [rng.randrange(100, 1000) for _ in range(rng.randint(1, 20))]
            r = Request(req_id, [], SamplingParams(max_tokens=rng.randint(1, 12)), arrival_time=step)
            reqs[req_id] = r
            if rng.random() < 0.5:
                sched.add_request(r, wait_for_input=True)
                streams[req_id] = prompt
            else:
                r.append_prompt_token_ids(prompt)
                sched.add_request(r)
        for req_id, rest in list(streams.items()):
            if rng.random() < 0.5:
                k = rng.randint(0, len(rest))
                done = k == len(rest)
                sched.add_input(req_id, rest[:k], finished=done)
                del rest[:k]
                if done:
                    del streams[req_id]
        for req_id, r in reqs.items():
            if r.status is RequestStatus.RUNNING and rng.random() < 0.1:
                sched.pause_for_input(req_id)
            elif sched.is_paused(req_id) and rng.random() < 0.4:
                sched.resume(req_id)
        if rng.random() < 0.05 and sched.has_unfinished():
            victim = rng.choice([k for k, r in reqs.items() if not r.is_finished])
            streams.pop(victim, None)
            aborted.add(victim)
            sched.abort_requests([victim])

    runner.run(max_steps=2000, before_step=before_step, min_steps=60)
    runner.assert_clean()
    return reqs, aborted


@pytest.mark.parametrize("name", sorted(RANDOM_CONFIGS))
def test_random_traffic_is_batch_invariant(name):
    """Every surviving request produces exactly its solo-run tokens, whatever happened around it."""
    cfg = RANDOM_CONFIGS[name]
    num_preemptions = num_aborted = 0
    for seed in range(6):
        reqs, aborted = random_traffic(seed, cfg)
        num_preemptions += sum(r.num_preemptions for r in reqs.values())
        num_aborted += len(aborted)
        for req_id, r in reqs.items():
            if req_id in aborted:
                assert r.status is RequestStatus.FINISHED_ABORTED
                continue
            assert r.status is RequestStatus.FINISHED_LENGTH
            assert r.output_token_ids == run_alone(r, **cfg), (seed, req_id)
    assert num_preemptions > 0 and num_aborted > 0  # the scenarios exercised what they are for
