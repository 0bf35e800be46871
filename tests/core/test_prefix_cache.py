"""Prefix caching in the KV manager and the AR scheduler.

The fake runner (sched_driver) reads a hit's KV from what was really written into the blocks it was given
and refuses writes into shared or cached blocks, and its next token is a function of the KV content: so a
request's output equals its output with caching off exactly when every hit handed it the right KV.
"""

import random

import pytest
from sched_driver import FakeRunner

from omnistage.core import ARScheduler, BlockPool, KVCacheManager, Request, SamplingParams, SchedulerConfig
from omnistage.core.block_hash import ROOT, BlockKey, extend_block_keys

BS = 4


def sched_for(prefix: bool = True, **kw) -> ARScheduler:
    base = dict(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64, block_size=BS, num_blocks=64,
                enable_prefix_caching=prefix)
    base.update(kw)
    return ARScheduler(SchedulerConfig(**base))


def req(req_id: str, prompt: list[int], max_tokens: int = 4, t: float = 0.0) -> Request:
    return Request(req_id, list(prompt), SamplingParams(max_tokens=max_tokens), arrival_time=t)


_RUNNERS: dict[int, FakeRunner] = {}


def runner_of(sched: ARScheduler) -> FakeRunner:
    """One fake runner per scheduler: it remembers what was written into the blocks across runs."""
    runner = _RUNNERS.get(id(sched))
    if runner is None or runner.sched is not sched:
        runner = _RUNNERS[id(sched)] = FakeRunner(sched)
    return runner


def run(sched: ARScheduler, reqs: list[Request]) -> FakeRunner:
    """Run reqs to the end; the returned runner's cached_tokens counts this run's hits only."""
    for r in reqs:
        sched.add_request(r)
    runner = runner_of(sched)
    runner.cached_tokens = 0
    runner.run()
    runner.assert_clean()
    return runner


def outputs_without_cache(prompts: dict[str, list[int]], max_tokens: int = 4) -> dict[str, list[int]]:
    out = {}
    for req_id, prompt in prompts.items():
        r = req(req_id, prompt, max_tokens)
        run(sched_for(prefix=False), [r])
        out[req_id] = r.output_token_ids
    return out


SYSTEM = list(range(200, 213))  # 13 tokens: 3 full blocks + 1


def test_block_key_chains_and_a_hit_compares_the_whole_key():
    keys: list[BlockKey] = []
    assert extend_block_keys(keys, list(range(10)), BS, 10, None)
    assert len(keys) == 2 and keys[0].parent == ROOT and keys[1].parent == keys[0].digest
    pool = BlockPool(4, BS)
    (block,) = pool.allocate(1)
    assert pool.register(block, keys[0])
    assert pool.lookup(BlockKey(ROOT, tuple(range(4)))) == block
    # A different block whose digest collides (forged here) is not a hit: the token ids are compared.
    forged = BlockKey(ROOT, (9, 9, 9, 9))
    object.__setattr__(forged, "digest", keys[0].digest)
    assert pool.lookup(forged) is None
    # Same tokens, different extra key (e.g. other media content): another block.
    assert pool.lookup(BlockKey(ROOT, tuple(range(4)), b"media:x")) is None
    # extra None stops the chain: no key for that block or any later one.
    stopped: list[BlockKey] = []
    assert not extend_block_keys(stopped, list(range(12)), BS, 12, lambda s, e: None if s >= 4 else b"")
    assert len(stopped) == 1


