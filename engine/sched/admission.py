"""Admission of the waiting queue's head when it is new (WAITING, or PREEMPTED to re-prefill):
its GPU prefix hit, then one method per connector hook.

``Admission.try_admit`` hashes the request's blocks, matches the prefix cache, checks the pool
can hold the fewest blocks any admission takes (short of those no lookup is made: the head is
remembered as ``_Blocked`` and skipped in O(1) until the pool has them), then asks the connector:

- (a) ``_external_hit``: further leading tokens lower tiers can supply, or "not known yet";
- (b) ``_admit_async_load``: a background load; blocks for the whole prompt now, and the request
  waits for it in WAITING_FOR_KV, or runs its head meanwhile (overlap);
- (c) ``_admit_in_step``: no load, or an in-step load whose tokens count as computed now.

Each answers an ``Admit`` (allocated; the scheduler moves it to running) or a ``Wait``. The
request's phase stamps (``RequestTimes``: hash, lookup, decide, admitted, ready) are taken here, at
the seams between those steps. Torch-free; never touches a device; mutates the request, its
blocks and ``SchedulerStats`` only.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from engine.kv_connector import ExternalHit, SchedulerConnector
from engine.request import Request, RequestStatus
from engine.sched.kv_cache_manager import NO_HIT

if TYPE_CHECKING:
    from engine.sched.kv_cache_manager import KVCacheManager, PrefixHit


class AdmissionCounters(Protocol):
    """The counters admission adds to (``SchedulerStats`` has them)."""

    prefix_cache_queried_tokens_total: int
    prefix_cache_hit_tokens_total: int
    num_blocked_skips: int  # steps in which the blocked head was not looked up again


class Wait(enum.Enum):
    """The head was not admitted. ``STOP``: it does not fit (budget, blocks): admission ends for
    this step. ``SKIP``: it waits aside (its lookup is not known yet, or its load runs off the
    step path) and the requests behind it may go."""

    STOP = "stop"
    SKIP = "skip"


@dataclass(frozen=True, slots=True)
class Admit:
    """The head is admitted with its blocks allocated: it runs from ``num_computed`` and has
    ``num_new`` tokens to compute (the scheduler cuts them to the step's budget). An overlapping
    request (its tail loading) may not compute past ``overlap_barrier``."""

    num_computed: int
    num_new: int
    overlap_barrier: int | None = None


@dataclass(frozen=True, slots=True)
class _Blocked:
    """The head of the waiting queue did not fit: it needs ``num_free_blocks`` free blocks
    before asking the prefix cache and the connector about it is worth a try again."""

    req_id: str
    num_free_blocks: int


class Admission:
    """The admission decisions of one ``Scheduler`` (its KV manager, connector and stats)."""

    def __init__(
        self,
        kv: KVCacheManager,
        connector: SchedulerConnector | None,
        *,
        chunked: bool,
        stats: AdmissionCounters,
    ) -> None:
        self.kv = kv
        self.connector = connector
        self.chunked = chunked
        self.stats = stats
        self._blocked: _Blocked | None = None

    def try_admit(self, request: Request, budget: int) -> Admit | Wait:
        """Admit a new head (not WAITING_FOR_KV) within ``budget`` tokens, or say why not."""
        if self._still_blocked(request):
            return Wait.STOP
        times = request.times
        t0 = time.monotonic()
        if self.kv.enable_caching:  # here, so that hashing is timed apart
            self.kv.update_block_hashes(request)
        t1 = time.monotonic()
        hit = self.kv.get_computed_blocks(request)
        if request.sampling_params.prompt_logprobs is not None:
            hit = NO_HIT  # prompt logprobs need every prompt position's logits: no reuse
        # The fewest blocks any admission of it takes (a load allocates the whole prompt, a
        # computed chunk at least the budget's worth): short of those, no tier lookup can
        # help, and none is made.
        floor = self.kv.num_blocks_needed(
            request, min(request.num_tokens, hit.num_tokens + budget), hit
        )
        if floor > self.kv.pool.num_free_blocks:
            times.lookup_s += time.monotonic() - t1
            self._block(request, floor)
            return Wait.STOP
        external = self._external_hit(request, hit.num_tokens)
        t2 = time.monotonic()
        times.hash_s += t1 - t0
        times.lookup_s += t2 - t1
        if external is None:  # not known yet: it waits, the ones behind it may go
            return Wait.SKIP
        head = external.num_head_tokens if external.load_async else 0
        # Always leave the last token to compute: it yields the logit to sample.
        num_external = min(external.num_tokens, request.num_tokens - 1 - hit.num_tokens - head)
        if external.load_async and num_external > 0:
            outcome = self._admit_async_load(request, budget, hit, num_external, head)
        else:
            outcome = self._admit_in_step(request, budget, hit, num_external)
        now = time.monotonic()
        times.decide_s += now - t2
        if outcome is not Wait.STOP:  # admitted, or its load begun
            times.admitted = now
        if isinstance(outcome, Admit):  # it may compute from now on (an in-step load included)
            times.ready = now
        return outcome

    def _external_hit(self, request: Request, num_computed: int) -> ExternalHit | None:
        """CONNECTOR HOOK (a): further leading tokens available from lower tiers (none
        without a connector); None while the connector does not know yet."""
        if self.connector is None or request.sampling_params.prompt_logprobs is not None:
            return ExternalHit()  # no connector, or a prompt that must be computed whole
        return self.connector.get_num_new_matched_tokens(request, num_computed)

    def _admit_async_load(
        self, request: Request, budget: int, hit: PrefixHit, num_external: int, head: int
    ) -> Admit | Wait:
        """CONNECTOR HOOK (b): a background load of ``num_external`` tokens after a head of
        ``head`` tokens to compute. Blocks for the whole prompt now: once loaded, the request
        must be able to run without more blocks, or requests holding loaded KV could fill the
        pool and wait on each other forever. Without a head the request waits for its load off
        the step path (WAITING_FOR_KV, ``Wait.SKIP``); with one (Cake overlap) it computes the
        head now while the tail loads."""
        assert self.connector is not None  # an async hit comes from a connector
        if head > budget and not self.chunked:
            return Wait.STOP
        if not self.kv.allocate_slots(request, request.num_tokens, hit):
            self._block(request, self.kv.num_blocks_needed(request, request.num_tokens, hit))
            return Wait.STOP
        num_computed = hit.num_tokens
        loaded_now = num_external if head == 0 else 0
        self._count_prefix(request, num_computed, num_computed + loaded_now)
        self.connector.update_state_after_alloc(
            request, self.kv.get_block_ids(request.req_id), num_computed, num_external
        )
        if head == 0:
            request.num_computed_tokens = num_computed + num_external
            request.status = RequestStatus.WAITING_FOR_KV
            return Wait.SKIP
        return Admit(num_computed, head, overlap_barrier=num_computed + head)

    def _admit_in_step(
        self, request: Request, budget: int, hit: PrefixHit, num_external: int
    ) -> Admit | Wait:
        """CONNECTOR HOOK (c): no load, or an in-step one (``load_async`` False): its
        ``num_external`` tokens count as computed now; the worker copies them in before this
        step's forward, so the rest of the prompt is computed in this very step."""
        num_computed = hit.num_tokens + num_external
        num_new = request.num_tokens - num_computed
        if num_new > budget and not self.chunked:
            return Wait.STOP
        total = num_computed + min(num_new, budget)
        if not self.kv.allocate_slots(request, total, hit):
            self._block(request, self.kv.num_blocks_needed(request, total, hit))
            return Wait.STOP
        self._count_prefix(request, hit.num_tokens, num_computed)
        if self.connector is not None:
            self.connector.update_state_after_alloc(
                request, self.kv.get_block_ids(request.req_id), hit.num_tokens, num_external
            )
        return Admit(num_computed, num_new)

    def _block(self, request: Request, num_free_blocks: int) -> None:
        """``request`` (the head) did not fit: remember what it needs (see ``_Blocked``)."""
        self._blocked = _Blocked(request.req_id, num_free_blocks)
        self.stats.num_blocked_skips += 1

    def _still_blocked(self, request: Request) -> bool:
        """True (and counted) while ``request`` is the remembered blocked head and the pool
        still lacks the free blocks it needs: skipping it costs O(1). Once the pool has them
        (blocks were freed past its need), it is considered afresh."""
        blocked = self._blocked
        if blocked is None or blocked.req_id != request.req_id:
            return False
        if self.kv.pool.num_free_blocks < blocked.num_free_blocks:
            self.stats.num_blocked_skips += 1
            return True
        self._blocked = None
        return False

    def _count_prefix(self, request: Request, num_gpu_hit: int, num_cached: int) -> None:
        """Count an admission's prefix-cache query and hit; set the request's cached tokens
        the first time it is admitted (``-1`` until then)."""
        self.stats.prefix_cache_queried_tokens_total += request.num_tokens
        self.stats.prefix_cache_hit_tokens_total += num_gpu_hit
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_cached
