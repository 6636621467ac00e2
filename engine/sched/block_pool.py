"""GPU KV block pool: block metadata, an LRU free queue and the prefix-cache hash map.

Torch-free and device-free: a block here is only an id plus bookkeeping; the model runner owns
the tensor the ids index into. Not thread-safe: the scheduler's thread owns the pool.

Invariants (checked by ``check_integrity``):
- every block is either in the free queue (``ref_cnt == 0``) or in use (``ref_cnt > 0``);
- a block in the free queue may still hold a hash: it is *cached* and can be revived by a
  prefix hit (``touch``) until ``get_new_blocks`` evicts it from the queue head;
- ``cached_block_map[h] is b`` iff ``b.block_hash == h``; a hash is set once per residency.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from cachestore.hashing import BlockHash


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """Metadata of one GPU block. ``token_ids`` is kept with the hash to guard against hash
    collisions on a prefix hit (the hit must also match the block's tokens)."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] | None = None
    # Free-queue links; None when the block is not in the queue.
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with sentinel head and tail nodes.

    Why not a deque: a prefix hit revives a cached block from the *middle* of the queue, which
    must be O(1). The links live in the blocks themselves, so no operation allocates. Order is
    eviction order: ``popleft`` takes the least recently freed block; freed blocks are appended
    at the tail.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(block_id=-1)
        self._tail = KVCacheBlock(block_id=-2)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the tail (evicted last). Raises ValueError if it is already queued."""
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head block. Raises ValueError when empty."""
        first = self._head.next_free
        if first is None or first is self._tail:
            raise ValueError("no free blocks")
        self.remove(first)
        return first

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from anywhere in the queue in O(1). Raises ValueError if not queued."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def __len__(self) -> int:
        return self.num_free_blocks

    def blocks(self) -> list[KVCacheBlock]:
        """Queued blocks, head (next evicted) first. O(n); for tests and integrity checks."""
        out: list[KVCacheBlock] = []
        node = self._head.next_free
        while node is not None and node is not self._tail:
            out.append(node)
            node = node.next_free
        return out

    def check_links(self) -> None:
        """Raise AssertionError if forward and backward links disagree or the count is off."""
        seen = 0
        node = self._head
        while node is not self._tail:
            nxt = node.next_free
            if nxt is None or nxt.prev_free is not node:
                raise AssertionError(f"free queue link broken after block {node.block_id}")
            node = nxt
            seen += 1
            if seen > self.num_free_blocks + 1:
                raise AssertionError("free queue longer than its count (cycle?)")
        if seen - 1 != self.num_free_blocks:
            raise AssertionError(
                f"free queue has {seen - 1} blocks, count says {self.num_free_blocks}"
            )


class BlockPoolListener(Protocol):
    """Hook points for the KV offload connector. Called synchronously on the scheduler thread;
    implementations must be quick and must not call back into the pool."""

    def on_block_freed(self, block_id: int, block_hash: BlockHash) -> None:
        """A full, cached block entered the free queue: its KV is still valid and may be copied
        out ahead of eviction."""

    def on_block_evicted(self, block_id: int, block_hash: BlockHash) -> None:
        """A cached block was evicted for reuse: its hash is dropped and its KV will be
        overwritten after the current step."""


class NullListener:
    """Default listener: does nothing."""

    def on_block_freed(self, block_id: int, block_hash: BlockHash) -> None:
        return None

    def on_block_evicted(self, block_id: int, block_hash: BlockHash) -> None:
        return None


class BlockPool:
    """All ``num_blocks`` blocks, preallocated; ids ``0 .. num_blocks-1``.

    Query/action pairs: ``num_free_blocks`` then ``get_new_blocks``; ``get_cached_block`` (no
    side effect) then ``touch``. Not thread-safe.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_caching: bool = True,
        listener: BlockPoolListener | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.listener: BlockPoolListener = listener or NullListener()
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached_block_map: dict[BlockHash, KVCacheBlock] = {}
        self.num_evictions = 0

    def set_listener(self, listener: BlockPoolListener) -> None:
        """Attach the connector's listener (the connector is built after the pool)."""
        self.listener = listener

    @property
    def num_free_blocks(self) -> int:
        """Blocks available to ``get_new_blocks``, cached-but-free ones included."""
        return len(self.free_queue)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` from the queue head with ``ref_cnt = 1``, evicting any cached hash
        they hold. Raises ValueError (and takes nothing) if not enough blocks are free."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        out: list[KVCacheBlock] = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict_hash(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict_hash(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        block_hash = block.block_hash
        if self.cached_block_map.get(block_hash) is block:
            del self.cached_block_map[block_hash]
        block.block_hash = None
        block.token_ids = None
        self.num_evictions += 1
        self.listener.on_block_evicted(block.block_id, block_hash)

    def get_cached_block(
        self, block_hash: BlockHash, token_ids: Sequence[int]
    ) -> KVCacheBlock | None:
        """The cached block for ``block_hash`` whose tokens equal ``token_ids``, else None.
        No side effect; a hash match with different tokens (a collision) is a miss."""
        block = self.cached_block_map.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block; a free (cached) block leaves the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def cache_full_block(
        self, block: KVCacheBlock, block_hash: BlockHash, token_ids: Sequence[int]
    ) -> bool:
        """Register an in-use, full block under ``block_hash``. Returns False (and leaves the
        block uncached) when caching is off or another block already holds the hash: the first
        copy stays the canonical one. Raises ValueError on a block already hashed or free."""
        if len(token_ids) != self.block_size:
            raise ValueError(f"only full blocks are cached ({len(token_ids)} tokens given)")
        if block.ref_cnt <= 0:
            raise ValueError(f"block {block.block_id} is free; cache it while in use")
        if block.block_hash is not None:
            # NOTE: a block hash is set once per residency; re-hashing means a caller bug.
            raise ValueError(f"block {block.block_id} is already cached")
        if not self.enable_caching or block_hash in self.cached_block_map:
            return False
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self.cached_block_map[block_hash] = block
        return True

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block, in the given order; a block reaching zero goes to
        the queue tail. Callers pass a request's blocks in *reverse* so that a chain's tail is
        evicted before its head. Raises ValueError on a block that is already free."""
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed twice")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)
                if block.block_hash is not None:
                    self.listener.on_block_freed(block.block_id, block.block_hash)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash. Returns False (doing nothing) while any block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            self._evict_hash(block)
        return True

    def usage(self) -> float:
        """Fraction of blocks in use (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def check_integrity(self) -> None:
        """Verify every invariant in the module docstring. Raises AssertionError on violation."""
        self.free_queue.check_links()
        queued = self.free_queue.blocks()
        queued_ids = {b.block_id for b in queued}
        if len(queued_ids) != len(queued):
            raise AssertionError("a block appears twice in the free queue")
        num_in_use = 0
        for block in self.blocks:
            in_queue = block.block_id in queued_ids
            if block.ref_cnt < 0:
                raise AssertionError(f"block {block.block_id} has ref_cnt {block.ref_cnt}")
            if in_queue != (block.ref_cnt == 0):
                raise AssertionError(
                    f"block {block.block_id}: ref_cnt {block.ref_cnt} but in_queue={in_queue}"
                )
            num_in_use += block.ref_cnt > 0
            if block.block_hash is not None:
                if self.cached_block_map.get(block.block_hash) is not block:
                    raise AssertionError(f"block {block.block_id} hash missing from the map")
                if block.token_ids is None or len(block.token_ids) != self.block_size:
                    raise AssertionError(f"cached block {block.block_id} lacks its tokens")
        if num_in_use + len(queued) != self.num_blocks:
            raise AssertionError(
                f"free {len(queued)} + in use {num_in_use} != total {self.num_blocks}"
            )
        for block_hash, block in self.cached_block_map.items():
            if block.block_hash != block_hash or self.blocks[block.block_id] is not block:
                raise AssertionError(f"hash map entry for block {block.block_id} is stale")