def test_lru_eviction_takes_only_free_blocks_and_the_oldest_first():
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_prefix_caching=True)
    keys: list[BlockKey] = []
    extend_block_keys(keys, list(range(16)), BS, 16, None)
    kv.allocate_slots("a", 8)
    kv.register_blocks("a", 0, keys[:2])
    a_blocks = kv.block_ids("a")
    kv.free("a")
    stats = kv.stats()
    assert (stats.num_free_blocks, stats.num_cached_blocks) == (4, 2)
    # A hit takes the cached blocks back (out of the free list) and shares them.
    hit = kv.cached_prefix(keys)
    assert hit == a_blocks
    assert kv.allocate_slots("b", 12, hit) is not None and kv.block_ids("b")[:2] == a_blocks
    assert kv.allocate_slots("c", 8, hit[:1]) is not None  # block 0 now held twice
    kv.check_invariants()
    assert kv.stats().num_free_blocks == 0
    # Nothing free: a held cached block is never evicted for a new request.
    assert kv.allocate_slots("d", 4) is None
    kv.free("c")
    kv.free("b")
    # b freed its last block first: the tail block is evicted before the shared prefix.
    new = kv.allocate_slots("d", 4)
    assert new is not None and new[0] not in a_blocks
    assert kv.cached_prefix(keys) == a_blocks
    new = kv.allocate_slots("e", 12)
    assert new is not None and kv.stats().evictions == 2 and kv.cached_prefix(keys) == []
    kv.free("d")
    kv.free("e")
    kv.check_invariants()
    assert kv.stats().num_free_blocks == 4


@pytest.mark.parametrize("case", ["none", "some", "all", "exact_prefix", "same_prompt"])
def test_shared_blocks_are_reused_and_outputs_equal_caching_off(case):
    first = SYSTEM + [50, 51, 52]  # 16 tokens: 4 full blocks
    second = {
        "none": [60 + i for i in range(16)],
        "some": SYSTEM + [70, 71, 72, 73, 74],  # shares 3 full blocks
        "all": first + [80, 81, 82],  # shares all 4
        "exact_prefix": first[:12],  # the first's first 3 blocks, exactly: the last block is recomputed
        "same_prompt": list(first),  # all but the last token from the cache
    }[case]
    expect_cached = {"none": 0, "some": 12, "all": 16, "exact_prefix": 8, "same_prompt": 12}[case]
    sched = sched_for()
    a = req("a", first)
    run(sched, [a])
    b = req("b", second)
    runner = run(sched, [b])
    assert b.num_cached_tokens == expect_cached == runner.cached_tokens
    assert {"a": a.output_token_ids, "b": b.output_token_ids} == outputs_without_cache({"a": first, "b": second})
    stats = sched.kv_stats()
    assert stats.prefix_hits == expect_cached and stats.prefix_queries == len(first) + len(second)


def test_output_blocks_are_cached_for_the_next_turn():
    # Turn 2's prompt = turn 1's prompt + its answer + a new user message: the answer's blocks hit too.
    sched = sched_for()
    t1 = req("t1", SYSTEM + [1, 2, 3], max_tokens=9)
    run(sched, [t1])
    history = t1.prompt_token_ids + t1.output_token_ids  # 25 tokens; the last answer token was never fed
    t2 = req("t2", history + [5, 6, 7])
    run(sched, [t2])
    assert t2.num_cached_tokens == 24  # 24 of its 25 tokens were computed: 6 full blocks, all cached
    assert t2.output_token_ids == outputs_without_cache({"t2": t2.prompt_token_ids})["t2"]


def test_concurrent_requests_share_a_prefix_without_writing_shared_blocks():
    sched = sched_for()
    warm = req("warm", SYSTEM + [9])
    run(sched, [warm])
    reqs = [req(f"r{i}", SYSTEM + [10 + i, 11 + i], t=i) for i in range(6)]
    runner = run(sched, reqs)
    assert runner.cached_tokens == 6 * 12
    prompts = {r.req_id: r.prompt_token_ids for r in reqs}
    assert {r.req_id: r.output_token_ids for r in reqs} == outputs_without_cache(prompts)


