"""The scheduler's record of requests whose KV loads from lower tiers (a connector's async loads).

Two kinds, both keyed by request id:
- a WAITING_FOR_KV request waits in the queue while its whole load runs; once the connector
  reports the load ended (``get_finished_loading``) it is *ended* with the number of leading
  tokens that hold valid KV, and kept so until it is admitted (the admit loop may stop before
  reaching it);
- an *overlapping* request (Cake: RUNNING, computing its head while its tail loads) may not
  compute past its head's end (the barrier) until its tail's load ended.

``admit_ended`` admits an ended WAITING_FOR_KV head; ``overlap_slice`` sizes an overlapping
request's chunk. Torch-free; never touches a device; mutates the requests it is handed and
their cached blocks. Not thread-safe (the scheduler's thread).
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

from engine.request import Request
from engine.sched.admission import Admit, Wait

if TYPE_CHECKING:
    from collections.abc import Mapping

    from engine.sched.kv_cache_manager import KVCacheManager


class KVLoads:
    def __init__(self, kv: KVCacheManager, *, chunked: bool) -> None:
        self.kv = kv
        self.chunked = chunked
        # WAITING_FOR_KV requests whose load ended -> leading tokens with valid KV; for an
        # overlapping request, kept until its head is computed.
        self._ended: dict[str, int] = {}
        # Overlapping requests: req_id -> end of the head, the token they may not compute past
        # until the load ends.
        self._barrier: dict[str, int] = {}

    def add_ended(self, ended: Mapping[str, int]) -> None:
        """Loads the connector reports ended: req_id -> leading tokens with valid KV."""
        self._ended.update(ended)

    def has_ended(self, req_id: str) -> bool:
        return req_id in self._ended

    def is_overlapping(self, req_id: str) -> bool:
        return req_id in self._barrier

    def forget(self, req_id: str) -> None:
        """The request finished: drop whatever is known of its load."""
        self._ended.pop(req_id, None)
        self._barrier.pop(req_id, None)

    def stop_overlap(self, req_id: str) -> bool:
        """The request is preempted: forget it; True if it was overlapping (its tail load
        must then be cancelled, or it would write the freed blocks)."""
        if self._barrier.pop(req_id, None) is None:
            return False
        self._ended.pop(req_id, None)
        return True

    def start(self, req_id: str, overlap_barrier: int | None) -> None:
        """The request starts running: an ended load is used up; with a barrier it overlaps."""
        if overlap_barrier is not None:
            self._barrier[req_id] = overlap_barrier
        self._ended.pop(req_id, None)

    def ended_first(self, waiting: deque[Request]) -> deque[Request]:
        """The queue with the requests whose load ended moved to its front: they already hold
        their blocks, so a new request stuck at the head for lack of blocks must not keep them
        (and their blocks) waiting. ``waiting`` itself when none ended."""
        if not self._ended:
            return waiting
        ready = [r for r in waiting if r.req_id in self._ended]
        rest = [r for r in waiting if r.req_id not in self._ended]
        return deque(ready + rest)

    def admit_ended(self, request: Request, budget: int) -> Admit | Wait:
        """A WAITING_FOR_KV head: set aside while its load runs; once it ended, its blocks
        (allocated when the load began) hold the loaded KV, and a short load (missing or
        corrupt block, tier down, timeout) is recomputed from its first missing block."""
        num_valid = self._ended.get(request.req_id)
        if num_valid is None:
            return Wait.SKIP
        if num_valid < request.num_computed_tokens:
            if request.num_preemptions == 0:
                request.num_cached_tokens = min(request.num_cached_tokens, num_valid)
            request.num_computed_tokens = num_valid
        self.kv.cache_blocks(request)
        num_new = request.num_tokens - request.num_computed_tokens
        if num_new > budget and not self.chunked:
            return Wait.STOP
        request.times.ready = time.monotonic()
        return Admit(request.num_computed_tokens, num_new)

    def overlap_slice(self, request: Request, budget: int) -> int:
        """Tokens an overlapping request computes this step: its head up to the barrier while
        its tail loads; once both are done, it skips the tail's valid KV (the worker scattered
        it into the request's own blocks) and goes on. A failed tail load recomputes."""
        barrier = self._barrier[request.req_id]
        if request.num_computed_tokens < barrier:
            return min(barrier - request.num_computed_tokens, budget)
        num_valid = self._ended.pop(request.req_id, None)
        if num_valid is None:
            return 0
        del self._barrier[request.req_id]
        if num_valid > request.num_computed_tokens:
            if request.num_preemptions == 0:
                request.num_cached_tokens += num_valid - request.num_computed_tokens
            request.num_computed_tokens = num_valid
            self.kv.cache_blocks(request)
        return min(request.num_tokens - request.num_computed_tokens, budget)
