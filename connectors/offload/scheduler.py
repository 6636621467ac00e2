"""The offload connector's scheduler side: decides what to save and what to load. Torch-free.

- Saves: as the block pool's listener it collects every full block entering the free queue
  (``on_block_freed``) and lists them all in the next step's metadata, so the worker copies them
  out at that step's start, before any forward pass could overwrite them. A pending block that
  the pool evicts meanwhile (``on_block_evicted``) sets ``saves_reuse_blocks``.
- Loads: for a new request, past the GPU prefix hit, ``store.lookup`` says how many further
  leading blocks the tiers hold and which tier serves each; the decision policy (``cost``: the
  online cost model; ``load``; ``recompute``; ``overlap``: the cost model's cheapest overlap
  split, forced) picks what to load. A ``load_prefix`` loads blocks ``[0, k)`` while the request
  waits; an ``overlap`` with split ``m`` (Cake) loads ``[m, K)`` while the request computes its
  head ``[0, m)`` (``ExternalHit.num_head_tokens``). ``cost`` offers no overlap while the last
  step computed other requests' prompt chunks (``SHARED_STEP_TOKENS``).
- In-step loads (``block_meta`` given, ``in_step``): a ``load_prefix`` whose blocks all sit in
  the host tier is located in the slab now (``store.prepare_load`` with a host check, no claim:
  the codec header checked, the slots pinned) and offered as ``ExternalHit(load_async=False)``:
  the scheduler counts those tokens as computed at admission, and the worker copies the slots
  in before that same step's forward. A slot that fails its header check (or is gone) ends the
  load there: the rest is recomputed, decided before anything was promised. At most
  ``in_step_per_step`` such loads a step: a step's forward waits for all of its in-step copies,
  so a second reload admitted in the same step would hold the first one's first token behind
  its own copy. Past the limit a host hit is an async load instead (counted
  ``in_step_deferred_loads``): the worker issues its copies behind the in-step ones, they run
  under this step's forward, and the request computes in the next step.
- Async loads: ``store.prepare_load`` at allocation claims and pins the blocks in every tier and
  (``block_meta`` given) locates the leading host-tier run, so the worker copies it at once.
- Pins: each load's ``LoadSpec`` holds them; it is completed (``store.complete_load``) by the
  worker after the copies, or here when the plan is dropped (asked again, not used, request
  finished) or its load was never sent.
- Completion comes back from the worker (``update_connector_output``: its ``WorkerReport``
  riding the runner's output) and is handed to the scheduler
  by ``get_finished_loading`` as the number of leading tokens that hold valid KV (async loads
  only: an in-step load was counted at admission).
- Load backlog (``load_backlog``): the worker reads every block below the host tier on ONE load
  thread (``loads.HostLoader``), a load after the one before it, so a load decided now reads
  there only after the loads already started have. The backlog is the blocks per tier below
  the host that async loads handed out (``_start_load``) still hold: derived from the loads in
  flight, it drops a load when the worker reports it finished (failed, short or timed out
  too) and when its request finishes or is aborted (``request_finished``), so it cannot leak.
  ``decision: cost`` prices every option behind it (``OnlineCostModel.decide``'s
  ``backlog``); ``load_backlog_blocks`` is its gauge, ``backlog_decisions`` counts decisions
  priced behind a non-empty one, and the request log's ``kv_plan`` has its seconds
  (``backlog_s``). Host-tier blocks are copied without that thread and do not count.
- Keys: ``cachestore.hashing.block_key`` of each block hash (``BlockKey``).

Not thread-safe: the scheduler thread owns it (``stats`` is the shared, locked part).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from cachestore.codec import BlockMeta
from cachestore.cost.model import Strategy
from cachestore.cost.online import OnlineCostModel
from cachestore.hashing import BlockHash, BlockKey, Namespace, block_key
from cachestore.store.hierarchical import HierarchicalStore
from cachestore.store.loads import HostCheck
from connectors.offload.metadata import BlockLoad, BlockSave, KVConnectorMetadata, WorkerReport
from connectors.offload.plans import Choice, Plan, decide, record_plan
from connectors.offload.prefetch import PENDING, Prefetcher
from connectors.offload.stats import OffloadStats
from engine.core_types import KVConnectorOutput, SchedulerOutput
from engine.kv_connector import ExternalHit
from engine.request import Request

log = logging.getLogger(__name__)
# ``decision: cost`` prices no overlap (Cake) split while the last step computed at least this
# many prompt tokens of other requests in chunks that go on in the next step (unfinished
# prefills; the engine's short-step size, first_token_step_tokens): the split's head would then
# be computed in steps shared with those chunks, not at the rate the model prices alone. A
# prompt that finished in that step does not count: an engine gone idle after it (a lone
# request after another, bench.offload) is not shared. On one H200 (QA client, 2 GiB host tier over LMDB, docs/offload.md)
# every reused request took the split, predicted ~78 ms, and computed its ~2.3K-token head in
# steps carrying 4.6K tokens: 150-290 ms, against ~250 ms for recomputing all of it.
SHARED_STEP_TOKENS = 512


@dataclass(slots=True)
class _Inflight:
    request: Request
    load: BlockLoad
    tiers: tuple[str, ...]
    # Extend the request log's leading hit: first admission, and not an overlap's tail.
    record: bool = True
    tail: bool = False  # an overlap's tail at the first admission (``Request.kv_tail_tiers``)
    # Blocks per tier this load reads on the worker's load thread (below the host tier).
    backlog: tuple[tuple[str, int], ...] = ()


class OffloadScheduler:
    def __init__(
        self,
        store: HierarchicalStore,
        namespace: Namespace,
        *,
        decision: str,
        cost_model: OnlineCostModel,
        stats: OffloadStats,
        block_meta: BlockMeta | None = None,
        in_step: bool = True,
        in_step_per_step: int = 1,
        prefetch_budget_blocks: int = 0,
    ) -> None:
        """``block_meta``: the codec metadata of a block; given, loads find their host-tier
        blocks when prepared, and with ``in_step`` host-tier hits load in-step, at most
        ``in_step_per_step`` of them a step (0: no limit).
        ``prefetch_budget_blocks`` > 0 with tiers below a host slab: prefetch on arrival
        (``connectors.offload.prefetch``), at most that many blocks pinned at once."""
        self.store = store
        self.namespace = namespace
        # Blocks carry their key (codec version 2): the header check names it.
        self._check = HostCheck.for_meta(block_meta) if block_meta is not None else None
        self._in_step = in_step and self._check is not None and store.host_slab() is not None
        self._in_step_per_step = in_step_per_step
        self._in_step_this_step = 0  # in-step loads handed to this step's metadata so far
        # Whether the last step computed other requests' unfinished prefill chunks
        # (``build_connector_meta``): then an overlap split's head would share steps with their
        # next ones (SHARED_STEP_TOKENS).
        self._shared_steps = False
        self.block_size = namespace.block_size
        self.decision = decision
        self.cost_model = cost_model
        self.stats = stats
        self._pending_saves: dict[int, BlockKey] = {}  # block id -> key, freed since the last step
        self._reused = False
        self._plans: dict[str, Plan] = {}
        self._new_loads: list[BlockLoad] = []
        self._inflight: dict[str, _Inflight] = {}
        self._cancelled: set[str] = set()
        self._finished: dict[str, int] = {}
        self.prefetcher: Prefetcher | None = None
        if prefetch_budget_blocks > 0 and len(store.tiers) > 1 and store.host_slab() is not None:
            self.prefetcher = Prefetcher(
                store, stats, budget_blocks=prefetch_budget_blocks, num_to_load=self._num_to_load
            )

    # -- BlockPoolListener ---------------------------------------------------------------

    def _key(self, block_hash: BlockHash) -> BlockKey:
        return block_key(self.namespace, block_hash)

    def on_block_freed(self, block_id: int, block_hash: BlockHash) -> None:
        self._pending_saves[block_id] = self._key(block_hash)

    def on_block_evicted(self, block_id: int, block_hash: BlockHash) -> None:
        if block_id in self._pending_saves:
            self._reused = True  # its new owner may write it in this very step

    # -- SchedulerConnector --------------------------------------------------------------

    def on_request_added(self, request: Request, num_computed_tokens: int) -> None:
        """Starts the request's prefetch (blocks past its GPU hit, below the host tier)."""
        if self.prefetcher is None:
            return
        bs = self.block_size
        start, end = num_computed_tokens // bs, (request.num_tokens - 1) // bs
        if end <= start or len(request.block_hashes) < end:
            return
        keys = [self._key(h) for h in request.block_hashes[start:end]]
        host = self.store.host_slab()
        if host is not None and host.lookup(keys) == len(keys):
            return  # the host tier holds all of it: nothing to bring up, no reason to wait
        self.prefetcher.start(request.req_id, keys, start, request.num_tokens)

    def wait_pending(self, timeout_s: float) -> bool:
        """Block until work started off the step path (a prefetch) ends, at most
        ``timeout_s``. False at once when none runs."""
        return self.prefetcher is not None and self.prefetcher.wait_any(timeout_s)

    def _num_to_load(self, first_block: int, tiers: tuple[str, ...], num_tokens: int) -> int:
        """For the prefetch thread: blocks [0, n) of ``tiers``' run that the policy would load
        (an overlap's tail included). Priced without the load backlog: the prefetch reads on
        a thread of its own, and the admission then loads from the host tier."""
        option = self._decide(first_block, tiers, num_tokens).option
        return option.load_begin + option.num_load_blocks

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> ExternalHit | None:
        """Asks the store (a lookup; tiers refresh LRU) and the policy. Memoizes the plan. An
        in-step plan pins its host slots until it is used or dropped (asked again, finished).
        None ("not yet") while the request's prefetch reads (its lookup is waited for, up to
        ``prefetch.LOOKUP_WAIT_S``)."""
        if self.prefetcher is not None and self.prefetcher.wait_lookup(request.req_id) == PENDING:
            return None
        bs = self.block_size
        start, end = num_computed_tokens // bs, (request.num_tokens - 1) // bs
        self._drop_plan(request.req_id)
        if end <= start or len(request.block_hashes) < end:
            return ExternalHit()
        keys = [self._key(h) for h in request.block_hashes[start:end]]
        found = self.store.lookup(keys)
        self.stats.add(num_lookups=1, lookup_blocks=len(keys))
        if found.num_blocks == 0:
            return ExternalHit()
        tiers = tuple(self.store.tiers[i].name for i in found.served_by)
        choice = self._decide(start, tiers, request.num_tokens, self.load_backlog())
        option = choice.option
        if self._shared_steps and self.decision == "cost":
            self.stats.add(shared_step_decisions=1)
        if choice.backlog_s > 0:
            self.stats.add(backlog_decisions=1)
        head, num_load = option.load_begin, option.num_load_blocks
        offsets: tuple[int, ...] = ()
        unlocated = 0
        spec = None
        host_only = head == 0 and num_load and all(t == "host" for t in tiers[:num_load])
        if host_only and self._in_step and not self._step_has_its_in_step_loads():
            # Located and pinned now, the pins held until the plan is used or dropped.
            spec = self.store.prepare_load(keys[:num_load], self._check, claim=False)
            offsets = spec.host_offsets
            unlocated, num_load = num_load - len(offsets), len(offsets)
        in_step = bool(offsets) or unlocated > 0
        self._plans[request.req_id] = Plan(
            num_computed_tokens,
            tuple(keys[: found.num_blocks]),
            tiers,
            head,
            num_load,
            option.strategy,
            spec,
            unlocated,
            option.predicted_s,
            deferred=bool(host_only and self._in_step and not in_step),
            backlog_s=choice.backlog_s,
            options=choice.options,
        )
        return ExternalHit(
            num_tokens=num_load * bs,
            load_async=num_load > 0 and not in_step,
            num_head_tokens=head * bs,
        )

    def _step_has_its_in_step_loads(self) -> bool:
        limit = self._in_step_per_step
        return limit > 0 and self._in_step_this_step >= limit

    def _drop_plan(self, req_id: str) -> None:
        plan = self._plans.pop(req_id, None)
        if plan is not None and plan.spec is not None:
            self.store.complete_load(plan.spec)

    def _decide(
        self,
        num_gpu_blocks: int,
        tiers: tuple[str, ...],
        num_tokens: int,
        backlog: Mapping[str, int] | None = None,
    ) -> Choice:
        return decide(
            self.decision,
            self.cost_model,
            num_gpu_blocks,
            tiers,
            num_tokens,
            overlap=not self._shared_steps,
            backlog=backlog,
        )

    def load_backlog(self) -> dict[str, int]:
        """Blocks per tier below the host that the async loads in flight read on the
        worker's load thread: what a load decided now queues behind (module docstring)."""
        out: Counter[str] = Counter()
        for inflight in self._inflight.values():
            for tier, n in inflight.backlog:
                out[tier] += n
        return dict(out)

    def _publish_backlog(self) -> None:
        """The gauge ``load_backlog_blocks``: the backlog's blocks now (all tiers)."""
        self.stats.set(load_backlog_blocks=sum(self.load_backlog().values()))

    def update_state_after_alloc(
        self,
        request: Request,
        block_ids: list[int],
        num_gpu_hit_tokens: int,
        num_external_tokens: int,
    ) -> None:
        plan = self._plans.get(request.req_id)
        try:
            self._after_alloc(request, block_ids, num_gpu_hit_tokens, num_external_tokens)
        finally:  # the plan made its own pins (located or prepared): the prefetch's go
            if self.prefetcher is not None:
                head = plan.num_head_blocks if plan is not None else 0
                n = num_external_tokens // self.block_size
                loaded = plan.keys[head : head + n] if plan is not None else ()
                self.prefetcher.release(request.req_id, loaded)

    def _after_alloc(
        self,
        request: Request,
        block_ids: list[int],
        num_gpu_hit_tokens: int,
        num_external_tokens: int,
    ) -> None:
        bs = self.block_size
        self.stats.add(gpu_hit_tokens=num_gpu_hit_tokens)
        plan = self._plans.pop(request.req_id, None)
        # The request log describes the prompt's first admission; a preempted request hitting
        # its own blocks again must not rewrite it.
        record = request.num_preemptions == 0
        if record:  # leading blocks only (an overlap's head is computed; its tail is not)
            request.kv_hit_tiers = ["gpu"] * (num_gpu_hit_tokens // bs)
            request.kv_tail_tiers = []
            request.kv_decision = Strategy.RECOMPUTE
        if plan is None or plan.num_computed_tokens != num_gpu_hit_tokens:
            if plan is not None:  # planned for another GPU hit: unused
                self._plans[request.req_id] = plan
                self._drop_plan(request.req_id)
            return
        num_load = num_external_tokens // bs
        head = plan.num_head_blocks if num_load else 0
        self.stats.count_decision(plan.decision)
        self.stats.add(recomputed_tokens=(len(plan.keys) - num_load) * bs)
        if plan.num_unlocated:  # an in-step load cut short at planning time
            self.stats.add(failed_loads=1)
        offsets = plan.slab_offsets[:num_load]
        if plan.spec is not None and not offsets:  # located, nothing loaded: release it all
            self.store.complete_load(plan.spec)
        elif plan.spec is not None and len(offsets) < len(plan.slab_offsets):
            # Located but not loaded: release those.
            self.store.complete_load(plan.spec, plan.keys[len(offsets) : len(plan.slab_offsets)])
        if record:
            record_plan(request, plan, num_gpu_hit_tokens, head * bs, num_load * bs)
        if num_load:
            self._start_load(
                request,
                plan,
                block_ids,
                num_gpu_hit_tokens // bs + head,
                slice(head, head + num_load),
                offsets,
                record=record and head == 0,
                tail=record and head > 0,
            )

    def _start_load(
        self,
        request: Request,
        plan: Plan,
        block_ids: list[int],
        first: int,
        loaded: slice,
        offsets: tuple[int, ...],
        *,
        record: bool,
        tail: bool = False,
    ) -> None:
        """Hand the worker the load of ``plan.keys[loaded]`` into the request's blocks from
        block ``first`` on (in-step when ``offsets``, its slots located at planning)."""
        bs = self.block_size
        num_load = loaded.stop - loaded.start
        if loaded.start:
            self.stats.add(overlap_head_tokens=loaded.start * bs, num_overlaps=1)
        spec = plan.spec
        if not offsets:
            # Pin now, in the same schedule() as the lookup, so that saves written before the
            # load thread reads cannot evict these blocks meanwhile; the leading host-tier run
            # is located too (the worker copies it without asking). An in-step load's spec is
            # the plan's. The worker completes the spec once its copies ended.
            spec = self.store.prepare_load(list(plan.keys[loaded]), self._check)
        load = BlockLoad(
            request.req_id,
            tuple(block_ids[first : first + num_load]),
            plan.keys[loaded],
            first * bs,
            plan.tiers[loaded],
            offsets,
            spec,
        )
        self._new_loads.append(load)
        if offsets:
            self._in_step_this_step += 1
        elif plan.deferred:
            self.stats.add(in_step_deferred_loads=1)
        tiers = plan.tiers[loaded]
        if self.prefetcher is not None:  # count a prefetched block where its data lived
            origin = self.prefetcher.origins(request.req_id)
            tiers = tuple(origin.get(k, t) for k, t in zip(plan.keys[loaded], tiers, strict=True))
        self._inflight[request.req_id] = _Inflight(
            request, load, tiers, record=record, tail=tail, backlog=_queued_blocks(load)
        )
        self._publish_backlog()

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """The worker's report of the step just run (``Scheduler.update_from_output``)."""
        if isinstance(output.report, WorkerReport):
            self.update_from_worker(output.report)

    def update_from_worker(self, report: WorkerReport) -> None:
        """Take the worker's finished loads (after every step)."""
        bs = self.block_size
        for result in report.finished_loads:
            inflight = self._inflight.pop(result.req_id, None)
            if inflight is None:
                continue  # cancelled: the request is gone
            n = result.num_loaded_blocks
            self.stats.add(
                loaded_tokens=n * bs, recomputed_tokens=(result.num_requested_blocks - n) * bs
            )
            self.stats.count_tier_hits(list(inflight.tiers[:n]))
            request = inflight.request
            if inflight.record:
                request.kv_hit_tiers = [*request.kv_hit_tiers, *inflight.tiers[:n]]
                if n == 0:
                    request.kv_decision = Strategy.RECOMPUTE
            elif inflight.tail:
                request.kv_tail_tiers = list(inflight.tiers[:n])
            if inflight.load.in_step:  # counted as computed at admission: nothing to hand over
                if n < result.num_requested_blocks:  # cannot happen: its slots were pinned
                    log.error(
                        "in-step load of %s came back short (%d/%d blocks)",
                        result.req_id,
                        n,
                        result.num_requested_blocks,
                    )
                continue
            self._finished[result.req_id] = inflight.load.first_token + n * bs
        if report.finished_loads:
            self._publish_backlog()

    def get_finished_loading(self) -> Mapping[str, int]:
        done, self._finished = self._finished, {}
        return done

    def build_connector_meta(self, output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVConnectorMetadata(
            saves=tuple(BlockSave(b, k) for b, k in self._pending_saves.items()),
            loads=tuple(self._new_loads),
            cancelled_loads=frozenset(self._cancelled),
            saves_reuse_blocks=self._reused,
            num_scheduled_requests=len(output.requests),
        )
        prefill = sum(
            len(r.token_ids) for r in output.requests if len(r.token_ids) > 1 and not r.sample
        )
        self._shared_steps = prefill >= SHARED_STEP_TOKENS
        if self.prefetcher is not None:
            self.prefetcher.new_step()
        self._pending_saves = {}
        self._new_loads = []
        self._in_step_this_step = 0
        self._cancelled = set()
        self._reused = False
        return meta

    def take_pending_saves(self) -> tuple[BlockSave, ...]:
        """The saves not yet handed to the worker (for a flush between steps); clears them."""
        saves = tuple(BlockSave(b, k) for b, k in self._pending_saves.items())
        self._pending_saves = {}
        self._reused = False
        return saves

    def request_finished(self, request: Request, block_ids: list[int]) -> None:
        req_id = request.req_id
        self._drop_plan(req_id)
        if self.prefetcher is not None:
            self.prefetcher.release(req_id)
        self._finished.pop(req_id, None)
        inflight = self._inflight.pop(req_id, None)
        if inflight is not None and not inflight.load.in_step:  # in-step: copied in its step
            self.stats.add(cancelled_loads=1)
            unsent = [ld for ld in self._new_loads if ld.req_id != req_id]
            if len(unsent) == len(self._new_loads):
                self._cancelled.add(req_id)  # the worker has it: drop it there
            else:  # never sent: release its pins here
                mine = next(ld for ld in self._new_loads if ld.req_id == req_id)
                if mine.spec is not None:
                    self.store.complete_load(mine.spec)
            self._new_loads = unsent
        if inflight is not None:
            self._publish_backlog()

    @property
    def num_loads_in_flight(self) -> int:
        return len(self._inflight)


def _queued_blocks(load: BlockLoad) -> tuple[tuple[str, int], ...]:
    """Blocks per tier that ``load`` reads on the worker's load thread: every block below the
    host tier of an async load (an in-step load is copied from host slots before its step's
    forward; a host block is copied without the thread)."""
    if load.in_step:
        return ()
    return tuple(Counter(t for t in load.source_tiers if t != "host").items())
