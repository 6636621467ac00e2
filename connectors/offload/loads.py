"""The offload worker's load path: store -> GPU cache blocks (``HostLoader``).

``start`` (engine thread, before the forward):
- in-step loads (``BlockLoad.in_step``): the scheduler side located and pinned each slot (codec
  header checked) while planning, so each block is ONE slab -> cache copy issued now
  (``load_copies.SlabToCache``; CPU: memcpy; CUDA: ``non_blocking`` on the side stream, then an event the
  compute stream waits on, since this step's forward reads them).
- async loads: the load's ``LoadSpec`` says where its leading host-tier blocks are (header
  checked, not the checksum: this process wrote them; located by the scheduler side's
  ``prepare_load``), copied the same way; the rest (lower tiers) goes through one background
  thread. Pipelined (``pipeline`` given, raw blocks: the default): chunk by chunk, each chunk
  read into a pinned staging slot and its copy into the cache issued by that thread while it
  reads the next (``connectors.offload.pipeline``). Otherwise: staged (``store.stage_load``:
  checksummed reads into pinned host slots, which it locates), then copied at a later step
  start; blocks the slab cannot take are read into one tensor and scattered. A load whose
  staging runs past ``load_timeout_s`` ends with what was copied.
- cancelled loads: the compute stream waits for their copies (the blocks may be reused at
  once); their pins are released once the copies and the staging ended. An idle step (nothing
  scheduled) waits for the first staging and for the copies, so the load is reported now.
``poll``: a load whose copies completed becomes a ``LoadResult`` (reported in the step it
landed in) and its spec is completed (``store.complete_load``: every pin it holds released).
Cost model: lower-tier staging is observed under its tier, each load's copies from host memory
under ``host`` (not the pipeline's: their spans hold the load thread's issuing pace).

Not thread-safe: the engine thread drives it; the load thread only runs ``_stage`` and touches
nothing but the store and its own result.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time

import torch

from cachestore.codec import BlockMeta, HeaderTemplate
from cachestore.cost.online import OnlineCostModel
from cachestore.hashing import BlockKey
from cachestore.store.hierarchical import HierarchicalStore
from cachestore.store.loads import HostCheck, LoadSpec, StagedRun
from connectors.device.copy import SlabCopier
from connectors.device.kv_compress import Hi4Codec
from connectors.offload.load_copies import PendingLoad, SlabToCache, Staged
from connectors.offload.metadata import BlockLoad, LoadResult
from connectors.offload.pipeline import LoadPipeline, PipedLoad, PipeJob
from connectors.offload.stats import OffloadStats
from engine.kv_cache import KVCache

log = logging.getLogger(__name__)


class HostLoader:
    def __init__(
        self,
        kv_cache: KVCache,
        store: HierarchicalStore,
        meta: BlockMeta,
        stats: OffloadStats,
        side_stream: object | None,
        *,
        load_timeout_s: float,
        cost_model: OnlineCostModel | None,
        layered: bool = False,
        coalesced: bool = False,
        codec: Hi4Codec | None = None,
        layers_per_copy: int = 0,
        issue_ahead: int = 0,
        chunk_blocks: int = 0,
        depth: int = 2,
        readers: int = 0,
        hold_async: bool = False,
    ) -> None:
        """``hold_async`` (CUDA): an async load's copies from the host tier are issued once the
        step's forward is queued (``release_held``), not before it;
        ``layered``: in-step loads land layer by layer when the copier can (CUDA;
        ``layers_per_copy``: see ``StagedDecoder``; ``issue_ahead``: see ``StagedLayers``);
        ``coalesced``: runs of consecutive slots move as one copy (``SlabCopier``);
        ``codec``: stored payloads are encoded (decoded into the blocks on arrival);
        ``chunk_blocks`` > 0 (raw blocks only): lower-tier loads are pipelined in chunks of that
        many blocks through ``depth`` staging slots, each chunk's reads split over ``readers``
        threads (0: ``pipeline_readers``' default)."""
        self.kv_cache = kv_cache
        self.codec = codec
        self.store = store
        self.meta = meta
        self.stats = stats
        self.cost_model = cost_model
        self.load_timeout_s = load_timeout_s
        self._side = side_stream
        self._hold_async = hold_async and side_stream is not None
        self._headers = HeaderTemplate(meta, keyed=True)  # a block's header names its key
        self._check = HostCheck.for_meta(meta)  # how staged host blocks are located
        slab = store.host_slab()
        host = slab.slab_tensor() if slab is not None else None
        self._copier = (
            SlabCopier(
                kv_cache,
                host,
                layered=layered,
                coalesce=coalesced,
                codec=codec,
                layers_per_copy=layers_per_copy,
                issue_ahead=issue_ahead,
            )
            if host is not None
            else None
        )
        self._copies = SlabToCache(kv_cache, self._copier, side_stream, self._headers.size)
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="kvtier-load")
        self._pipeline = (
            LoadPipeline(
                kv_cache,
                store,
                side_stream,
                chunk_blocks=chunk_blocks,
                depth=depth,
                headers=self._headers,
                readers=readers,
            )
            if chunk_blocks > 0 and codec is None
            else None
        )
        if self._pipeline is not None:  # its staging ring, off the first load's path
            self._pool.submit(self._pipeline.prepare)
        self._loads: dict[str, PendingLoad] = {}
        self._draining: list[PendingLoad] = []  # cancelled or timed out: pins released when idle
        self._finished: list[LoadResult] = []

    @property
    def layered(self) -> bool:
        """In-step loads land layer by layer (``SlabToCache.copy_in_step``)."""
        return self._copies.layered

    @property
    def load_stages(self) -> int:
        """Layer-wise loads: how many events the layers' reads wait for in turn (else 1)."""
        return self._copies.load_stages

    def start(self, loads: tuple[BlockLoad, ...], cancelled: frozenset[str], idle: bool) -> None:
        """Before the forward: drop ``cancelled`` loads, issue the copies of in-step loads and
        of every host-resident block of new loads, copy in finished stagings. ``idle`` (no
        request scheduled): wait for the first staging and for the copies."""
        self.cancel(cancelled)  # issues any copies still held first
        in_step: list[PendingLoad] = []
        # In-step loads first: this step's forward waits for their copies, so the copy stream
        # takes them before any async load's (which then run under the forward).
        for load in sorted(loads, key=lambda ld: not ld.in_step):
            if load.req_id in cancelled:  # its blocks may be reused at once
                self._release_unsent(load)
                continue
            if not load.in_step and in_step:
                self._copies.copy_in_step(in_step)  # before the first async load's copies
                in_step = []
            pending = self._begin(load, hold=self._hold_async and not idle)
            self._loads[load.req_id] = pending
            if load.in_step:
                in_step.append(pending)
        self._copies.copy_in_step(in_step)
        if idle and self._loads:
            first = min(self._loads.values(), key=lambda p: p.deadline)
            if first.staging is not None:
                cf.wait([first.staging], timeout=max(first.deadline - time.monotonic(), 0.0))
        self._advance()
        if idle and self._loads:
            for pending in self._loads.values():
                if not pending.issuing and pending.event is not None:
                    pending.event.synchronize()  # type: ignore[attr-defined]
        self.poll()

    def release_held(self) -> None:
        """Issue the async loads' copies held by ``start`` (the runner calls this once the
        step's forward is queued: ``OffloadWorker.forward_queued``). Idempotent."""
        self._copies.release_held()

    def cancel(self, cancelled: frozenset[str]) -> None:
        """Drop these loads: no copy into their blocks is issued after this returns, and this
        step's work (saves of those blocks, the forward) is ordered after the issued ones.
        Idempotent (``start`` calls it too)."""
        self.release_held()
        for req_id in cancelled:
            pending = self._loads.pop(req_id, None)
            if pending is not None:
                log.debug("load for %s cancelled", req_id)
                self._stop_pipe(pending)
                self._copies.fence(pending.event)  # its blocks may be rewritten by this forward
                self._draining.append(pending)

    def take_finished(self) -> list[LoadResult]:
        """Loads that completed since the last call (polled first); each reported once. A
        pipelined load whose thread finished during the step is taken in now (its copies
        were all issued by that thread), so it is reported a step earlier."""
        self._advance(pipelined_only=True)
        self.poll()
        done, self._finished = self._finished, []
        return done

    def close(self) -> None:
        """Drop pending loads (releasing their pins once their copies ended), stop the load
        thread. Idempotent."""
        self.release_held()
        self._draining.extend(self._loads.values())
        self._loads.clear()
        for pending in self._draining:
            self._stop_pipe(pending)
            if pending.staging is not None:
                cf.wait([pending.staging])
            if pending.event is not None:
                pending.event.synchronize()  # type: ignore[attr-defined]
        self.poll()
        self._pool.shutdown(wait=True)
        if self._pipeline is not None:
            self._pipeline.close()

    # -- issuing -------------------------------------------------------------------------

    def _begin(self, load: BlockLoad, hold: bool = False) -> PendingLoad:
        now = time.monotonic()
        # A load prepared without the store (none given) gets an empty spec: its staging's pins.
        spec = (
            load.spec if load.spec is not None else self.store.prepare_load(load.keys, claim=False)
        )
        pending = PendingLoad(load, spec, now + self.load_timeout_s, time.perf_counter())
        if load.in_step:  # copied by ``copy_in_step``, with the step's other in-step loads
            pending.issuing = False
            return pending
        lead = len(spec.host_offsets)
        if hold:
            self._copies.hold(pending, list(spec.host_offsets))
        else:
            self._copies.copy(pending, list(spec.host_offsets))
        if lead < len(load.keys) and self._pipeline is not None:
            ready = None
            if self._side is not None:  # the blocks' previous owner's queued forwards
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(self.kv_cache.device))
            pending.job = PipeJob(load.block_ids[lead:], load.keys[lead:], ready)
            pending.staging = self._pool.submit(self._pipeline.run, pending.job)
        elif lead < len(load.keys):
            pending.staging = self._pool.submit(self._stage, spec, load.keys[lead:])
        else:
            pending.issuing = False
        return pending

    def _release_unsent(self, load: BlockLoad) -> None:
        """Release the pins of a load that is dropped before any copy was issued."""
        if load.spec is not None:
            self.store.complete_load(load.spec)

    def _stage(self, spec: LoadSpec, keys: tuple[BlockKey, ...]) -> Staged:
        """Load thread: lower-tier blocks into pinned host slots (held by ``spec``), located.
        Never raises."""
        t0 = time.perf_counter()
        try:
            run = (
                self.store.stage_load(spec, keys, self._check)
                if self._copier is not None
                else StagedRun(0)
            )
        except Exception:  # a read that fails is a miss; the request recomputes
            log.exception("kv staging of %d blocks failed", len(keys))
            return Staged(0, time.perf_counter() - t0)
        n = run.num_pinned
        try:
            data = self._read_through(keys[n:]) if n < len(keys) else None
        except Exception:
            log.exception("kv read of %d blocks failed", len(keys) - n)
            data = None
        return Staged(n, time.perf_counter() - t0, data, run.host_offsets)

    def _read_through(self, keys: tuple[BlockKey, ...]) -> torch.Tensor:
        """Blocks the host slab cannot take (no slab at the top, e.g. an LMDB-only stack, or
        every slot pinned): the leading ones, read through the store into one host tensor
        (pinned on CUDA: an allocation, off the fast path), scattered by the engine thread."""
        # Host hits are views into the slab: read only once pinned for this call, or a
        # concurrent write (this very read's promotions) may reuse their slots.
        with self.store.read_pinned(keys, decoded=True) as values:
            size = self.meta.payload_bytes
            n = next((i for i, v in enumerate(values) if v is None or len(v) != size), len(values))
            data = torch.empty((n, size), dtype=torch.uint8, pin_memory=self._side is not None)
            rows = data.numpy()
            for i in range(n):
                rows[i] = memoryview(values[i]).cast("B")  # type: ignore[arg-type]
        return data

    def _advance(self, pipelined_only: bool = False) -> None:
        """Copy in the blocks of every finished staging; end staging that ran out of time."""
        now = time.monotonic()
        for pending in self._loads.values():
            future = pending.staging
            if not pending.issuing or future is None or (pipelined_only and pending.job is None):
                continue
            if future.done() and pending.job is not None:
                self._end_pipe(pending, future.result())  # type: ignore[arg-type]
            elif future.done():
                self._copy_staged(pending, future.result())  # type: ignore[arg-type]
            elif now >= pending.deadline:
                self.stats.add(timed_out_loads=1)
                self._stop_pipe(pending)
                pending.issuing = False  # the staging's pins are released once it ends

    def _end_pipe(self, pending: PendingLoad, piped: PipedLoad) -> None:
        """A pipelined load's thread is done: its copies are the load's last ones."""
        first = pending.copied
        pending.staging, pending.job, pending.issuing = None, None, False
        pending.copied += piped.num_blocks
        pending.event = piped.last if piped.last is not None else pending.event
        pending.piped_timings.extend(piped.timings)
        pending.piped_cpu_s += piped.cpu_copy_s
        pending.piped_blocks += piped.num_blocks
        pending.read_seconds += piped.read_s
        tiers = pending.load.source_tiers
        tier = tiers[first] if first < len(tiers) else ""
        if piped.num_blocks and tier and tier != "host" and self.cost_model is not None:
            nbytes = piped.num_blocks * self.kv_cache.bytes_per_block
            self.cost_model.observe_transfer(tier, nbytes, max(piped.read_s, 1e-9))

    def _stop_pipe(self, pending: PendingLoad) -> None:
        """No more copies from the load thread; the load keeps what was issued (its pins are
        released once the thread ended: ``_release``)."""
        job, pending.job = pending.job, None
        if job is None:
            return
        n, last = job.cancel()
        pending.copied += n
        pending.piped_blocks += n
        pending.event = last if last is not None else pending.event

    def _copy_staged(self, pending: PendingLoad, staged: Staged) -> None:
        first = pending.copied
        keys = pending.load.keys[first : first + staged.num_blocks]
        pending.staging = None
        pending.issuing = False
        pending.read_seconds += staged.seconds
        lead = len(staged.offsets)
        self._copies.copy(pending, list(staged.offsets))
        data = staged.data
        if lead == len(keys) and data is not None and len(data):  # one sync scatter
            t0 = time.perf_counter()
            start = pending.copied
            self._scatter(pending.load.block_ids[start : start + len(data)], data)
            pending.copy_seconds += time.perf_counter() - t0
            pending.copied += len(data)
            keys = pending.load.keys[first : pending.copied]
        tiers = pending.load.source_tiers
        tier = tiers[first] if first < len(tiers) else ""
        if keys and tier and tier != "host" and self.cost_model is not None:
            nbytes = len(keys) * self.kv_cache.bytes_per_block
            self.cost_model.observe_transfer(tier, nbytes, staged.seconds)

    def _scatter(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Payload rows read through the store (``_read_through``) into their blocks."""
        if self.codec is None:
            spec = self.kv_cache.spec
            self.kv_cache.scatter_blocks(
                block_ids, data.view(spec.dtype).view(-1, *spec.block_shape)
            )
            return
        rows = self.kv_cache.byte_rows()
        src = data.reshape(-1).to(rows.device)
        self.codec.decode_into(src, [i * data.shape[1] for i in range(len(data))], rows, block_ids)

    # -- completion ----------------------------------------------------------------------

    def poll(self) -> None:
        """Report loads whose copies completed; release pins of drained ones."""
        for req_id, pending in list(self._loads.items()):
            if pending.issuing or pending.held or not _done(pending.event):
                continue
            del self._loads[req_id]
            self._release(pending)
            n, load = pending.copied, pending.load
            seconds = time.perf_counter() - pending.started
            self.stats.add(
                num_loads=1,
                failed_loads=int(n < len(load.keys)),
                loaded_blocks=n,
                loaded_bytes=n * self.meta.payload_bytes,
                load_seconds=seconds,
            )
            copy_s = pending.copy_time()
            self._observe_host(pending)
            self._finished.append(
                LoadResult(
                    req_id, n, len(load.keys), seconds, copy_s, pending.read_seconds, load.in_step
                )
            )
        still: list[PendingLoad] = []
        for pending in self._draining:
            if (pending.staging is None or pending.staging.done()) and _done(pending.event):
                self._release(pending)
            else:
                still.append(pending)
        self._draining = still

    def _release(self, pending: PendingLoad) -> None:
        """Complete the load's spec once its staging ended (its pins are the spec's)."""
        future, pending.staging = pending.staging, None
        if future is not None and not future.done():  # ended without its copies
            pending.staging = future
            self._draining.append(pending)
            return
        self.store.complete_load(pending.spec)

    def _observe_host(self, pending: PendingLoad) -> None:
        """The host -> device hop's sample: the load's copies from host memory only (the
        pipeline's copies are paced by its reads, observed under their tier)."""
        if self.cost_model is None or pending.copied <= pending.piped_blocks:
            return
        if pending.timings:
            nbytes = sum(n for _, _, n in pending.timings)
        elif pending.copy_seconds:
            nbytes = (pending.copied - pending.piped_blocks) * self.kv_cache.bytes_per_block
        else:
            return  # its blocks moved in another load's transfer, observed there
        # events that span nothing (or out of order) give no sample, not an infinite rate
        seconds = pending.host_copy_time()
        if seconds > 0:
            self.cost_model.observe_transfer("host", nbytes, seconds)


def _done(event: object | None) -> bool:
    return event is None or bool(event.query())  # type: ignore[attr-defined]
