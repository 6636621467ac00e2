"""The connector's scheduler side: lookups, reload-versus-recompute, each step's jobs.

Torch-free and vLLM-free: it reads a request's ``request_id``, ``num_tokens``,
``all_token_ids``, ``lora_request``, ``cache_salt`` and ``mm_features`` (vLLM's ``Request``)
and answers in plain values; ``connectors.vllm.connector`` adapts it.

- ``matched_tokens`` (vLLM's ``get_num_new_matched_tokens``): the request's block keys past
  vLLM's own hit, the leading run present in the lookup view (``connectors.vllm.lookup``),
  then the decision: ``cost`` prices loading each prefix of that run against recomputing it
  (``OnlineCostModel.decide``; vLLM can only load a prefix, so an overlap split is replaced by
  the best prefix option), ``load`` takes the whole run, ``recompute`` none. At most
  ``num_tokens - 1`` tokens (vLLM computes at least one). No side effect but the memo of the
  plan (asked again, it is recomputed) and the tiers' LRU refreshes.
- No load backlog is priced (unlike ``connectors.offload``, whose async loads queue on one
  load thread across steps: ``OnlineCostModel.decide``'s ``backlog``). Here every load is
  synchronous: it is answered ``load_async=False``, and the worker reads a step's jobs in one
  ``read_pinned`` in ``start_load_kv``, before that step's forward, so no load outlives its
  step. The only reads a load decided now waits for are the same step's earlier jobs, and
  the forward waits for them too: recomputing pays the same delay, so adding it to the load
  options alone would only bias the decision towards recompute.
- ``after_alloc`` (``update_state_after_alloc``): the request is tracked; a planned load
  becomes a ``LoadJob`` into the blocks vLLM allocated for it.
- ``build_step`` (``build_connector_meta``): this step's loads, and a ``SaveJob`` for every
  block that becomes full this step and was neither vLLM's own hit nor loaded (each block is
  saved once per request; the worker's store applies the tiers' write policies).
- ``feedback`` (``update_connector_output``): the worker's samples teach the cost model.

Requests with multimodal inputs or prompt embeddings are left alone (their KV is not a
function of the token ids). Not thread-safe: vLLM's scheduler thread drives it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cachestore.cost.model import Option, Strategy
from cachestore.cost.online import OnlineCostModel
from cachestore.hashing import BlockKey, Namespace
from cachestore.store.hierarchical import HierarchicalStore
from connectors.vllm.keys import RequestKeys, extra_keys_of
from connectors.vllm.metadata import LoadJob, SaveJob, StepPlan, WorkerFeedback
from connectors.vllm.stats import Counters

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request of this step, as vLLM's scheduler output gives it."""

    req_id: str
    num_computed_tokens: int  # before this step (vLLM's hit and loads included)
    num_scheduled_tokens: int
    block_ids: Sequence[int]  # the request's vLLM block ids (first KV cache group)


@dataclass(slots=True)
class _Plan:
    num_computed_tokens: int
    keys: tuple[BlockKey, ...]
    tiers: tuple[str, ...]


@dataclass(slots=True)
class _Tracked:
    request: Any
    keys: RequestKeys
    saved_blocks: int = 0  # blocks [0, saved_blocks) are vLLM's hit, loaded or saved
    fresh: bool = True  # admitted (again) since the last step: saved_blocks is not yet known