def test_requests_arriving_together_wait_a_step_for_a_prefix_another_computes():
    """Six requests with one 3-block system prompt arrive at once into an empty cache: the first computes it,
    the others wait one step and take it from the cache (instead of computing it six times), and a request
    sharing nothing is admitted meanwhile. Outputs equal caching off."""
    sched = sched_for()
    reqs = [req(f"r{i}", SYSTEM + [10 + i, 11 + i], t=i) for i in range(6)]
    other = req("other", [60 + i for i in range(9)], t=6)
    for r in reqs + [other]:
        sched.add_request(r)
    runner = runner_of(sched)
    first, _ = runner.step()
    assert set(first.num_scheduled_tokens) == {"r0", "other"} and not first.num_cached_tokens
    second, _ = runner.step()
    assert second.num_cached_tokens == {f"r{i}": 12 for i in range(1, 6)}
    runner.run()
    runner.assert_clean()
    prompts = {r.req_id: r.prompt_token_ids for r in reqs + [other]}
    assert {r.req_id: r.output_token_ids for r in reqs + [other]} == outputs_without_cache(prompts)
    # Caching off: nobody waits (the token budget alone decides).
    off = sched_for(prefix=False)
    for r in [req(f"r{i}", SYSTEM + [10 + i, 11 + i], t=i) for i in range(6)]:
        off.add_request(r)
    assert list(off.schedule().num_scheduled_tokens) == ["r0", "r1", "r2"]


def test_hit_limit_and_extra_keys_are_respected():
    sched = sched_for()
    a = req("a", SYSTEM + [1, 2, 3])
    a.extra_key = lambda s, e: b"x"
    run(sched, [a])
    b = req("b", SYSTEM + [4])
    b.extra_key = lambda s, e: b"y" if s >= 8 else b"x"  # differs from the third block on
    run(sched, [b])
    assert b.num_cached_tokens == 8
    c = req("c", SYSTEM + [5])
    c.extra_key = a.extra_key
    c.hit_limit = lambda: 5  # e.g. rows whose side outputs must be computed start at 5
    run(sched, [c])
    assert c.num_cached_tokens == 4


def test_a_prompt_still_arriving_keeps_its_last_known_token_computed():
    sched = sched_for()
    run(sched, [req("a", SYSTEM + [1, 2, 3])])
    b = Request("b", SYSTEM[:8] + [7], SamplingParams(max_tokens=3), input_finished=False)
    sched.add_request(b)
    runner = runner_of(sched)
    out, _ = runner.step()
    # 9 known, 8 schedulable (the last is held back): only one block may come from the cache.
    assert out.num_cached_tokens == {"b": 4} and out.num_scheduled_tokens == {"b": 4}
    sched.add_input("b", [8], finished=True)
    runner.run()
    runner.assert_clean()


def test_abort_mid_prefill_frees_everything_and_keeps_only_computed_blocks():
    sched = sched_for(max_num_batched_tokens=8)
    a = req("a", SYSTEM + list(range(30, 43)))  # 26 tokens: 4 chunks
    sched.add_request(a)
    runner = runner_of(sched)
    runner.step()
    runner.step()  # 16 tokens computed: 4 blocks registered
    sched.abort_requests("a")
    runner.run()
    runner.assert_clean()
    assert sched.kv_stats().num_cached_blocks == 4
    b = req("b", SYSTEM + list(range(30, 43)))
    run(sched, [b])
    assert b.num_cached_tokens == 16
    assert b.output_token_ids == outputs_without_cache({"b": b.prompt_token_ids})["b"]


def test_a_cancelled_step_tells_its_cache_hits_again_in_the_next_one():
    """A step that admitted a hit and then failed before running (another request's fault) is scheduled again;
    the hit is reported again there, since the model makes what the cached rows would have produced (the
    Talker's rows) in the step it sees the hit. A second cancel tells it a third time."""
    sched = sched_for(max_num_batched_tokens=8)
    run(sched, [req("a", SYSTEM + [1, 2, 3])])
    sched.add_request(req("b", SYSTEM + [4, 5, 6]))
    first = sched.schedule()
    assert first.num_cached_tokens == {"b": 12} and first.new_req_ids == {"b"}
    sched.cancel_step(first)
    again = sched.schedule()
    assert again.num_cached_tokens == {"b": 12} and again.num_computed_tokens == {"b": 12}
    assert again.new_req_ids == {"b"}  # the runner never saw the first admission
    sched.cancel_step(again)
    runner = runner_of(sched)
    runner.cached_tokens = 0
    runner.run()
    runner.assert_clean()
    assert runner.cached_tokens == 12  # told once by the step that ran, not once per try
    later = req("c", SYSTEM + [4, 5, 6])
    assert run(sched, [later]).cached_tokens == 12


