"""Continuous-batching scheduler: one token budget per step, chunked prefill, prefix reuse,
preemption by recompute. Torch-free; never touches a device. Not thread-safe.

Each ``schedule()`` first serves running requests, decodes first (admission order), then
unfinished prefill chunks by remaining work (shortest first), which leave a reserve of the
budget (``PREFILL_RESERVE_FRACTION``) to waiting requests while any wait; then admits waiting
ones in FIFO order while the token budget and ``max_num_seqs`` allow; then gives what is left
back to the prefill chunks the reserve cut. When the pool runs out of blocks the most recently admitted running
request is preempted: its blocks are freed, its outputs kept, and it goes back to the *front*
of the waiting queue to re-prefill prompt + outputs (usually hitting its own cached blocks).

Admission costs O(1) per step for a request that cannot be admitted: before any tier lookup
the pool's room is checked against the fewest blocks the request could possibly take, and a
request that did not fit is remembered with the number of free blocks it needs (``_Blocked``);
until the pool has that many it is not hashed, matched or looked up again.

A step that yields a request's first token from a short prefill (``first_token_step_tokens``)
trims the other, unfinished prefill chunks of that step so that the step stays short: its
first token is not held behind another request's 2K-token chunk (``_shorten_for_first_tokens``).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass

from engine.config import SchedulerConfig
from engine.core_types import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from engine.kv_connector import ExternalHit, SchedulerConnector
from engine.request import Request, RequestStatus
from engine.sched.kv_cache_manager import KVCacheManager

# Share of the token budget that running prefill chunks leave to waiting requests (when there
# are any): 512 of the default 2048, room for a later chat round's new tokens.
PREFILL_RESERVE_FRACTION = 0.25


@dataclass(slots=True)
class SchedulerStats:
    prefix_cache_queried_tokens_total: int = 0
    prefix_cache_hit_tokens_total: int = 0
    num_preemptions_total: int = 0
    num_released_loads_total: int = 0  # loading requests that gave their blocks to running work
    # Steps in which the head of the queue waited for blocks without being looked up again.
    num_blocked_skips: int = 0
    # Unfinished prefill tokens deferred so that a step could yield a first token sooner.
    num_first_token_deferred_tokens: int = 0
    num_schedule_steps: int = 0
    schedule_seconds_total: float = 0.0  # the scheduler's own time (schedule())


@dataclass(frozen=True, slots=True)
class _Blocked:
    """The head of the waiting queue did not fit: it needs ``num_free_blocks`` free blocks
    before asking the prefix cache and the connector about it is worth a try again."""

    req_id: str
    num_free_blocks: int


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_manager: KVCacheManager,
        max_model_len: int,
        *,
        connector: SchedulerConnector | None = None,
        debug: bool = False,
    ) -> None:
        self.config = config
        self.kv = kv_manager
        self.max_model_len = max_model_len
        self.connector = connector
        self.debug = debug
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = SchedulerStats()
        self._finished_ids: set[str] = set()
        # WAITING_FOR_KV requests whose load ended -> leading tokens with valid KV. Kept until
        # the request is admitted (the admit loop may stop before reaching it), or, for an
        # overlapping request, until its head is computed.
        self._loaded: dict[str, int] = {}
        # Overlapping requests (RUNNING, their tail loading): req_id -> end of the head, the
        # token they may not compute past until the load ends.
        self._overlap: dict[str, int] = {}
        self._blocked: _Blocked | None = None

    def add_request(self, request: Request) -> None:
        """Queue a new request. Raises ValueError on a duplicate id or a prompt that cannot fit."""
        if request.req_id in self.requests:
            raise ValueError(f"duplicate request id {request.req_id!r}")
        if request.num_tokens >= self.max_model_len:
            raise ValueError(
                f"prompt has {request.num_tokens} tokens; max_model_len is {self.max_model_len}"
            )
        request.status = RequestStatus.WAITING
        self.requests[request.req_id] = request
        self.waiting.append(request)
        if self.connector is not None:  # it may start work for it off the step path
            t0 = time.monotonic()
            if self.kv.enable_caching:
                self.kv.update_block_hashes(request)
            request.times.hash_s += time.monotonic() - t0
            hit = self.kv.get_computed_blocks(request)
            self.connector.on_request_added(request, hit.num_tokens)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def finish_request(self, req_id: str, status: RequestStatus) -> Request | None:
        """End a request (stop string, abort): frees its blocks. None if it is not known."""
        if not status.is_finished:
            raise ValueError(f"{status} is not a finished status")
        request = self.requests.get(req_id)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._finish(request, status)
        return request

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self._loaded.pop(request.req_id, None)
        self._overlap.pop(request.req_id, None)
        if self.connector is not None:
            self.connector.request_finished(request, self.kv.get_block_ids(request.req_id))
        self.kv.free(request)
        del self.requests[request.req_id]
        self._finished_ids.add(request.req_id)

    def _preempt(self, request: Request) -> None:
        if self._overlap.pop(request.req_id, None) is not None:
            self._loaded.pop(request.req_id, None)
            if self.connector is not None:  # its tail load must not write the freed blocks
                self.connector.request_finished(request, self.kv.get_block_ids(request.req_id))
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.stats.num_preemptions_total += 1
        self.waiting.appendleft(request)
        self._finished_ids.add(request.req_id)  # the runner drops its per-request state

    def _slice(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        return ScheduledRequest(
            req_id=request.req_id,
            token_ids=request.all_token_ids[start : start + num_new],
            num_computed_tokens=start,
            block_table=self.kv.get_block_ids(request.req_id),
            sample=start + num_new == request.num_tokens,
            sampling=request.sampling_params,
            num_output_tokens=request.num_output_tokens,
        )

    def schedule(self) -> SchedulerOutput:
        """Decide one step. Mutates queues and block tables (not ``num_computed_tokens``, which
        ``update_from_output`` advances, but for loads that ended). Hand every output to the
        runner, an empty one too: its ``finished_req_ids`` are reported once."""
        t_start = time.perf_counter()
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted = False
        if self.connector is not None:
            self._loaded.update(self.connector.get_finished_loading())

        # Decodes first (admission order), then prefill chunks by remaining work: a short
        # prefill never waits behind a long one. While requests wait, running prefills leave
        # a reserve of the budget to them, so that a later round's short prefill gets its
        # chunk in the next step instead of after a new user's whole long prompt; what the
        # waiting requests do not use goes back to the capped prefills (``_top_up``).
        reserve = self._prefill_reserve() if self.waiting else 0
        capped: dict[str, int] = {}  # req_id -> index in scheduled, for the top-up
        done: set[str] = set()
        for request in self._running_order():
            if budget <= 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            remaining = request.num_tokens - request.num_computed_tokens
            limit = budget if remaining <= 1 else max(budget - reserve, 0)
            if limit == 0:
                continue
            if request.req_id in self._overlap:
                num_new = self._overlap_slice(request, limit)
                if num_new == 0:  # its head is computed, its tail still loading
                    continue
            else:
                num_new = min(remaining, limit)
            total = request.num_computed_tokens + num_new
            while not self.kv.allocate_slots(request, total):
                preempted = True
                if self._release_a_load():
                    continue  # a loading request gave its blocks back; try again
                victim = self._pick_victim(done)
                self._preempt(victim)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                continue  # it preempted itself; the others may still fit
            if num_new < remaining and request.req_id not in self._overlap:
                capped[request.req_id] = len(scheduled)
            scheduled.append(self._slice(request, num_new))
            done.add(request.req_id)
            budget -= num_new

        if not preempted:  # blocks are short: admitting now would only thrash
            budget = self._admit_waiting(budget, scheduled)
        budget = self._top_up(budget, scheduled, capped)
        budget += self._shorten_for_first_tokens(scheduled)

        if self.debug and not self.requests:
            self.kv.pool.check_integrity()
        output = SchedulerOutput(
            requests=scheduled,
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
            finished_req_ids=frozenset(self._finished_ids),
        )
        self._finished_ids.clear()
        if self.connector is not None:  # empty steps too: loads and saves progress meanwhile
            meta = self.connector.build_connector_meta(output)
            output = dataclasses.replace(output, kv_connector_metadata=meta)
        self.stats.num_schedule_steps += 1
        self.stats.schedule_seconds_total += time.perf_counter() - t_start
        return output

    def _shorten_for_first_tokens(self, scheduled: list[ScheduledRequest]) -> int:
        """If this step yields a first token from a short prefill (at most
        ``first_token_step_tokens`` tokens), cut the step's unfinished prefill chunks so the
        step carries at most that many prefill tokens (the unfinished ones at least a quarter); a
        chunk cut to nothing is dropped from the step (its request stays RUNNING with its
        blocks). Decodes are never cut. Mutates ``scheduled``; returns the tokens given back."""
        cap = self.config.first_token_step_tokens
        if cap <= 0 or not self.config.enable_chunked_prefill:
            return 0
        first = [s for s in scheduled if s.sample and s.num_output_tokens == 0
                 and 1 < len(s.token_ids) <= cap]
        if not first:
            return 0
        others = [i for i, s in enumerate(scheduled) if not s.sample and len(s.token_ids) > 1]
        # Long prompts always advance by at least a quarter of the cap.
        room = max(cap - sum(len(s.token_ids) for s in first), cap // 4)
        deferred = 0
        drop: list[int] = []
        for i in others:
            old = scheduled[i]
            keep = min(len(old.token_ids), room)
            room -= keep
            if keep == len(old.token_ids):
                continue
            deferred += len(old.token_ids) - keep
            if keep == 0:
                drop.append(i)
            else:
                scheduled[i] = dataclasses.replace(old, token_ids=old.token_ids[:keep])
        for i in reversed(drop):
            del scheduled[i]
        self.stats.num_first_token_deferred_tokens += deferred
        return deferred

    def _prefill_reserve(self) -> int:
        """Budget that running prefills leave to waiting requests in a step."""
        return int(self.config.max_num_batched_tokens * PREFILL_RESERVE_FRACTION)

    def _running_order(self) -> list[Request]:
        """Decodes (one token left) in admission order, then prefills by remaining tokens
        (ties in admission order). A new list: ``self.running`` keeps admission order, which
        preemption relies on."""
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens <= 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        prefills.sort(key=lambda r: r.num_tokens - r.num_computed_tokens)
        return decodes + prefills

    def _pick_victim(self, scheduled_ids: set[str]) -> Request:
        """The most recently admitted running request not yet scheduled in this step (the
        one being scheduled is always a candidate). Removes it from ``self.running``."""
        for i in range(len(self.running) - 1, -1, -1):
            if self.running[i].req_id not in scheduled_ids:
                return self.running.pop(i)
        raise AssertionError("no preemption candidate: the request being scheduled is one")

    def _top_up(self, budget: int, scheduled: list[ScheduledRequest],
                capped: dict[str, int]) -> int:
        """Gives the budget left after admission back to prefills capped by the reserve,
        shortest first; a chunk whose blocks cannot be had stays as it was. Returns the
        budget left."""
        for req_id, index in sorted(capped.items(), key=lambda kv: kv[1]):
            if budget <= 0:
                break
            request = self.requests[req_id]
            old = scheduled[index]
            remaining = request.num_tokens - request.num_computed_tokens
            num_new = min(remaining, len(old.token_ids) + budget)
            if not self.kv.allocate_slots(request, request.num_computed_tokens + num_new):
                continue
            budget -= num_new - len(old.token_ids)
            scheduled[index] = self._slice(request, num_new)
        return budget

    def _overlap_slice(self, request: Request, budget: int) -> int:
        """Tokens an overlapping request computes this step: its head up to the barrier while
        its tail loads; once both are done, it skips the tail's valid KV (the worker scattered
        it into the request's own blocks) and goes on. A failed tail load recomputes."""
        barrier = self._overlap[request.req_id]
        if request.num_computed_tokens < barrier:
            return min(barrier - request.num_computed_tokens, budget)
        num_valid = self._loaded.pop(request.req_id, None)
        if num_valid is None:
            return 0
        del self._overlap[request.req_id]
        if num_valid > request.num_computed_tokens:
            if request.num_preemptions == 0:
                request.num_cached_tokens += num_valid - request.num_computed_tokens
            request.num_computed_tokens = num_valid
            self.kv.cache_blocks(request)
        return min(request.num_tokens - request.num_computed_tokens, budget)

    def _release_a_load(self) -> bool:
        """Running work needs blocks: the most recent request still loading (WAITING_FOR_KV,
        load not ended) gives its blocks back, its load cancelled, and waits again as a new
        request. So loads can never hold the pool hostage. False if there is none."""
        for request in reversed(self.waiting):
            if request.status is RequestStatus.WAITING_FOR_KV and request.req_id not in self._loaded:
                if self.connector is not None:
                    self.connector.request_finished(request, self.kv.get_block_ids(request.req_id))
                self.kv.free(request)
                request.num_computed_tokens = 0
                if request.num_preemptions == 0:
                    request.num_cached_tokens = -1  # counted again when it is admitted again
                request.status = RequestStatus.WAITING
                self.stats.num_released_loads_total += 1
                return True
        return False

    def _admit_waiting(self, budget: int, scheduled: list[ScheduledRequest]) -> int:
        if self._loaded:
            # Loaded requests first: they already hold their blocks, so a new request stuck
            # at the head for lack of blocks must not keep them (and their blocks) waiting.
            ready = [r for r in self.waiting if r.req_id in self._loaded]
            rest = [r for r in self.waiting if r.req_id not in self._loaded]
            self.waiting = deque(ready + rest)
        skipped: list[Request] = []
        chunked = self.config.enable_chunked_prefill
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.status is RequestStatus.WAITING_FOR_KV:
                num_valid = self._loaded.get(request.req_id)
                if num_valid is None:
                    skipped.append(self.waiting.popleft())
                    continue
                # Its blocks are allocated and now hold the loaded KV; a short load (missing or
                # corrupt block, tier down, timeout) is recomputed from its first missing block.
                if num_valid < request.num_computed_tokens:
                    if request.num_preemptions == 0:
                        request.num_cached_tokens = min(request.num_cached_tokens, num_valid)
                    request.num_computed_tokens = num_valid
                self.kv.cache_blocks(request)
                num_computed = request.num_computed_tokens
                num_new = request.num_tokens - num_computed
                if num_new > budget and not chunked:
                    break
            else:
                if self._still_blocked(request):
                    break
                times = request.times
                t0 = time.monotonic()
                if self.kv.enable_caching:  # here, so that hashing is timed apart
                    self.kv.update_block_hashes(request)
                t1 = time.monotonic()
                hit = self.kv.get_computed_blocks(request)
                num_computed = hit.num_tokens
                # The fewest blocks any admission of it takes (a load allocates the whole
                # prompt, a computed chunk at least the budget's worth): short of those, no
                # tier lookup can help, and none is made.
                floor = self.kv.num_blocks_needed(
                    request, min(request.num_tokens, num_computed + budget), hit
                )
                if floor > self.kv.pool.num_free_blocks:
                    times.lookup_s += time.monotonic() - t1
                    self._block(request, floor)
                    break
                external = ExternalHit()
                # CONNECTOR HOOK (a): further leading tokens available from lower tiers.
                if self.connector is not None:
                    answer = self.connector.get_num_new_matched_tokens(request, num_computed)
                    if answer is None:  # not known yet: it waits, the ones behind it may go
                        times.hash_s += t1 - t0
                        times.lookup_s += time.monotonic() - t1
                        skipped.append(self.waiting.popleft())
                        continue
                    external = answer
                t2 = time.monotonic()
                times.hash_s += t1 - t0
                times.lookup_s += t2 - t1
                head = external.num_head_tokens if external.load_async else 0
                # Always leave the last token to compute: it yields the logit to sample.
                num_external = min(
                    external.num_tokens, request.num_tokens - 1 - num_computed - head
                )
                if external.load_async and num_external > 0:
                    # CONNECTOR HOOK (b): blocks for the whole prompt now: once loaded, the
                    # request must be able to run without more blocks, or requests holding
                    # loaded KV could fill the pool and wait on each other forever.
                    if head > budget and not chunked:
                        times.decide_s += time.monotonic() - t2
                        break
                    if not self.kv.allocate_slots(request, request.num_tokens, hit):
                        times.decide_s += time.monotonic() - t2
                        self._block(request, self.kv.num_blocks_needed(
                            request, request.num_tokens, hit))
                        break
                    loaded_now = num_external if head == 0 else 0
                    self._count_prefix(request, num_computed, num_computed + loaded_now)
                    self.connector.update_state_after_alloc(  # type: ignore[union-attr]
                        request, self.kv.get_block_ids(request.req_id), num_computed, num_external
                    )
                    if head == 0:  # wait for the load off the step path
                        request.num_computed_tokens = num_computed + num_external
                        request.status = RequestStatus.WAITING_FOR_KV
                        skipped.append(self.waiting.popleft())
                        times.admitted = time.monotonic()
                        times.decide_s += times.admitted - t2
                        continue
                    # Overlap (Cake): compute the head now while the tail loads.
                    self._overlap[request.req_id] = num_computed + head
                    num_new = head
                else:
                    # CONNECTOR HOOK (c): an in-step load (``load_async`` False): those tokens
                    # count as computed now; the worker copies them in before this step's
                    # forward, so the rest of the prompt is computed in this very step.
                    num_computed += num_external
                    num_new = request.num_tokens - num_computed
                    if num_new > budget and not chunked:
                        times.decide_s += time.monotonic() - t2
                        break
                    if not self.kv.allocate_slots(
                        request, num_computed + min(num_new, budget), hit
                    ):
                        times.decide_s += time.monotonic() - t2
                        self._block(request, self.kv.num_blocks_needed(
                            request, num_computed + min(num_new, budget), hit))
                        break
                    self._count_prefix(request, hit.num_tokens, num_computed)
                    if self.connector is not None:
                        self.connector.update_state_after_alloc(
                            request, self.kv.get_block_ids(request.req_id), hit.num_tokens,
                            num_external,
                        )
                times.admitted = time.monotonic()
                times.decide_s += times.admitted - t2
            num_new = min(num_new, budget)  # blocks: allocated above, or when its load began
            request.times.ready = time.monotonic()
            self.waiting.popleft()
            self._loaded.pop(request.req_id, None)
            request.num_computed_tokens = num_computed
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(self._slice(request, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        return budget

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
        self.stats.prefix_cache_queried_tokens_total += request.num_tokens
        self.stats.prefix_cache_hit_tokens_total += num_gpu_hit
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_cached

    def update_from_output(
        self, output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[Request]:
        """Advance progress after the runner executed ``output``: cache newly full blocks,
        append sampled tokens, finish requests on token-level stops. Returns the requests that
        got exactly one new token this step (the last of ``output_token_ids``), finished ones
        included. Raises RuntimeError if the runner skipped a request that had to sample."""
        updated: list[Request] = []
        for sliced in output.requests:
            request = self.requests.get(sliced.req_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted or preempted since it was scheduled
            request.num_computed_tokens += len(sliced.token_ids)
            self.kv.cache_blocks(request)
            if not sliced.sample:
                continue
            try:
                token_id = runner_output.sampled_token_ids[sliced.req_id]
            except KeyError:
                raise RuntimeError(f"runner returned no token for {sliced.req_id!r}") from None
            request.append_output_token(int(token_id))
            stop = request.check_token_stop(self.max_model_len)
            if stop is not None:
                self.running.remove(request)
                self._finish(request, stop)
            updated.append(request)
        return updated

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)
