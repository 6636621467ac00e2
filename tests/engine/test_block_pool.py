"""Block pool: exact block ids, exact free-queue / eviction order, integrity after mixed use."""

from __future__ import annotations

import pytest

from cachestore.hashing import BlockHash
from engine.sched.block_pool import BlockPool, KVCacheBlock


def _h(i: int) -> BlockHash:
    return BlockHash(bytes([i]) * 32)


def _toks(i: int) -> list[int]:
    return [i] * 16


class RecordingListener:
    def __init__(self) -> None:
        self.events: list[tuple[str, int, BlockHash]] = []

    def on_block_freed(self, block_id: int, block_hash: BlockHash) -> None:
        self.events.append(("freed", block_id, block_hash))

    def on_block_evicted(self, block_id: int, block_hash: BlockHash) -> None:
        self.events.append(("evicted", block_id, block_hash))


def _queue_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_queue.blocks()]


def test_fresh_pool_hands_out_ids_in_order() -> None:
    pool = BlockPool(6)
    pool.check_integrity()
    assert _queue_ids(pool) == [0, 1, 2, 3, 4, 5]
    got = pool.get_new_blocks(4)
    assert [b.block_id for b in got] == [0, 1, 2, 3]
    assert all(b.ref_cnt == 1 for b in got)
    assert pool.num_free_blocks == 2
    assert _queue_ids(pool) == [4, 5]
    pool.check_integrity()
    with pytest.raises(ValueError, match="asked for 3 blocks, 2 free"):
        pool.get_new_blocks(3)
    assert pool.num_free_blocks == 2  # nothing taken on failure


def test_free_in_reverse_puts_chain_tail_first_in_eviction_order() -> None:
    pool = BlockPool(6)
    req_a = pool.get_new_blocks(3)  # 0,1,2
    req_b = pool.get_new_blocks(2)  # 3,4
    pool.free_blocks(reversed(req_a))
    assert _queue_ids(pool) == [5, 2, 1, 0]
    pool.free_blocks(reversed(req_b))
    assert _queue_ids(pool) == [5, 2, 1, 0, 4, 3]
    pool.check_integrity()
    assert [b.block_id for b in pool.get_new_blocks(3)] == [5, 2, 1]
    with pytest.raises(ValueError, match="freed twice"):
        pool.free_blocks([pool.blocks[2], pool.blocks[2], pool.blocks[2]])


def test_prefix_hit_touches_cached_block_out_of_the_middle_of_the_queue() -> None:
    listener = RecordingListener()
    pool = BlockPool(5, listener=listener)
    blocks = pool.get_new_blocks(3)  # 0,1,2
    for i, b in enumerate(blocks):
        assert pool.cache_full_block(b, _h(i), _toks(i))
    pool.free_blocks(reversed(blocks))
    assert _queue_ids(pool) == [3, 4, 2, 1, 0]
    assert listener.events == [("freed", 2, _h(2)), ("freed", 1, _h(1)), ("freed", 0, _h(0))]
    # Hit on block 1 (middle of the queue): it leaves the queue in O(1).
    hit = pool.get_cached_block(_h(1), _toks(1))
    assert hit is blocks[1]
    assert pool.num_free_blocks == 5  # lookup has no side effect
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert _queue_ids(pool) == [3, 4, 2, 0]
    pool.check_integrity()
    # Touch twice (shared by two requests), then free both references.
    pool.touch([hit])
    assert hit.ref_cnt == 2
    pool.free_blocks([hit])
    assert _queue_ids(pool) == [3, 4, 2, 0]
    pool.free_blocks([hit])
    assert _queue_ids(pool) == [3, 4, 2, 0, 1]
    pool.check_integrity()


def test_collision_guard_compares_tokens() -> None:
    pool = BlockPool(2)
    (b,) = pool.get_new_blocks(1)
    pool.cache_full_block(b, _h(7), _toks(7))
    assert pool.get_cached_block(_h(7), _toks(7)) is b
    assert pool.get_cached_block(_h(7), _toks(8)) is None  # same hash, other tokens
    assert pool.get_cached_block(_h(8), _toks(7)) is None


