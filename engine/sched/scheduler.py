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
request that did not fit is remembered with the number of free blocks it needs; until the pool
has that many it is not hashed, matched or looked up again. A new request's admission (its
prefix hit and the connector's hooks) is ``engine/sched/admission.py``'s, the requests whose
KV loads from lower tiers ``engine/sched/kv_loads.py``'s; this module keeps the queue: who is
asked, in which order, and what an admitted request runs.

A step that yields a request's first token from a short prefill (``first_token_step_tokens``)
trims the other, unfinished prefill chunks of that step so that the step stays short: its
first token is not held behind another request's 2K-token chunk
(``engine/sched/first_tokens.py``).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass

from engine.config import SchedulerConfig
from engine.core_types import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from engine.kv_connector import SchedulerConnector
from engine.request import Request, RequestStatus
from engine.sched.admission import Admission, Admit, Wait
from engine.sched.first_tokens import cap_prefill_tokens, shorten_for_first_tokens
from engine.sched.kv_cache_manager import KVCacheManager
from engine.sched.kv_loads import KVLoads

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
    # Prefill tokens deferred so that a step ended soon after a waiting request's KV load.
    num_load_wait_deferred_tokens: int = 0
    num_schedule_steps: int = 0
    schedule_seconds_total: float = 0.0  # the scheduler's own time (schedule())


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
        self.loads = KVLoads(kv_manager, chunked=config.enable_chunked_prefill)
        self.admission = Admission(
            kv_manager, connector, chunked=config.enable_chunked_prefill, stats=self.stats
        )

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
        self.loads.forget(request.req_id)
        if self.connector is not None:
            self.connector.request_finished(request, self.kv.get_block_ids(request.req_id))
        self.kv.free(request)
        del self.requests[request.req_id]
        self._finished_ids.add(request.req_id)

    def _preempt(self, request: Request) -> None:
        if self.loads.stop_overlap(request.req_id) and self.connector is not None:
            # Its tail load must not write the freed blocks.
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
            all_token_ids=request.all_token_ids if request.sampling_params.needs_history else [],
            num_prompt_tokens=request.num_prompt_tokens,
            awaits_text=request.awaits_text,
            min_tokens_stop_ids=request.min_tokens_stop_ids(),
        )

    def schedule(self) -> SchedulerOutput:
        """Decide one step. Mutates queues and block tables (not ``num_computed_tokens``, which
        ``update_from_output`` advances, but for loads that ended). Hand every output to the
        runner, an empty one too: its ``finished_req_ids`` are reported once."""
        t_start = time.perf_counter()
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        if self.connector is not None:
            self.loads.add_ended(self.connector.get_finished_loading())

        budget, preempted, capped = self._schedule_running(budget, scheduled)
        if not preempted:  # blocks are short: admitting now would only thrash
            budget = self._admit_waiting(budget, scheduled)
        budget = self._top_up(budget, scheduled, capped)
        budget += self._shorten_for_first_tokens(scheduled)
        budget += self._shorten_for_loads(scheduled)

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

    def _schedule_running(
        self, budget: int, scheduled: list[ScheduledRequest]
    ) -> tuple[int, bool, dict[str, int]]:
        """Schedule running requests within ``budget`` (appending to ``scheduled``), preempting
        when blocks run out. Returns the budget left, whether blocks ran short (a preemption or
        a released load), and the prefill chunks the reserve capped (req_id -> index in
        ``scheduled``)."""
        # Decodes first (admission order), then prefill chunks by remaining work: a short
        # prefill never waits behind a long one. While requests wait, running prefills leave
        # a reserve of the budget to them, so that a later round's short prefill gets its
        # chunk in the next step instead of after a new user's whole long prompt; what the
        # waiting requests do not use goes back to the capped prefills (``_top_up``).
        preempted = False
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
            if self.loads.is_overlapping(request.req_id):
                num_new = self.loads.overlap_slice(request, limit)
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
            if num_new < remaining and not self.loads.is_overlapping(request.req_id):
                capped[request.req_id] = len(scheduled)
            scheduled.append(self._slice(request, num_new))
            done.add(request.req_id)
            budget -= num_new
        return budget, preempted, capped

    def _shorten_for_first_tokens(self, scheduled: list[ScheduledRequest]) -> int:
        """``shorten_for_first_tokens`` with chunked prefill on; counted. Mutates
        ``scheduled``; returns the tokens given back."""
        if not self.config.enable_chunked_prefill:
            return 0
        deferred = shorten_for_first_tokens(
            scheduled, self.config.first_token_step_tokens, self.config.first_token_step_others
        )
        self.stats.num_first_token_deferred_tokens += deferred
        return deferred

    def _shorten_for_loads(self, scheduled: list[ScheduledRequest]) -> int:
        """While a request waits for its asynchronous KV load, the step's prefill chunks carry
        at most ``load_wait_step_tokens`` tokens (``cap_prefill_tokens``): the load's end is
        seen at the next step boundary, so a long step started while it reads holds the
        request back by what is left of that step. Counted. Mutates ``scheduled``; returns
        the tokens given back."""
        cap = self.config.load_wait_step_tokens
        if cap <= 0 or not self.config.enable_chunked_prefill:
            return 0
        if not any(
            r.status is RequestStatus.WAITING_FOR_KV and not self.loads.has_ended(r.req_id)
            for r in self.waiting
        ):
            return 0
        deferred = cap_prefill_tokens(scheduled, cap)
        self.stats.num_load_wait_deferred_tokens += deferred
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

    def _top_up(
        self, budget: int, scheduled: list[ScheduledRequest], capped: dict[str, int]
    ) -> int:
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

    def _release_a_load(self) -> bool:
        """Running work needs blocks: the most recent request still loading (WAITING_FOR_KV,
        load not ended) gives its blocks back, its load cancelled, and waits again as a new
        request. So loads can never hold the pool hostage. False if there is none."""
        for request in reversed(self.waiting):
            if request.status is RequestStatus.WAITING_FOR_KV and not self.loads.has_ended(
                request.req_id
            ):
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
        """Admit waiting requests in queue order (loaded ones first) while the budget and
        ``max_num_seqs`` allow, appending their slices to ``scheduled``; a request set aside
        (``Wait.SKIP``) keeps its place at the front; the first that does not fit
        (``Wait.STOP``) ends admission. Returns the budget left."""
        self.waiting = self.loads.ended_first(self.waiting)
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.status is RequestStatus.WAITING_FOR_KV:
                outcome = self.loads.admit_ended(request, budget)
            else:
                outcome = self.admission.try_admit(request, budget)
            if outcome is Wait.STOP:
                break
            if outcome is Wait.SKIP:
                skipped.append(self.waiting.popleft())
                continue
            assert isinstance(outcome, Admit)
            budget -= self._start_running(request, outcome, budget, scheduled)
        self.waiting.extendleft(reversed(skipped))
        return budget

    def _start_running(
        self, request: Request, admit: Admit, budget: int, scheduled: list[ScheduledRequest]
    ) -> int:
        """Move the admitted head (its ``times.ready`` stamped) to running and schedule its
        first slice (its blocks were allocated at admission, or when its load began). Returns
        the tokens scheduled."""
        num_new = min(admit.num_new, budget)
        # Cake (a barrier): compute the head while the tail loads.
        self.loads.start(request.req_id, admit.overlap_barrier)
        self.waiting.popleft()
        request.num_computed_tokens = admit.num_computed
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        scheduled.append(self._slice(request, num_new))
        return num_new

    def update_from_output(
        self, output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[Request]:
        """Advance progress after the runner executed ``output``: hand the connector's report
        over (``_update_from_kv``), cache newly full blocks, append sampled tokens, finish
        requests on token-level stops. Returns the requests that got exactly one new token this
        step, finished ones included. RuntimeError: a request that had to sample got no token."""
        self._update_from_kv(runner_output)
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

    def _update_from_kv(self, runner_output: ModelRunnerOutput) -> None:
        """The connector's report (``kv_connector_output``) to its scheduler side, and each
        finished load's measured copy time to its request (the TTFT breakdown's ``load``)."""
        kv_output = runner_output.kv_connector_output
        if kv_output is None:
            return
        if self.connector is not None:
            self.connector.update_connector_output(kv_output)
        for timing in kv_output.load_timings:
            request = self.requests.get(timing.req_id)
            if request is not None:
                request.times.on_load(timing)

    def wait_pending(self, timeout_s: float) -> bool:
        """A step scheduled nothing: wait up to ``timeout_s`` for the connector's off-step work
        (a prefetch) to end, so that an engine whose only waiting requests are "not yet" does
        not spin. False at once without a connector or when none runs."""
        return self.connector is not None and self.connector.wait_pending(timeout_s)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)
