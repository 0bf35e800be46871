"""A fake "model runner" that drives ARScheduler the way a real runner would and checks its output.

It keeps its own per-request copy of the tokens that are "in the KV cache" and the block table, built
only from SchedulerOutput deltas; the next token is a pure function of that KV content. So a request
whose KV was recomputed after preemption, or that ran in any mix of other requests, must produce
exactly the same tokens as when it ran alone. It also keeps what was written into every block slot: a
request admitted with a prefix-cache hit reads its first tokens from the blocks it was given (they must
hold exactly its tokens), and a write into a block another request holds, or into a cached block, fails.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from omnistage.core import ARScheduler, Phase, Request, SchedulerOutput

VOCAB = 1000


def kv_token_fn(req: Request, kv_tokens: list[int]) -> int:
    acc = 17
    for i, tok in enumerate(kv_tokens):
        acc = (acc * 31 + tok * (i + 3)) % 1_000_003
    return 100 + acc % (VOCAB - 100)  # ids < 100 are kept free for eos/stop ids in tests


@dataclass
class FakeRunner:
    sched: ARScheduler
    token_fn: Callable[[Request, list[int]], int] = kv_token_fn
    kv_tokens: dict[str, list[int]] = field(default_factory=dict)
    blocks: dict[str, list[int]] = field(default_factory=dict)
    outputs: list[SchedulerOutput] = field(default_factory=list)
    block_slots: dict[int, list[int | None]] = field(default_factory=dict)  # what was written where
    cached_tokens: int = 0  # tokens new requests took from the prefix cache

    def step(self) -> tuple[SchedulerOutput, list]:
        sched = self.sched
        cfg = sched.config
        out = sched.schedule()
        self.outputs.append(out)

        assert not (out.preempted_req_ids & out.finished_req_ids)
        for req_id in out.preempted_req_ids:
            assert sched.get_request(req_id).status.name == "PREEMPTED"
            self.kv_tokens.pop(req_id, None)  # its KV is gone; it comes back as a new request
            self.blocks.pop(req_id, None)
        for req_id in out.finished_req_ids:
            self.kv_tokens.pop(req_id, None)
            self.blocks.pop(req_id, None)
        for req_id in out.num_scheduled_tokens:
            if req_id in out.new_req_ids:
                assert req_id not in self.kv_tokens, f"{req_id} re-added while the runner still holds it"
                start = out.num_computed_tokens[req_id]
                assert start == out.num_cached_tokens.get(req_id, 0) and start % cfg.block_size == 0
                kv = self._read(out.block_tables[req_id], start)
                assert kv == sched.get_request(req_id).all_token_ids[:start], f"{req_id}: wrong cached KV"
                self.cached_tokens += start
                self.kv_tokens[req_id] = kv
            else:
                assert req_id in self.kv_tokens, f"cached {req_id} unknown to the runner"
                assert out.num_computed_tokens[req_id] == len(self.kv_tokens[req_id])
                # A running request's table only grows: what the runner used stays put.
                old = self.blocks[req_id]
                assert out.block_tables[req_id][: len(old)] == old
            self.blocks[req_id] = list(out.block_tables[req_id])
        assert out.new_req_ids <= set(out.num_scheduled_tokens)
        assert set(out.block_tables) == set(out.num_computed_tokens) == set(out.num_scheduled_tokens)
        assert not (set(out.num_scheduled_tokens) & out.finished_req_ids)

        # Batch bounds.
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert len(out.num_scheduled_tokens) <= cfg.max_num_seqs
        assert all(n >= 1 for n in out.num_scheduled_tokens.values())
        assert set(out.phases) == set(out.num_scheduled_tokens)
        assert out.sample_req_ids <= set(out.num_scheduled_tokens)

        sampled: dict[str, list[int]] = {}
        for req_id, n in out.num_scheduled_tokens.items():
            req = sched.get_request(req_id)
            kv = self.kv_tokens[req_id]
            start = len(kv)
            assert start + n <= req.num_tokens
            prompt_part = start < req.num_prompt_tokens
            if prompt_part:
                assert out.phases[req_id] is Phase.PREFILL
            self._write(req_id, start, req.all_token_ids[start : start + n])
            kv.extend(req.all_token_ids[start : start + n])
            assert len(self.blocks[req_id]) * cfg.block_size >= len(kv)
            assert self.blocks[req_id] == sched.kv.block_ids(req_id)
            should_sample = len(kv) == req.num_tokens and req.input_finished
            assert (req_id in out.sample_req_ids) == should_sample
            if should_sample:
                sampled[req_id] = [self.token_fn(req, list(kv))]

        updates = sched.update_from_output(out, sampled)
        sched.check_invariants()
        return out, updates

    def _read(self, table: list[int], num_tokens: int) -> list[int | None]:
        bs = self.sched.config.block_size
        return [self.block_slots.get(table[i // bs], [None] * bs)[i % bs] for i in range(num_tokens)]

    def _write(self, req_id: str, start: int, tokens: list[int]) -> None:
        bs = self.sched.config.block_size
        table = self.blocks[req_id]
        for i, tok in enumerate(tokens, start=start):
            block = table[i // bs]
            holders = [r for r, t in self.blocks.items() if block in t]
            assert holders == [req_id], f"{req_id} writes block {block} held by {holders}"
            assert block not in self.sched.kv.pool._keys, f"{req_id} writes cached block {block}"
            self.block_slots.setdefault(block, [None] * bs)[i % bs] = tok

    def run(
        self, max_steps: int = 1000, before_step: Callable[[int], None] | None = None, min_steps: int = 0
    ) -> int:
        """Step until no request is left and every finish was reported; returns the step count."""
        for i in range(max_steps):
            if before_step is not None:
                before_step(i)
            idle = not (self.sched.has_unfinished() or self.sched.has_finished_to_report())
            if idle and i >= min_steps:
                return i
            self.step()
        raise AssertionError(f"not done after {max_steps} steps")

    def assert_clean(self) -> None:
        stats = self.sched.kv_stats()
        assert stats.num_free_blocks == stats.num_blocks
        assert stats.num_requests == 0
        assert not self.sched.has_unfinished()
        assert self.sched.num_running == 0 and self.sched.num_waiting == 0
        assert not self.kv_tokens, f"runner still holds {sorted(self.kv_tokens)}"