def test_eviction_of_cached_blocks_follows_lru_and_reports_hashes() -> None:
    listener = RecordingListener()
    pool = BlockPool(4, listener=listener)
    first = pool.get_new_blocks(2)  # 0,1
    second = pool.get_new_blocks(2)  # 2,3
    for i, b in enumerate(first + second):
        pool.cache_full_block(b, _h(i), _toks(i))
    pool.free_blocks(reversed(first))  # queue: 1,0
    pool.free_blocks(reversed(second))  # queue: 1,0,3,2
    listener.events.clear()
    got = pool.get_new_blocks(3)
    assert [b.block_id for b in got] == [1, 0, 3]
    assert listener.events == [("evicted", 1, _h(1)), ("evicted", 0, _h(0)), ("evicted", 3, _h(3))]
    assert set(pool.cached_block_map) == {_h(2)}
    assert all(b.block_hash is None and b.token_ids is None for b in got)
    assert pool.num_evictions == 3
    assert pool.get_cached_block(_h(1), _toks(1)) is None
    assert pool.get_cached_block(_h(2), _toks(2)) is pool.blocks[2]
    pool.check_integrity()


def test_hash_reuse_after_eviction_and_duplicate_hash() -> None:
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)  # 0,1
    assert pool.cache_full_block(a, _h(1), _toks(1))
    # A second block with the same content: the first copy stays canonical, b stays uncached.
    assert not pool.cache_full_block(b, _h(1), _toks(1))
    assert b.block_hash is None
    with pytest.raises(ValueError, match="already cached"):
        pool.cache_full_block(a, _h(2), _toks(2))
    with pytest.raises(ValueError, match="only full blocks"):
        pool.cache_full_block(b, _h(2), [1, 2, 3])
    pool.free_blocks([b, a])  # queue: 2, 1, 0
    assert _queue_ids(pool) == [2, 1, 0]
    # Evict everything, then hash 1 lands on a different block.
    taken = pool.get_new_blocks(3)
    assert [t.block_id for t in taken] == [2, 1, 0]
    assert pool.cached_block_map == {}
    assert pool.cache_full_block(taken[0], _h(1), _toks(1))
    assert pool.get_cached_block(_h(1), _toks(1)) is pool.blocks[2]
    pool.check_integrity()


def test_caching_disabled_never_caches() -> None:
    pool = BlockPool(2, enable_caching=False)
    (b,) = pool.get_new_blocks(1)
    assert not pool.cache_full_block(b, _h(1), _toks(1))
    assert pool.cached_block_map == {}


def test_mixed_workload_keeps_integrity() -> None:
    listener = RecordingListener()
    pool = BlockPool(8, listener=listener)
    r1 = pool.get_new_blocks(3)  # 0,1,2
    for i, b in enumerate(r1):
        pool.cache_full_block(b, _h(10 + i), _toks(10 + i))
    r2 = pool.get_new_blocks(2)  # 3,4
    pool.check_integrity()
    pool.free_blocks(reversed(r1))  # queue: 5,6,7,2,1,0
    # Request 3 hits the first two blocks of r1's chain, then allocates 2 new ones.
    hits = [pool.get_cached_block(_h(10 + i), _toks(10 + i)) for i in range(2)]
    assert [b.block_id for b in hits if b] == [0, 1]
    pool.touch([b for b in hits if b])
    r3_new = pool.get_new_blocks(2)
    assert [b.block_id for b in r3_new] == [5, 6]
    assert _queue_ids(pool) == [7, 2]
    pool.check_integrity()
    # Needing 2 more: 7 (uncached), then 2 (cached, evicted).
    listener.events.clear()
    r4 = pool.get_new_blocks(2)
    assert [b.block_id for b in r4] == [7, 2]
    assert listener.events == [("evicted", 2, _h(12))]
    assert pool.num_free_blocks == 0
    pool.free_blocks(reversed(r2))
    pool.free_blocks(reversed([*hits, *r3_new]))  # type: ignore[list-item]
    pool.free_blocks(reversed(r4))
    assert _queue_ids(pool) == [4, 3, 6, 5, 1, 0, 2, 7]
    pool.check_integrity()
    assert pool.reset_prefix_cache()
    assert pool.cached_block_map == {}
    pool.check_integrity()


def test_check_integrity_detects_corruption() -> None:
    pool = BlockPool(3)
    (b,) = pool.get_new_blocks(1)
    b.ref_cnt = 0  # in use but refcount says free
    with pytest.raises(AssertionError, match="ref_cnt 0 but in_queue=False"):
        pool.check_integrity()
    b.ref_cnt = 1
    pool.cache_full_block(b, _h(1), _toks(1))
    pool.cached_block_map[_h(9)] = b  # stale entry
    with pytest.raises(AssertionError, match="stale"):
        pool.check_integrity()
    del pool.cached_block_map[_h(9)]
    pool.check_integrity()
    stray = pool.blocks[1]
    stray.next_free = KVCacheBlock(block_id=99)  # broken forward link
    with pytest.raises(AssertionError, match="link broken"):
        pool.check_integrity()


def test_rejects_empty_pool() -> None:
    with pytest.raises(ValueError, match="num_blocks must be >= 1"):
        BlockPool(0)
