"""Per-request block tables on top of the block pool: prefix-hit lookup, allocation, caching.

Torch-free and device-free. Not thread-safe: the scheduler's thread owns it.

NOTE: block tables are append-only while a request holds them; a request's blocks are freed all
at once (finish or preemption), in reverse order so a chain's tail is evicted before its head.
A block is registered in the prefix cache only after its KV was computed (``cache_blocks``
after the step), so a hit never depends on the runner's order of writes within one step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cachestore.hashing import Namespace, hash_request_tokens
from engine.request import Request
from engine.sched.block_pool import BlockPool, KVCacheBlock


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """Leading full blocks of a request already on the GPU, and the tokens they cover."""

    blocks: tuple[KVCacheBlock, ...]
    num_tokens: int


NO_HIT = PrefixHit(blocks=(), num_tokens=0)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, pool: BlockPool, namespace: Namespace, enable_caching: bool = True) -> None:
        if namespace.block_size != pool.block_size:
            raise ValueError(
                f"namespace block size {namespace.block_size} != pool {pool.block_size}"
            )
        self.pool = pool
        self.namespace = namespace
        self.block_size = pool.block_size
        self.enable_caching = enable_caching
        self._tables: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each table were already offered to the prefix cache.
        self._num_cached_blocks: dict[str, int] = {}

    def update_block_hashes(self, request: Request) -> None:
        """Extend ``request.block_hashes`` to every full block of its tokens. Mutates request."""
        bs = self.block_size
        done = len(request.block_hashes)
        num_full = request.num_tokens // bs
        if num_full <= done:
            return
        parent = request.block_hashes[-1] if done else None
        request.block_hashes.extend(
            hash_request_tokens(
                self.namespace, request.all_token_ids[done * bs : num_full * bs], parent=parent
            )
        )

    def get_computed_blocks(self, request: Request) -> PrefixHit:
        """The longest run of leading full blocks cached in the pool, capped so that at least
        the last token is still computed (there must be a logit to sample). Updates the
        request's block hashes but takes no references: pass the result to ``allocate_slots``
        before anything else touches the pool."""
        if not self.enable_caching:
            return NO_HIT
        self.update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        bs = self.block_size
        hits: list[KVCacheBlock] = []
        for i, block_hash in enumerate(request.block_hashes[:max_blocks]):
            block = self.pool.get_cached_block(
                block_hash, request.all_token_ids[i * bs : (i + 1) * bs]
            )
            if block is None:
                break
            hits.append(block)
        return PrefixHit(blocks=tuple(hits), num_tokens=len(hits) * bs)

    def num_blocks_needed(
        self, request: Request, num_total_tokens: int, hit: PrefixHit = NO_HIT
    ) -> int:
        """Free-queue blocks that ``allocate_slots`` would consume: new blocks plus prefix-hit
        blocks revived from the free queue. No side effect."""
        table = self._tables.get(request.req_id, [])
        num_new = max(cdiv(num_total_tokens, self.block_size) - len(table) - len(hit.blocks), 0)
        return num_new + sum(1 for b in hit.blocks if b.ref_cnt == 0)

    def allocate_slots(
        self, request: Request, num_total_tokens: int, hit: PrefixHit = NO_HIT
    ) -> bool:
        """Make the request's block table cover ``num_total_tokens`` positions, first taking
        references on ``hit`` blocks (only on a request's first allocation). Returns False and
        changes nothing if the pool lacks blocks."""
        table = self._tables.get(request.req_id)
        if hit.blocks and table:
            raise ValueError(f"request {request.req_id}: prefix hit on a non-empty block table")
        if self.num_blocks_needed(request, num_total_tokens, hit) > self.pool.num_free_blocks:
            return False
        if table is None:
            table = self._tables[request.req_id] = []
            self._num_cached_blocks[request.req_id] = len(hit.blocks)
        self.pool.touch(hit.blocks)
        table.extend(hit.blocks)
        num_new = cdiv(num_total_tokens, self.block_size) - len(table)
        if num_new > 0:
            table.extend(self.pool.get_new_blocks(num_new))
        return True

    def cache_blocks(self, request: Request) -> None:
        """Offer every full block under ``request.num_computed_tokens`` to the prefix cache.
        Call after the step that computed them. Mutates the pool's hash map."""
        if not self.enable_caching:
            return
        table = self._tables.get(request.req_id)
        if table is None:
            return
        bs = self.block_size
        start = self._num_cached_blocks[request.req_id]
        end = min(request.num_computed_tokens // bs, len(table))
        if end <= start:
            return
        self.update_block_hashes(request)
        for i in range(start, end):
            block = table[i]
            if block.block_hash is None:
                self.pool.cache_full_block(
                    block, request.block_hashes[i], request.all_token_ids[i * bs : (i + 1) * bs]
                )
        self._num_cached_blocks[request.req_id] = end

    def free(self, request: Request) -> None:
        """Release the request's blocks (reverse order); a no-op if it holds none."""
        table = self._tables.pop(request.req_id, None)
        self._num_cached_blocks.pop(request.req_id, None)
        if table:
            self.pool.free_blocks(reversed(table))

    def get_block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self._tables.get(req_id, ())]

    def get_blocks(self, req_id: str) -> Sequence[KVCacheBlock]:
        """The request's block table (read-only view for the connector)."""
        return tuple(self._tables.get(req_id, ()))

    @property
    def num_requests(self) -> int:
        return len(self._tables)
