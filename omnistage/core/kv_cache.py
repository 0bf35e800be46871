"""Paged KV cache bookkeeping: a pool of fixed-size blocks, per-request block tables and the prefix cache.

Only ids are managed here; the runner owns the tensors the ids index into.

Prefix caching (``enable_prefix_caching``): a block whose every row has been computed can be registered
under its ``BlockKey`` (``core.block_hash``: the parent block's hash, the block's token ids and whatever
else decides its KV). A registered block keeps its key when its last owner lets go of it: it sits in the
free list, still counted as free, and a later request whose block key is equal takes it back instead of
recomputing it. Eviction is LRU among free blocks only (the cache never holds memory a running request
needs): a block is evicted when ``allocate`` hands it out again. Blocks are reference-counted; a shared
block is never written (only full, computed blocks are registered, and a request writes only past the
blocks it took from the cache).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from omnistage.core.block_hash import BlockKey


class BlockPool:
    """Fixed set of block ids [0, num_blocks) with reference counts; allocation is all-or-nothing."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Front = next to hand out (least recently freed). FIFO reuse spreads writes over the pool, so
        # stale-block bugs show up sooner in tests; for cached blocks it is LRU eviction.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._refs: dict[int, int] = {}  # allocated block -> number of tables holding it
        self._keys: dict[int, BlockKey] = {}  # registered (cached) block -> its key; in use or free
        self._by_hash: dict[bytes, int] = {}  # key digest -> registered block
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds, cached ones included (they are reclaimed on demand)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return len(self._refs)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._keys)

    def allocate(self, n: int) -> list[int] | None:
        """n fresh block ids, or None (and no change) if fewer than n are free. Cached ones are evicted."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            return None
        ids = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            key = self._keys.pop(block, None)
            if key is not None:
                del self._by_hash[key.digest]
                self.num_evictions += 1
            self._refs[block] = 1
            ids.append(block)
        return ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block; a block nobody holds goes to the back of the free list (in the
        order given: the first is evicted first). Freeing a block that is not allocated raises and changes
        nothing."""
        ids = list(block_ids)
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate block ids in free(): {ids}")
        bad = [b for b in ids if b not in self._refs]
        if bad:
            raise ValueError(f"freeing blocks that are not allocated: {bad}")
        for b in ids:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                del self._refs[b]
                self._free[b] = None

    # ---- the prefix cache ---------------------------------------------------------------------------
    def lookup(self, key: BlockKey) -> int | None:
        """The registered block whose key equals ``key`` (digest found and the full key compared), or None."""
        block = self._by_hash.get(key.digest)
        if block is None or self._keys[block] != key:
            return None
        return block

    def take(self, block_ids: Sequence[int]) -> None:
        """One more reference to each registered block (a cache hit); free ones leave the free list."""
        for b in block_ids:
            if b not in self._keys:
                raise ValueError(f"block {b} is not cached")
        for b in block_ids:
            if b in self._refs:
                self._refs[b] += 1
            else:
                del self._free[b]
                self._refs[b] = 1

    def register(self, block: int, key: BlockKey) -> bool:
        """Make an allocated, fully computed block findable under ``key``. False (nothing changes) when
        another block already holds that key (the same content was computed twice) or this one has a key."""
        if block not in self._refs:
            raise ValueError(f"block {block} is not allocated")
        if key.digest in self._by_hash or block in self._keys:
            return False
        self._keys[block] = key
        self._by_hash[key.digest] = block
        return True

    def num_free_among(self, block_ids: Iterable[int]) -> int:
        return sum(1 for b in block_ids if b in self._free)

    def check_invariants(self) -> None:
        free = set(self._free)
        assert not (free & self._refs.keys()), "a block is both free and allocated"
        assert len(free) + len(self._refs) == self.num_blocks, "blocks were lost or invented"
        assert all(r >= 1 for r in self._refs.values()), "an allocated block has no reference"
        assert {k.digest: b for b, k in self._keys.items()} == self._by_hash, "cache index out of step"


