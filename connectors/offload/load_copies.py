"""The offload worker's slab -> GPU cache copies of a load (``HostLoader``'s copy half).

``PendingLoad`` is one load in progress: how many leading blocks' copies were issued, the
event of the last one, its timings, and the store's ``LoadSpec`` that holds its pins. ``SlabToCache`` issues the copies:
- ``copy``: the next blocks of a load from their slab offsets (CPU: a synchronous memcpy;
  CUDA: ``non_blocking`` on the side stream, after the compute stream's queued work, an event
  recorded after them); ``hold`` / ``release_held``: the same, issued once this step's forward
  is queued (an async load's copies then run beside the forward, not ahead of its uploads);
- ``copy_in_step``: the in-step loads of one step, which this step's forward reads: with the
  layer kernel one copy per layer for all of them, each layer's attention waiting for its own
  layer only (``KVCache.set_layer_ready``); otherwise per-block copies the forward waits for;
- ``fence``: nothing touches a load's blocks before its last issued copy completed.

Not thread-safe: the engine thread calls it.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from cachestore.store.loads import LoadSpec
from connectors.device.copy import SlabCopier
from connectors.offload.metadata import BlockLoad
from connectors.offload.pipeline import PipedLoad, PipeJob
from engine.kv_cache import KVCache


@dataclass(frozen=True, slots=True)
class Staged:
    """What the load thread's staging of a load's lower-tier blocks got."""

    num_blocks: int  # leading keys now pinned in the host tier
    seconds: float
    data: torch.Tensor | None = None  # the blocks after those, read through the store
    offsets: tuple[int, ...] = ()  # slab offsets of the leading run of the pinned ones


@dataclass(slots=True)
class PendingLoad:
    load: BlockLoad
    spec: LoadSpec  # the store's prepared load: every pin the load holds, until completed
    deadline: float
    started: float
    copied: int = 0  # leading blocks whose copies were issued
    staging: cf.Future[Staged] | cf.Future[PipedLoad] | None = None
    job: PipeJob | None = None  # pipelined: the load thread's copies (cancel stops them)
    event: object | None = None  # CUDA: recorded after the last issued copy
    timings: list[tuple[object, object, int]] = field(
        default_factory=list
    )  # CUDA start, end, bytes
    copy_seconds: float = 0.0  # CPU
    read_seconds: float = 0.0  # lower-tier staging (load thread)
    # Layer-wise in-step: the step's one transfer of every in-step load (each waited for all).
    shared: tuple[object, object] | None = None
    issuing: bool = True  # more copies may follow (staging pending)
    held: int = 0  # copies held until this step's forward is queued (``SlabToCache.hold``)
    # The pipeline's staging -> cache copies (``connectors.offload.pipeline``), apart: their
    # event spans also hold the load thread's pace of issuing them between its reads, so they
    # are no measure of the host -> device link (``host_copy_time``).
    piped_timings: list[tuple[object, object, int]] = field(default_factory=list)
    piped_cpu_s: float = 0.0
    piped_blocks: int = 0

    def copy_time(self) -> float:
        """The load's copy time: CUDA events (all completed: the last one has) and CPU wall
        time, the pipeline's copies included. Reading a completed event's time never waits."""
        piped = _event_seconds([(b, e) for b, e, _ in self.piped_timings])
        return self.host_copy_time() + piped + self.piped_cpu_s

    def host_copy_time(self) -> float:
        """The copies from the host tier's slab (or staged host slots) alone."""
        pairs = [self.shared] if self.shared is not None else [(b, e) for b, e, _ in self.timings]
        return _event_seconds(pairs) + self.copy_seconds


def _event_seconds(pairs: list[tuple[object, object]]) -> float:
    """Seconds between each (begin, end) pair of completed CUDA events, summed."""
    return sum(b.elapsed_time(e) for b, e in pairs) / 1e3  # type: ignore[attr-defined]


