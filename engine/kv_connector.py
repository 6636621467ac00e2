"""The one socket the engine calls a KV connector through (the shape of vLLM's KV connector API).

The engine never imports a connector: ``create_kv_connector(name, ...)`` resolves ``name``
through the registry below (name -> module and class, the module imported only when chosen,
like ``engine.attention``), and everything else it knows of a connector is here:

- The **scheduler side** (``SchedulerConnector``) decides, on the scheduler thread, torch-free:
  how many further leading tokens the lower tiers can supply for a new request and from where
  (``get_num_new_matched_tokens``, side-effect free, answering an ``ExternalHit``), what to load
  once blocks are allocated (``update_state_after_alloc``), which requests finished loading
  (``get_finished_loading``), what a finished request means for its blocks
  (``request_finished``), and the one per-step metadata object (``build_connector_meta``).
- The **worker side** (``KVConnectorWorker``) moves bytes, on the engine thread, around the
  forward pass (``ModelRunner.set_kv_connector``).
- ``KVConnector`` is the whole connector as ``LLMEngine`` holds it: both sides, and the calls
  between steps. ``CalibrationTarget`` is what the engine offers it for start-up calibration.

What crosses between the sides rides the step's own values, as in vLLM: the scheduler side's
metadata in ``SchedulerOutput.kv_connector_metadata`` (opaque here), the worker side's report
back in ``ModelRunnerOutput.kv_connector_output`` (``KVConnectorOutput``: opaque report, typed
load timings), which ``Scheduler.update_from_output`` hands to ``update_connector_output``.
The engine never calls a connector by its kind. Protocols and frozen values only; torch-free.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from engine.core_types import KVConnectorOutput, ModelRunnerOutput, SchedulerOutput
from engine.request import Request

if TYPE_CHECKING:
    from cachestore.cost.online import OnlineCostModel
    from cachestore.hashing import BlockHash, Namespace
    from cachestore.store.hierarchical import HierarchicalStore
    from engine.kv_cache import KVCache


@dataclass(frozen=True, slots=True)
class ExternalHit:
    """Tokens past the GPU prefix hit (``c``) to load from lower tiers: ``[c + num_head_tokens,
    + num_tokens)``. ``load_async``: the load runs in the background instead of within the step.
    Without a head the request waits in WAITING_FOR_KV while it loads. With one (Cake overlap,
    async only) it runs at once, computing the head ``[c, c + num_head_tokens)`` meanwhile, and
    waits only if the head is done first; the tail's KV counts once the load ended.
    ``load_async=False`` with ``num_tokens``: an in-step load; the tokens count as computed at
    admission and the request's remaining tokens are computed in that same step."""

    num_tokens: int = 0
    load_async: bool = False
    num_head_tokens: int = 0