def test_a_cancelled_hit_is_not_told_after_its_request_left():
    sched = sched_for()
    run(sched, [req("a", SYSTEM + [1, 2, 3])])
    sched.add_request(req("b", SYSTEM + [4, 5, 6]))
    sched.cancel_step(sched.schedule())
    sched.abort_requests("b")
    assert sched.schedule().is_empty  # reports b finished; its untold admission is dropped
    sched.add_request(req("b", SYSTEM + [4, 5, 6]))  # the same id again, a new request: its own hit only
    out = sched.schedule()
    assert out.num_cached_tokens == {"b": 12} and out.new_req_ids == {"b"}
    sched.cancel_step(out)
    runner = runner_of(sched)
    runner.run()
    runner.assert_clean()


def test_caching_off_never_hits():
    sched = sched_for(prefix=False)
    run(sched, [req("a", SYSTEM + [1])])
    b = req("b", SYSTEM + [1])
    runner = run(sched, [b])
    stats = sched.kv_stats()
    assert runner.cached_tokens == 0 and stats.num_cached_blocks == 0 and stats.prefix_queries == 0


@pytest.mark.parametrize("seed", range(6))
def test_random_schedules_with_eviction_under_a_tiny_pool(seed):
    """Requests built from a few shared prefixes arrive over time into a pool that holds about two of
    them (preemption and eviction are constant), some are aborted (also mid-prefill); every survivor's
    output equals its output with caching off, and the pool ends full and consistent."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(100, 900) for _ in range(rng.randrange(3, 14))] for _ in range(3)]
    prompts = {}
    for i in range(14):
        p = rng.choice(prefixes)[: rng.randrange(1, 14)] + [rng.randrange(100, 900) for _ in range(rng.randrange(0, 5))]
        prompts[f"r{i}"] = p or [1]
    sched = sched_for(num_blocks=8, max_model_len=24, max_num_batched_tokens=rng.choice([5, 8, 32]), max_num_seqs=4)
    reqs = {k: req(k, p, max_tokens=rng.randrange(1, 8), t=float(i)) for i, (k, p) in enumerate(prompts.items())}
    order = list(reqs.values())
    aborted: set[str] = set()
    runner = FakeRunner(sched)

    def before(step: int) -> None:
        while order and rng.random() < 0.5:
            sched.add_request(order.pop(0))
        live = [r for r in reqs.values() if sched.get_request(r.req_id) is not None and not r.is_finished]
        if live and rng.random() < 0.08:
            victim = rng.choice(live).req_id
            aborted.add(victim)
            sched.abort_requests(victim)

    runner.run(max_steps=2000, before_step=before, min_steps=len(order) * 4)
    while order:
        sched.add_request(order.pop(0))
        runner.run()
    runner.assert_clean()
    stats = sched.kv_stats()
    assert stats.num_free_blocks == stats.num_blocks and stats.prefix_hits == runner.cached_tokens
    expected = outputs_without_cache({k: p for k, p in prompts.items() if k not in aborted}, max_tokens=8)
    for k, want in expected.items():
        r = reqs[k]
        assert r.output_token_ids == want[: min(r.sampling_params.max_tokens, 24 - r.num_prompt_tokens)], k
    assert runner.cached_tokens > 0 and stats.evictions > 0
    assert any(o.preempted_req_ids for o in runner.outputs)
