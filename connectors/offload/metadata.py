"""What the offload connector's scheduler side tells its worker side, and the answer back.

The engine's side of the contract (``SchedulerConnector``, ``KVConnectorWorker``, ``ExternalHit``)
is ``engine.kv_connector``; these are the offload connector's own values:
- ``KVConnectorMetadata`` (frozen) is the only thing that crosses from the scheduler side to the
  worker side, through ``SchedulerOutput.kv_connector_metadata``: the step's ``saves``
  (``BlockSave``), ``loads`` (``BlockLoad``) and cancelled loads. The worker's answer crosses
  back as one ``WorkerReport`` per step (its ``LoadResult``s), riding the runner's output
  (``KVConnectorOutput.report``) to ``OffloadScheduler.update_connector_output``.

Ownership (why a free never races a copy):
- A block listed in ``saves`` is copied out at the START of the step whose metadata lists it,
  before that step's forward pass (CPU: synchronously; CUDA: on a side stream, and the compute
  stream waits on that copy's event when ``saves_reuse_blocks``, i.e. when one of those blocks
  was handed to a new owner in the same schedule). The block pool may therefore evict and reuse
  a freed block at once: eviction is a drop, never a stall.
- The blocks of a load belong to their request, which holds references on them (it sits in
  WAITING_FOR_KV). The worker writes them only at a step start, and only for a load that is not
  in that step's ``cancelled_loads``. A request aborted while loading is cancelled in the same
  metadata in which its blocks can first be reused, so the scheduler frees them at once.
- An in-step load (``BlockLoad.slab_offsets`` set; ``ExternalHit(load_async=False)``) is
  copied by the worker in ``start_load_kv`` of the very step that admits its request, before
  that step's forward (CPU: synchronously; CUDA: on the side stream, the compute stream waiting
  on the copies' event). The scheduler side validated and pinned its host slots while planning
  it, so the copy cannot come back short: the scheduler counts those tokens as computed at once.
- Pins: every load's pins are held by its ``BlockLoad.spec`` (the store's ``LoadSpec``) from the
  scheduler side's ``prepare_load`` until one ``complete_load(spec)``: by the worker once the
  copies ended, or by the scheduler side for a load it never sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cachestore.hashing import BlockKey
from cachestore.store.loads import LoadSpec
from engine.core_types import KVConnectorOutput
from engine.ttft import LoadTiming


@dataclass(frozen=True, slots=True)
class BlockSave:
    """Copy GPU block ``block_id`` out to the tiers under ``key`` (``block_key`` of its hash)."""

    block_id: int
    key: BlockKey


@dataclass(frozen=True, slots=True)
class BlockLoad:
    """Load ``keys`` (in order) into the request's GPU blocks ``block_ids``; the first block
    starts at token ``first_token`` (the GPU prefix hit, a multiple of the block size)."""

    req_id: str
    block_ids: tuple[int, ...]
    keys: tuple[BlockKey, ...]
    first_token: int
    source_tiers: tuple[str, ...] = ()  # the tier expected to serve each block (for pricing)
    # In-step load: the host slab offset of each block's encoded slot, located (header checked)
    # and pinned by the scheduler side; the worker copies them before this step's forward.
    # Empty: an async load (the worker copies ``spec.host_offsets``, then stages the rest).
    slab_offsets: tuple[int, ...] = ()
    # The store's prepared load (``HierarchicalStore.prepare_load``): where the blocks are and
    # the pins they hold; the worker releases it with ``complete_load`` once its copies ended.
    # None: nothing was prepared (the worker prepares an empty one to hold its staging's pins).
    spec: LoadSpec | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if len(self.block_ids) != len(self.keys) or not self.keys:
            raise ValueError(
                f"load for {self.req_id!r}: {len(self.block_ids)} blocks for {len(self.keys)} keys"
            )
        if self.slab_offsets and len(self.slab_offsets) != len(self.keys):
            raise ValueError(
                f"in-step load for {self.req_id!r}: {len(self.slab_offsets)} offsets for "
                f"{len(self.keys)} keys"
            )

    @property
    def in_step(self) -> bool:
        return bool(self.slab_offsets)


@dataclass(frozen=True, slots=True)
class KVConnectorMetadata:
    """One step's orders for the worker side. Built by ``build_connector_meta``; immutable."""

    saves: tuple[BlockSave, ...] = ()
    loads: tuple[BlockLoad, ...] = ()
    cancelled_loads: frozenset[str] = frozenset()
    # A block in ``saves`` was already handed to a new owner: the forward must wait for the copy.
    saves_reuse_blocks: bool = False
    num_scheduled_requests: int = 0


@dataclass(frozen=True, slots=True)
class LoadResult:
    """A finished load: ``num_loaded_blocks`` leading blocks hold valid KV (fewer than asked
    when a block was missing, corrupt, or the load failed or timed out)."""

    req_id: str
    num_loaded_blocks: int
    num_requested_blocks: int
    seconds: float
    # The copies into the GPU cache (CUDA: device time from events read once they completed;
    # CPU: wall clock), and the lower-tier reads (wall clock of the load thread).
    copy_s: float = 0.0
    read_s: float = 0.0
    in_step: bool = False  # copied before the forward of the step that admitted the request


@dataclass(frozen=True, slots=True)
class WorkerReport:
    """What the worker side tells the scheduler side after a step (via the runner's output)."""

    finished_loads: tuple[LoadResult, ...] = ()

    def load_timings(self) -> tuple[LoadTiming, ...]:
        """What the engine's TTFT breakdown takes from the finished loads."""
        return tuple(
            LoadTiming(r.req_id, r.copy_s, r.in_step, r.read_s) for r in self.finished_loads
        )

    def as_output(self) -> KVConnectorOutput:
        """This report as it rides ``ModelRunnerOutput.kv_connector_output``."""
        return KVConnectorOutput(report=self, load_timings=self.load_timings())


EMPTY_REPORT = WorkerReport()
