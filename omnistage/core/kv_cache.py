"""Paged KV cache bookkeeping: a pool of fixed-size blocks and per-request block tables.

Only ids are managed here; the runner owns the tensors the ids index into.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass


class BlockPool:
    """Fixed set of block ids [0, num_blocks); allocation is all-or-nothing."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # FIFO reuse spreads writes over the pool, so stale-block bugs show up sooner in tests.
        self._free: deque[int] = deque(range(num_blocks))
        self._allocated: set[int] = set()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return len(self._allocated)

    def allocate(self, n: int) -> list[int] | None:
        """n block ids, or None (and no change) if fewer than n are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            return None
        ids = [self._free.popleft() for _ in range(n)]
        self._allocated.update(ids)
        return ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Return blocks to the pool. Freeing a block that is not allocated raises and changes nothing."""
        ids = list(block_ids)
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate block ids in free(): {ids}")
        bad = [b for b in ids if b not in self._allocated]
        if bad:
            raise ValueError(f"freeing blocks that are not allocated: {bad}")
        self._allocated.difference_update(ids)
        self._free.extend(ids)

    def check_invariants(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a block is in the free list twice"
        assert not (free & self._allocated), "a block is both free and allocated"
        assert len(free) + len(self._allocated) == self.num_blocks, "blocks were lost or invented"


@dataclass(frozen=True)
class KVCacheStats:
    num_blocks: int
    num_free_blocks: int
    num_used_blocks: int
    usage: float  # used / total, in [0, 1]
    num_requests: int


class KVCacheManager:
    """Block tables keyed by req_id on top of one BlockPool."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._tables: dict[str, list[int]] = {}

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_slots(self, req_id: str, num_total_tokens: int) -> list[int] | None:
        """Grow req_id's table to cover num_total_tokens; returns only the newly added ids.

        Returns None (and changes nothing) when the pool cannot supply them. Never shrinks a table.
        """
        if num_total_tokens < 0:
            raise ValueError(f"num_total_tokens must be >= 0, got {num_total_tokens}")
        table = self._tables.get(req_id)
        have = 0 if table is None else len(table)
        need = self.num_blocks_needed(num_total_tokens) - have
        if need <= 0:
            if table is None:
                self._tables[req_id] = []
            return []
        new = self.pool.allocate(need)
        if new is None:
            return None
        if table is None:
            self._tables[req_id] = new.copy()
        else:
            table.extend(new)
        return new

    def block_ids(self, req_id: str) -> list[int]:
        """A copy of the request's block table ([] if it has none)."""
        return list(self._tables.get(req_id, ()))

    def has_request(self, req_id: str) -> bool:
        return req_id in self._tables

    def free(self, req_id: str) -> None:
        """Release all of req_id's blocks; unknown (or already freed) ids are a no-op."""
        table = self._tables.pop(req_id, None)
        if table:
            self.pool.free(table)

    def stats(self) -> KVCacheStats:
        used = self.pool.num_used_blocks
        return KVCacheStats(
            num_blocks=self.num_blocks,
            num_free_blocks=self.pool.num_free_blocks,
            num_used_blocks=used,
            usage=used / self.num_blocks,
            num_requests=len(self._tables),
        )

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        owned = [b for table in self._tables.values() for b in table]
        assert len(owned) == len(set(owned)), "a block is owned by two tables"
        assert set(owned) == self.pool._allocated, "allocated blocks and block tables disagree"