class SlabToCache:
    def __init__(
        self,
        kv_cache: KVCache,
        copier: SlabCopier | None,
        side_stream: object | None,
        header_size: int,
    ) -> None:
        """``copier``: None without a host slab (nothing is copied); ``side_stream``: CUDA's
        copy stream, None on CPU; ``header_size``: a slot's codec header, before its payload."""
        self.kv_cache = kv_cache
        self.copier = copier
        self._side = side_stream
        self._header_size = header_size
        self._held: list[tuple[PendingLoad, list[int], list[int]]] = []  # ``hold``
        self._held_after: object | None = None  # the compute stream when the first was held
        # In-step loads whose layer groups the forward issues (``copy_in_step``): each
        # load's finish and its loads, until ``finish_in_step``.
        self._on_demand: list[tuple[Callable[[], None], list[PendingLoad]]] = []

    @property
    def layered(self) -> bool:
        """In-step loads land layer by layer (see ``copy_in_step``)."""
        return self._side is not None and self.copier is not None and self.copier.layered

    @property
    def load_stages(self) -> int:
        """Layer-wise loads: how many events the layers' reads wait for in turn (else 1)."""
        return self.copier.load_stages if self.layered else 1  # type: ignore[union-attr]

    def copy_in_step(self, loads: list[PendingLoad]) -> None:
        """This step's forward reads these blocks. CUDA with the layer kernel: one copy per
        layer for all of them on the side stream, each layer's attention waiting only for its
        own layer (KVCache.set_layer_ready), so the forward runs while later layers land.
        Otherwise per-block copies the whole forward waits for."""
        if not loads or self.copier is None:
            return
        if not self.layered:
            for pending in loads:
                self.copy(pending, list(pending.load.slab_offsets), forward_reads=True)
            return
        ids = [b for p in loads for b in p.load.block_ids[: len(p.load.slab_offsets)]]
        payload = [o + self._header_size for p in loads for o in p.load.slab_offsets]
        begin = torch.cuda.Event(enable_timing=True)
        compute = torch.cuda.current_stream(self.kv_cache.device)
        with torch.cuda.stream(self._side):  # type: ignore[arg-type]
            self._side.wait_stream(compute)  # type: ignore[attr-defined]
            begin.record(self._side)  # type: ignore[arg-type]
            events = self.copier.to_device_layers(ids, payload)
        # Groups issued as the forward reaches them (``load_issue_ahead``): its layer reads
        # issue them; the loads stay held (not reported, pins kept) until ``finish_in_step``.
        ensure = getattr(events, "ensure", None)
        self.kv_cache.set_layer_ready(list(events), ensure)
        end = events[-1]
        for pending in loads:
            pending.copied += len(pending.load.slab_offsets)
            pending.event = end
            pending.shared = (begin, end)
        if ensure is not None:
            for pending in loads:
                pending.held += 1
            self._on_demand.append((events.finish, loads))  # type: ignore[attr-defined]
        # One transfer: observed once (by the first load), with all its bytes.
        loads[0].timings.append((begin, end, len(ids) * self.kv_cache.bytes_per_block))

    def copy(self, pending: PendingLoad, offsets: list[int], forward_reads: bool = False) -> None:
        """Issue the slab -> cache copies of the next ``len(offsets)`` blocks of ``pending``.
        ``forward_reads``: this step's forward reads them (CUDA: the compute stream waits)."""
        if not offsets or self.copier is None:
            return
        ids, payload = self._take(pending, offsets)
        self._issue(pending, ids, payload, forward_reads, None)

    def hold(self, pending: PendingLoad, offsets: list[int]) -> None:
        """As ``copy``, but issued by ``release_held`` (CUDA; at once on CPU): an async load's
        copies wait until this step's forward is queued, so the forward's own host -> device
        uploads never queue behind them on the copy engine, and they run beside its compute.
        They are ordered after the compute stream's work queued before this call (the blocks'
        previous owner), not after this step's forward, which does not touch them."""
        if not offsets or self.copier is None:
            return
        if self._side is None:
            self.copy(pending, offsets)
            return
        if self._held_after is None:
            self._held_after = torch.cuda.Event()
            self._held_after.record(torch.cuda.current_stream(self.kv_cache.device))
        ids, payload = self._take(pending, offsets)
        pending.held += 1
        self._held.append((pending, ids, payload))

    def finish_in_step(self) -> None:
        """Issue whatever this step's in-step loads left for the forward to issue (the
        forward's ``clear_layer_ready`` normally did) and let those loads be reported.
        Idempotent."""
        on_demand, self._on_demand = self._on_demand, []
        for finish, loads in on_demand:
            finish()
            for pending in loads:
                pending.held -= 1

    def release_held(self) -> None:
        """Issue every held copy (``hold``). Idempotent; a load's ``held`` count drops as its
        copies are issued, so it is not reported before."""
        self.finish_in_step()
        held, self._held = self._held, []
        after, self._held_after = self._held_after, None
        for pending, ids, payload in held:
            self._issue(pending, ids, payload, False, after)
            pending.held -= 1

    def _take(self, pending: PendingLoad, offsets: list[int]) -> tuple[list[int], list[int]]:
        """The cache blocks and slab payload offsets of ``pending``'s next ``len(offsets)``
        blocks, counted as copied."""
        start = pending.copied
        ids = pending.load.block_ids[start : start + len(offsets)]
        pending.copied += len(offsets)
        return ids, [o + self._header_size for o in offsets]

    def _issue(
        self,
        pending: PendingLoad,
        ids: list[int],
        payload: list[int],
        forward_reads: bool,
        after: object | None,
    ) -> None:
        if self._side is None:
            t0 = time.perf_counter()
            self.copier.to_device(ids, payload)  # type: ignore[union-attr]
            pending.copy_seconds += time.perf_counter() - t0
            return
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        compute = torch.cuda.current_stream(self.kv_cache.device)
        with torch.cuda.stream(self._side):  # type: ignore[arg-type]
            # The blocks' previous owner may still have forwards queued that write them.
            if after is None:
                self._side.wait_stream(compute)  # type: ignore[attr-defined]
            else:
                self._side.wait_event(after)  # type: ignore[attr-defined]
            begin.record(self._side)  # type: ignore[arg-type]
            self.copier.to_device(ids, payload)  # type: ignore[union-attr]
            end.record(self._side)  # type: ignore[arg-type]
        if forward_reads:
            compute.wait_event(end)
        pending.event = end
        pending.timings.append((begin, end, len(ids) * self.kv_cache.bytes_per_block))

    def fence(self, done: object | None) -> None:
        """Nothing may touch the blocks before ``done`` (the last issued copy) completed:
        CUDA, the compute stream waits for it; a CPU copy (on the pipeline's thread) is
        waited for."""
        if done is None:
            return
        if isinstance(done, torch.cuda.Event):
            torch.cuda.current_stream(self.kv_cache.device).wait_event(done)
        else:
            done.synchronize()  # type: ignore[attr-defined]