class SchedulerConnector(Protocol):
    """The scheduler side. Every method runs on the scheduler thread; none touches a device."""

    def on_request_added(self, request: Request, num_computed_tokens: int) -> None:
        """A request reached the scheduler (its block hashes set, ``num_computed_tokens`` its
        GPU hit now). The connector may start work for it off the step path (a lookup, a
        prefetch into a faster tier) and answer "not yet" until that ends."""
        ...

    def wait_pending(self, timeout_s: float) -> bool:
        """A step scheduled nothing: block until some of the connector's off-step work ends (a
        request it answered "not yet" may go), at most ``timeout_s``. False at once when none
        runs. Keeps an engine whose only waiting requests are "not yet" from spinning."""
        ...

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> ExternalHit | None:
        """How many tokens past ``num_computed_tokens`` (the GPU hit) lower tiers can supply and
        should be loaded; None: not known yet (work for it runs off the step path), ask again
        in a later step. Side-effect free (it may memoize its answer); may be asked again."""
        ...

    def update_state_after_alloc(
        self,
        request: Request,
        block_ids: list[int],
        num_gpu_hit_tokens: int,
        num_external_tokens: int,
    ) -> None:
        """Blocks are allocated (for the whole prompt when loading): the ``num_external_tokens``
        tokens after ``num_gpu_hit_tokens`` plus the hit's head (``ExternalHit``) are to be loaded
        into ``block_ids`` (0 external tokens: nothing to load, stats only)."""
        ...

    def get_finished_loading(self) -> Mapping[str, int]:
        """Requests whose loads ended since the last call (WAITING_FOR_KV, or overlapping),
        each mapped to the number of leading tokens whose KV is then valid, counting an
        overlapping request's head as computed (less than asked on a partial load: the
        scheduler recomputes from there). Each id is reported once."""
        ...

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """The worker side's report of the step just run (``ModelRunnerOutput``'s
        ``kv_connector_output``, empty steps included), before that step's requests advance:
        its finished loads become ``get_finished_loading``'s answer at the next step."""
        ...

    def build_connector_meta(self, output: SchedulerOutput) -> object:
        """The per-step metadata handed to the worker side via ``kv_connector_metadata``.
        Called for every step, empty ones included."""
        ...

    def request_finished(self, request: Request, block_ids: list[int]) -> None:
        """A request finished or was aborted, or gives its blocks up while its load is in
        flight (preempted while overlapping, released for running work): its blocks are freed
        right after this call, so any load of it must be cancelled."""
        ...


class ConnectorScheduler(SchedulerConnector, Protocol):
    """The scheduler side as ``LLMEngine`` wires it: the scheduler's connector and the block
    pool's listener (``engine.sched.block_pool.BlockPoolListener``'s two hooks, spelled here:
    this module sits below ``sched/``)."""

    def on_block_freed(self, block_id: int, block_hash: BlockHash) -> None: ...

    def on_block_evicted(self, block_id: int, block_hash: BlockHash) -> None: ...


class ConnectorCounters(Protocol):
    """The connector's counters as the engine's metrics read them."""

    def snapshot(self) -> dict[str, Any]:
        """A consistent copy as plain values: ``gpu_hit_tokens``, ``loaded_tokens``,
        ``recomputed_tokens``, ``saved_bytes``, ``loaded_bytes``, ``failed_loads``,
        ``load_seconds`` at least."""
        ...


class KVConnectorWorker(Protocol):
    """The worker side as the runner calls it (``ModelRunner.set_kv_connector``).

    Called from the engine thread only, once per step, in this order: ``start_load_kv``
    before the forward pass (its inputs are uploaded by then), ``forward_queued`` once the
    step's GPU work is queued (before its one host sync; a step with nothing scheduled has
    none), ``wait_for_save`` and ``after_step`` after it."""

    def start_load_kv(self, metadata: object | None) -> None:
        """Before the forward pass: copy out this step's saves, copy this step's in-step loads
        (the forward reads them), then scatter completed async loads."""
        ...

    def forward_queued(self) -> None:
        """The step's forward and sampling are queued: copies that nothing in this step reads
        may be issued now, beside its compute instead of ahead of its uploads."""
        ...

    def wait_for_save(self) -> None:
        """After the forward pass: make this step's saves durable in the top tier."""
        ...

    def after_step(self, metadata: object | None) -> KVConnectorOutput | None:
        """End of step: this step's report (its finished loads), which the runner attaches to
        ``ModelRunnerOutput.kv_connector_output``; None: nothing to report."""
        ...


class RankedKVConnectorWorker(KVConnectorWorker, Protocol):
    """Rank 0's worker side under tensor parallelism (``engine.runner.tp_worker.TPDriver``)."""

    def join_ranks(self, outputs: Sequence[KVConnectorOutput | None]) -> KVConnectorOutput | None:
        """Every rank's report of one step (rank order, rank 0's first; None: none) joined
        into the one report the scheduler side takes."""
        ...