class VllmScheduler:
    def __init__(
        self,
        lookup_store: HierarchicalStore,
        namespace: Namespace,
        cost_model: OnlineCostModel,
        decision: str,
        counters: Counters,
    ) -> None:
        self.store = lookup_store
        self.namespace = namespace
        self.block_size = namespace.block_size
        self.cost_model = cost_model
        self.decision = decision
        self.counters = counters
        self._plans: dict[str, _Plan] = {}
        self._tracked: dict[str, _Tracked] = {}
        self._loads: list[LoadJob] = []
        self._key_cache: dict[str, RequestKeys] = {}

    # -- lookups -------------------------------------------------------------------------

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens past ``num_computed_tokens`` (block aligned) to load; 0: none."""
        self._plans.pop(request.request_id, None)
        bs = self.block_size
        start, end = num_computed_tokens // bs, (request.num_tokens - 1) // bs
        if end <= start or not _eligible(request):
            return 0
        keys = self._keys(request).first(request.all_token_ids, end)[start:]
        if not keys:
            return 0
        self.counters.add(lookups=1)
        found = self.store.lookup(keys)
        if found.num_blocks == 0:
            return 0
        tiers = tuple(self.store.tiers[i].name for i in found.served_by)
        self.counters.add(hit_tokens=found.num_blocks * bs)
        option = self._decide(start, tiers, request.num_tokens)
        n = option.num_load_blocks
        if n == 0:
            self.counters.add(recompute_decisions=1)
            return 0
        self._plans[request.request_id] = _Plan(num_computed_tokens, tuple(keys[:n]), tiers[:n])
        return n * bs

    def _keys(self, request: Any) -> RequestKeys:
        keys = self._key_cache.get(request.request_id)
        if keys is None:
            lora = getattr(request, "lora_request", None)
            extra = extra_keys_of(
                getattr(lora, "lora_name", None) if lora else None,
                getattr(request, "cache_salt", None),
            )
            keys = self._key_cache[request.request_id] = RequestKeys(self.namespace, extra)
        return keys

    def _decide(self, num_gpu_blocks: int, tiers: tuple[str, ...], num_tokens: int) -> Option:
        if self.decision == "load":
            return Option(Strategy.LOAD_PREFIX, 0, len(tiers), 0.0)
        if self.decision == "recompute":
            return Option(Strategy.RECOMPUTE, 0, 0, 0.0)
        try:
            decision = self.cost_model.decide(num_gpu_blocks, list(tiers), num_tokens)
        except ValueError as exc:  # a tier without a price: the safe choice
            log.warning("kvtier: cost model cannot price %s: %s; recomputing", tiers, exc)
            return Option(Strategy.RECOMPUTE, 0, 0, 0.0)
        prefixes = [o for o in (decision.best, *decision.alternatives) if o.load_begin == 0]
        return min(prefixes, key=lambda o: (o.predicted_s, o.num_load_blocks))

    # -- allocation and steps ------------------------------------------------------------

    def after_alloc(self, request: Any, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """vLLM allocated ``block_ids`` (the whole request's, first group) and will count
        ``num_external_tokens`` as loaded by us."""
        req_id = request.request_id
        tracked = self._tracked.get(req_id)
        if tracked is None:
            tracked = self._tracked[req_id] = _Tracked(request, self._keys(request))
        tracked.fresh = True
        plan = self._plans.pop(req_id, None)
        n = num_external_tokens // self.block_size
        if n <= 0:
            return
        if plan is None or n > len(plan.keys):
            raise RuntimeError(
                f"kvtier: vLLM asked to load {num_external_tokens} tokens of "
                f"{req_id} but the connector planned "
                f"{0 if plan is None else len(plan.keys) * self.block_size}"
            )
        first = plan.num_computed_tokens // self.block_size
        self._loads.append(
            LoadJob(req_id, plan.keys[:n], tuple(block_ids[first : first + n]), plan.tiers[:n])
        )
        self.counters.add(planned_load_tokens=n * self.block_size)

    def build_step(
        self, scheduled: Sequence[ScheduledRequest], finished: Sequence[str] = ()
    ) -> StepPlan:
        """This step's jobs; clears the queued loads. ``finished``: request ids vLLM finished
        (their state is dropped)."""
        bs = self.block_size
        saves: list[SaveJob] = []
        for s in scheduled:
            tracked = self._tracked.get(s.req_id)
            if tracked is None:
                continue
            if tracked.fresh:
                tracked.saved_blocks = s.num_computed_tokens // bs
                tracked.fresh = False
            tokens = tracked.request.all_token_ids
            full = min(s.num_computed_tokens + s.num_scheduled_tokens, len(tokens)) // bs
            full = min(full, len(s.block_ids))
            if full <= tracked.saved_blocks or not _eligible(tracked.request):
                continue
            keys = tracked.keys.first(tokens, full)
            first = tracked.saved_blocks
            saves.append(SaveJob(s.req_id, tuple(keys[first:full]), tuple(s.block_ids[first:full])))
            tracked.saved_blocks = full
        sample = None
        if len(scheduled) == 1 and scheduled[0].num_scheduled_tokens > 1:
            sample = (scheduled[0].num_scheduled_tokens, scheduled[0].num_computed_tokens)
        plan = StepPlan(tuple(self._loads), tuple(saves), sample)
        self._loads = []
        for req_id in finished:
            self.forget(req_id)
        return plan

    def forget(self, req_id: str) -> None:
        """Drop a finished request's state."""
        self._tracked.pop(req_id, None)
        self._plans.pop(req_id, None)
        self._key_cache.pop(req_id, None)

    def feedback(self, fb: WorkerFeedback | None) -> None:
        """Teach the cost model the worker's measured transfers and prefills."""
        if fb is None:
            return
        for tier, nbytes, seconds in fb.transfers:
            self.cost_model.observe_transfer(tier, nbytes, seconds)
        for new, context, seconds in fb.prefills:
            self.cost_model.observe_prefill(new, context, seconds)


def _eligible(request: Any) -> bool:
    """Whether the request's KV is a function of its token ids alone."""
    return (
        not getattr(request, "mm_features", None)
        and getattr(request, "prompt_embeds", None) is None
    )