@dataclass(frozen=True)
class KVCacheStats:
    num_blocks: int
    num_free_blocks: int  # includes cached blocks nobody holds
    num_used_blocks: int
    usage: float  # used / total, in [0, 1]
    num_requests: int
    num_cached_blocks: int = 0  # blocks registered in the prefix cache (held or free)
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache (cumulative)
    prefix_hits: int = 0  # of those, tokens served from the cache (cumulative)
    evictions: int = 0  # cached blocks reclaimed for other content (cumulative)


class KVCacheManager:
    """Block tables keyed by req_id on top of one BlockPool."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._tables: dict[str, list[int]] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def cached_prefix(self, keys: Sequence[BlockKey]) -> list[int]:
        """The registered blocks of the longest prefix of ``keys`` (nothing is taken yet)."""
        blocks: list[int] = []
        if self.enable_prefix_caching:
            for key in keys:
                block = self.pool.lookup(key)
                if block is None:
                    break
                blocks.append(block)
        return blocks

    def note_query(self, num_tokens: int) -> None:
        """Count the tokens of an admitted request that could have come from the cache (the metric's base)."""
        if self.enable_prefix_caching:
            self.prefix_queries += num_tokens

    def allocate_slots(self, req_id: str, num_total_tokens: int, cached: Sequence[int] = ()) -> list[int] | None:
        """Grow req_id's table to cover num_total_tokens; returns only the newly allocated ids.

        ``cached``: blocks from ``cached_prefix`` that start a new table (the request's first
        ``len(cached)`` blocks). Returns None (and changes nothing) when the pool cannot supply the rest.
        Never shrinks a table.
        """
        if num_total_tokens < 0:
            raise ValueError(f"num_total_tokens must be >= 0, got {num_total_tokens}")
        table = self._tables.get(req_id)
        if cached and table:
            raise ValueError(f"request {req_id!r} already holds blocks; cached blocks only start a table")
        have = len(cached) if table is None else len(table)
        need = max(0, self.num_blocks_needed(num_total_tokens) - have)
        # Cached blocks that sit in the free list are taken from it too.
        if need > self.pool.num_free_blocks - self.pool.num_free_among(cached):
            return None
        if cached:
            self.pool.take(cached)
            self.prefix_hits += len(cached) * self.block_size
        new = self.pool.allocate(need)
        assert new is not None  # checked above
        if table is None:
            self._tables[req_id] = list(cached) + new
        else:
            table.extend(new)
        return new

    def register_blocks(self, req_id: str, first: int, keys: Sequence[BlockKey]) -> None:
        """Register the request's blocks ``first, first+1, ...`` (fully computed) under ``keys``."""
        if not self.enable_prefix_caching:
            return
        table = self._tables[req_id]
        for i, key in enumerate(keys, start=first):
            self.pool.register(table[i], key)

    def block_ids(self, req_id: str) -> list[int]:
        """A copy of the request's block table ([] if it has none)."""
        return list(self._tables.get(req_id, ()))

    def has_request(self, req_id: str) -> bool:
        return req_id in self._tables

    def free(self, req_id: str) -> None:
        """Release all of req_id's blocks; unknown (or already freed) ids are a no-op. The last blocks of
        a table are freed first, so they are evicted before the prefix other requests are likelier to share."""
        table = self._tables.pop(req_id, None)
        if table:
            self.pool.free(reversed(table) if self.enable_prefix_caching else table)

    def stats(self) -> KVCacheStats:
        used = self.pool.num_used_blocks
        return KVCacheStats(
            num_blocks=self.num_blocks,
            num_free_blocks=self.pool.num_free_blocks,
            num_used_blocks=used,
            usage=used / self.num_blocks,
            num_requests=len(self._tables),
            num_cached_blocks=self.pool.num_cached_blocks,
            prefix_queries=self.prefix_queries,
            prefix_hits=self.prefix_hits,
            evictions=self.pool.num_evictions,
        )

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        refs: dict[int, int] = {}
        for table in self._tables.values():
            assert len(table) == len(set(table)), "a table holds a block twice"
            for b in table:
                refs[b] = refs.get(b, 0) + 1
        assert refs == self.pool._refs, "reference counts and block tables disagree"
        for b, n in refs.items():
            assert n == 1 or b in self.pool._keys, f"block {b} is shared but not a cached block"
