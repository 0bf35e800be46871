import pytest

from omnistage.core import BlockPool, KVCacheManager


def test_pool_allocate_all_or_nothing_and_free_checks():
    pool = BlockPool(4, 16)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_free_blocks == 1
    assert pool.allocate(2) is None and pool.num_free_blocks == 1
    with pytest.raises(ValueError, match="not allocated"):
        pool.free([a[0], 99])
    assert pool.num_free_blocks == 1  # a failed free changes nothing
    pool.free(a[:1])
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(a[:1])  # double free
    with pytest.raises(ValueError, match="duplicate"):
        pool.free([a[1], a[1]])
    pool.free(a[1:])
    assert pool.num_free_blocks == 4
    pool.check_invariants()


def test_manager_grows_tables_and_frees():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    assert kv.allocate_slots("a", 5) is not None
    assert len(kv.block_ids("a")) == 2
    assert kv.allocate_slots("a", 8) == []  # already covered
    new = kv.allocate_slots("a", 9)
    assert len(new) == 1 and kv.block_ids("a")[-1] == new[0]
    assert len(kv.allocate_slots("b", 12)) == 3
    assert kv.stats().num_free_blocks == 0
    # Not enough blocks: None and no change.
    before = kv.block_ids("b")
    assert kv.allocate_slots("b", 13) is None
    assert kv.block_ids("b") == before
    kv.check_invariants()
    stats = kv.stats()
    assert (stats.num_blocks, stats.num_used_blocks, stats.usage, stats.num_requests) == (6, 6, 1.0, 2)
    kv.free("a")
    kv.free("a")  # double free: no-op
    kv.free("never-seen")  # unknown: no-op
    kv.check_invariants()
    assert kv.stats().num_free_blocks == 3
    assert kv.block_ids("a") == []
    kv.free("b")
    stats = kv.stats()
    assert stats.num_free_blocks == 6 and stats.usage == 0.0 and stats.num_requests == 0


def test_block_ids_returns_a_copy():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    kv.allocate_slots("a", 4)
    kv.block_ids("a").append(123)
    assert len(kv.block_ids("a")) == 1
