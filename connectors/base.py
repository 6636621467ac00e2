"""The KV connector contract, split by role (the shape of vLLM's KV connector API).

- The **scheduler side** (``SchedulerConnector``) decides, on the scheduler thread, torch-free:
  how many further leading tokens the lower tiers can supply for a new request and from where
  (``get_num_new_matched_tokens``, side-effect free), what to load once blocks are allocated
  (``update_state_after_alloc``), which requests finished loading (``get_finished_loading``),
  what a finished request means for its blocks (``request_finished``), and the one per-step
  metadata object (``build_connector_meta``).
- The **worker side** (``WorkerConnector``) moves bytes, on the engine thread, around the
  forward pass: ``start_load_kv`` (copies out the blocks to save and scatters completed loads
  into their GPU blocks, before the forward can overwrite anything), ``wait_for_save`` and
  ``after_step`` after it.
- ``KVConnectorMetadata`` (frozen) is the only thing that crosses from the scheduler side to the
  worker side, through ``SchedulerOutput.kv_connector_metadata``. The worker's answer crosses
  back as one ``WorkerReport`` per step, handed over by the engine
  (``SchedulerConnector.update_from_worker``).

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
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from engine.core_types import SchedulerOutput
from engine.request import Request


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


@dataclass(frozen=True, slots=True)
class BlockSave:
    """Copy GPU block ``block_id`` out to the tiers under ``key`` (``block_key`` of its hash)."""

    block_id: int
    key: str


@dataclass(frozen=True, slots=True)
class BlockLoad:
    """Load ``keys`` (in order) into the request's GPU blocks ``block_ids``; the first block
    starts at token ``first_token`` (the GPU prefix hit, a multiple of the block size)."""

    req_id: str
    block_ids: tuple[int, ...]
    keys: tuple[str, ...]
    first_token: int
    source_tiers: tuple[str, ...] = ()  # the tier expected to serve each block (for pricing)
    # In-step load: the host slab offset of each block's encoded slot, located (header checked)
    # and pinned by the scheduler side; the worker copies them before this step's forward and
    # unpins them. Empty: an async load (``prepare_load`` pins; the worker locates or stages).
    slab_offsets: tuple[int, ...] = ()

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


@dataclass(frozen=True, slots=True)
class WorkerReport:
    """What the worker side tells the scheduler side after a step (via the engine)."""

    finished_loads: tuple[LoadResult, ...] = ()


EMPTY_REPORT = WorkerReport()


class SchedulerConnector(Protocol):
    """The scheduler side. Every method runs on the scheduler thread; none touches a device."""

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> ExternalHit:
        """How many tokens past ``num_computed_tokens`` (the GPU hit) lower tiers can supply and
        should be loaded. Side-effect free (it may memoize its answer); may be asked again."""
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

    def build_connector_meta(self, output: SchedulerOutput) -> object:
        """The per-step metadata handed to the worker side via ``kv_connector_metadata``.
        Called for every step, empty ones included."""
        ...

    def request_finished(self, request: Request, block_ids: list[int]) -> None:
        """A request finished or was aborted, or gives its blocks up while its load is in
        flight (preempted while overlapping, released for running work): its blocks are freed
        right after this call, so any load of it must be cancelled."""
        ...


class WorkerConnector(Protocol):
    """The worker side, as ``ModelRunner.set_kv_connector`` calls it (engine thread only)."""

    def start_load_kv(self, metadata: object | None) -> None:
        """Before the forward pass: copy out this step's saves, copy this step's in-step loads
        (the forward reads them), then scatter completed async loads."""
        ...

    def wait_for_save(self) -> None:
        """After the forward pass: make this step's saves durable in the top tier."""
        ...

    def after_step(self, metadata: object | None) -> None:
        """End of step bookkeeping."""
        ...

    def take_report(self) -> WorkerReport:
        """What finished since the last call (each load reported once)."""
        ...