class KVConnector(Protocol):
    """A connector as ``LLMEngine`` holds it. ``scheduler`` also listens to the block pool
    (``BlockPool.set_listener``); ``cost_model`` prices loads against recomputes;
    ``counters.snapshot()`` is the counters' dict; ``store`` is the ``HierarchicalStore`` (its
    ``drain_report`` says what ``close`` flushed). The calls between steps run on the engine
    thread."""

    scheduler: ConnectorScheduler
    worker: KVConnectorWorker
    cost_model: OnlineCostModel
    counters: ConnectorCounters
    store: HierarchicalStore

    def observe_step(self, output: SchedulerOutput, seconds: float) -> None:
        """Step ``output`` ran in ``seconds`` (the runner's wall time): a sample the connector
        may learn from (a prefill alone in its step, for its cost model)."""
        ...

    def observe_first_token(self, request: Request, phases: Mapping[str, float]) -> None:
        """``request`` got its first token; ``phases`` is its TTFT breakdown
        (``engine.ttft``): what its plan took, for the connector's cost model."""
        ...

    def save_pending(self) -> None:
        """Save every block freed since the last step now (the engine goes idle)."""
        ...

    def flush(self) -> None:
        """Save every freed block and wait for the copies down."""
        ...

    def stats(self) -> dict[str, Any]:
        """Counters and per-tier stats; no side effect."""
        ...

    def close(self) -> None:
        """Flush, stop, release every resource. Idempotent."""
        ...


@dataclass(frozen=True, slots=True)
class CalibrationTarget:
    """What start-up calibration needs from the engine to time prefills: the runner's
    ``execute_model``, and the limits a throwaway prefill must respect."""

    execute: Callable[[SchedulerOutput], ModelRunnerOutput]
    max_model_len: int
    token_budget: int
    vocab_size: int


# name -> (module, class); the class has ``create(config, kv_cache, namespace, *, calibration)``.
_CONNECTORS: dict[str, tuple[str, str]] = {
    "offload": ("connectors.offload.connector", "OffloadConnector"),
}


def register_kv_connector(name: str, module: str, class_name: str) -> None:
    """Add or replace the connector ``name`` (out-of-tree connectors, tests)."""
    _CONNECTORS[name] = (module, class_name)


def kv_connector_names() -> list[str]:
    return sorted(_CONNECTORS)


def kv_connector_class(name: str) -> Any:
    """The class registered as ``name``, its module imported now. Raises ValueError for an
    unknown name (ImportError if its module cannot be imported)."""
    if name not in _CONNECTORS:
        raise ValueError(f"unknown KV connector {name!r}; choose from {kv_connector_names()}")
    module_name, class_name = _CONNECTORS[name]
    return getattr(importlib.import_module(module_name), class_name)


def check_kv_connector_config(name: str, config: object) -> None:
    """Check connector ``name``'s config before anything is built (``kvtier serve`` does,
    before loading the model), through its class's optional ``check_config(config)``.
    Raises what that raises (for ``offload``: ConfigError, a ValueError naming the file and
    the field)."""
    check = getattr(kv_connector_class(name), "check_config", None)
    if check is not None:
        check(config)


def create_kv_connector(
    name: str,
    config: object,
    kv_cache: KVCache,
    namespace: Namespace,
    *,
    calibration: CalibrationTarget | None = None,
    tp: object | None = None,
) -> KVConnector:
    """Build connector ``name`` with its class's ``create(config, kv_cache, namespace,
    calibration=...)``; ``config`` is the connector's own (for ``offload``: a YAML path, a
    mapping, an ``OffloadConfig`` or None for the defaults). Raises ValueError for an unknown
    name; the connector's own errors (a bad config, a tier that cannot be built) propagate.
    ``tp``: the engine's tensor-parallel driver (``engine.runner.tp_worker.TPDriver``), for a
    connector that runs a share on every rank (``create(..., tp=tp)``; the ranks build theirs
    with the class's ``create_rank(spec, kv_cache, rank, size)``)."""
    cls = kv_connector_class(name)
    if tp is not None:
        return cls.create(config, kv_cache, namespace, calibration=calibration, tp=tp)  # type: ignore[no-any-return]
    return cls.create(config, kv_cache, namespace, calibration=calibration)  # type: ignore[no-any-return]
