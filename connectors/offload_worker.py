"""The offload connector's worker side: moves KV bytes between the GPU cache and the store.

Per step (``ModelRunner`` calls, engine thread):
1. ``start_load_kv(meta)``, before the forward pass:
   - saves: drop the keys the store already holds (``prepare_store``), then ONE gather of all the
     remaining blocks. CPU: a synchronous copy. CUDA: on a side stream (after the compute
     stream's earlier writes) into pinned host memory; the compute stream waits on that copy's
     event only when ``meta.saves_reuse_blocks`` (a block already has a new owner).
   - loads: new ones are handed to one background thread, which reads the keys (pinned by
     the scheduler side's ``prepare_load``; it unpins them) through the store, one read per run
     of blocks from the same tier, into a (pinned) host tensor. Cancelled ones are dropped.
     Every load whose read finished is scattered into its GPU blocks in ONE batched copy; a
     load running past ``load_timeout_s`` ends with 0 blocks (the scheduler recomputes). On an
     empty step with loads in flight it waits for the first to finish (up to its deadline)
     instead of letting the engine spin.
   - cost model (``observe_transfer``: the hop from a tier into host memory; ``host``: host ->
     device): each non-host run's timed read under its tier, each batched scatter under
     ``host``. A run read from the host tier is host memory already and is not a hop.
2. ``wait_for_save()``, after the forward: waits for the gather's event (CUDA), encodes the
   blocks (codec header + payload) and writes them to the top tier; the store demotes from there.
3. ``take_report()``: finished loads for the scheduler side.

Not thread-safe except where noted: the engine thread drives it; the load thread only runs
``_read`` and touches nothing but the store, the stats and its own result.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from dataclasses import dataclass

import torch

from cachestore.codec import BlockMeta, encode_block
from cachestore.cost_online import OnlineCostModel
from cachestore.store import HierarchicalStore
from connectors.base import BlockLoad, BlockSave, KVConnectorMetadata, LoadResult, WorkerReport
from connectors.offload_stats import OffloadStats
from engine.kv_cache import KVCache

log = logging.getLogger(__name__)
KV_LAYOUT = "block_major_v1"  # [num_layers, 2, block_size, kv_heads, head_dim] per block


def block_meta(kv_cache: KVCache, namespace_prefix: str) -> BlockMeta:
    """The codec metadata of one block of ``kv_cache`` (its encoded size sizes host slots)."""
    return BlockMeta(
        dtype=str(kv_cache.spec.dtype),
        shape=kv_cache.spec.block_shape,
        layout=KV_LAYOUT,
        namespace=namespace_prefix,
    )


@dataclass(frozen=True, slots=True)
class TierSample:
    """One timed hop for the cost model: ``nbytes`` from ``tier`` into host memory."""

    tier: str
    nbytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class _ReadResult:
    num_blocks: int
    data: torch.Tensor | None  # [num_blocks, *block_shape] on the host
    seconds: float
    nbytes: int
    hops: tuple[TierSample, ...] = ()  # per run of blocks from one tier, in order


def _runs(tiers: tuple[str, ...]) -> list[tuple[str, int, int]]:
    """``(tier, start, end)`` for each stretch of consecutive blocks from one tier."""
    out: list[tuple[str, int, int]] = []
    for i, tier in enumerate(tiers):
        if out and out[-1][0] == tier:
            out[-1] = (tier, out[-1][1], i + 1)
        else:
            out.append((tier, i, i + 1))
    return out


@dataclass(slots=True)
class _PendingLoad:
    load: BlockLoad
    future: cf.Future[_ReadResult]
    deadline: float


@dataclass(slots=True)
class _PendingSave:
    saves: list[BlockSave]
    data: torch.Tensor  # host copy, valid once ``event`` (if any) completed
    event: object | None
    started: float


class OffloadWorker:
    def __init__(
        self,
        kv_cache: KVCache,
        store: HierarchicalStore,
        meta: BlockMeta,
        *,
        load_timeout_s: float,
        stats: OffloadStats,
        cost_model: OnlineCostModel | None = None,
    ) -> None:
        self.kv_cache = kv_cache
        self.store = store
        self.meta = meta
        self.load_timeout_s = load_timeout_s
        self.stats = stats
        self.cost_model = cost_model
        self._cuda = kv_cache.device.type == "cuda"
        self._side_stream = torch.cuda.Stream(kv_cache.device) if self._cuda else None
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="kvtier-load")
        self._loads: dict[str, _PendingLoad] = {}
        self._finished: list[LoadResult] = []
        self._save: _PendingSave | None = None

    # -- runner hooks --------------------------------------------------------------------

    def start_load_kv(self, metadata: object | None) -> None:
        if not isinstance(metadata, KVConnectorMetadata):
            return
        self._start_saves(metadata.saves, metadata.saves_reuse_blocks)
        for load in metadata.loads:
            future = self._pool.submit(self._read, load)
            self._loads[load.req_id] = _PendingLoad(
                load, future, time.monotonic() + self.load_timeout_s
            )
        for req_id in metadata.cancelled_loads:
            if self._loads.pop(req_id, None) is not None:
                log.debug("load for %s cancelled", req_id)
        self._finish_loads(wait=metadata.num_scheduled_requests == 0)

    def wait_for_save(self) -> None:
        pending, self._save = self._save, None
        if pending is None:
            return
        if pending.event is not None:
            pending.event.synchronize()  # type: ignore[attr-defined]
        rows = pending.data.view(torch.uint8).reshape(len(pending.saves), -1).numpy()
        items = [
            (s.key, encode_block(memoryview(rows[i]), self.meta))
            for i, s in enumerate(pending.saves)
        ]
        keys = [s.key for s in pending.saves]
        try:
            written = self.store.put_many(items)
        finally:
            self.store.complete_store(keys, True)
        self.stats.add(
            saved_blocks=written,
            saved_bytes=written * self.meta.payload_bytes,
            save_seconds=time.perf_counter() - pending.started,
        )

    def after_step(self, metadata: object | None) -> None:
        return None

    def take_report(self) -> WorkerReport:
        done, self._finished = self._finished, []
        return WorkerReport(finished_loads=tuple(done))

    def save_now(self, saves: tuple[BlockSave, ...]) -> None:
        """Copy ``saves`` out and write them at once (engine idle: shutdown, flush)."""
        self._start_saves(saves, reuse=False)
        self.wait_for_save()

    def close(self) -> None:
        """Finish pending saves, drop pending loads, stop the load thread. Idempotent."""
        self.wait_for_save()
        self._loads.clear()
        self._pool.shutdown(wait=True)

    # -- saves ---------------------------------------------------------------------------

    def _start_saves(self, saves: tuple[BlockSave, ...], reuse: bool) -> None:
        if not saves:
            return
        if self._save is not None:  # the last step raised before wait_for_save: finish it
            self.wait_for_save()
        t0 = time.perf_counter()
        fresh = set(self.store.prepare_store([s.key for s in saves]))
        todo = [s for s in saves if s.key in fresh]
        seen: set[str] = set()
        todo = [s for s in todo if not (s.key in seen or seen.add(s.key))]  # type: ignore[func-returns-value]
        self.stats.add(save_skipped_blocks=len(saves) - len(todo))
        if not todo:
            return
        ids = [s.block_id for s in todo]
        if self._side_stream is None:
            self._save = _PendingSave(todo, self.kv_cache.gather_blocks(ids), None, t0)
            return
        compute = torch.cuda.current_stream(self.kv_cache.device)
        host = torch.empty(
            (len(ids), *self.kv_cache.spec.block_shape),
            dtype=self.kv_cache.spec.dtype,
            pin_memory=True,
        )
        event = torch.cuda.Event()
        with torch.cuda.stream(self._side_stream):
            self._side_stream.wait_stream(compute)  # the KV was written by earlier forwards
            gathered = self.kv_cache.gather_blocks(ids)
            host.copy_(gathered, non_blocking=True)
            event.record(self._side_stream)
        gathered.record_stream(self._side_stream)
        if reuse:
            compute.wait_event(event)
        self._save = _PendingSave(todo, host, event, t0)

    # -- loads ---------------------------------------------------------------------------

    def _read(self, load: BlockLoad) -> _ReadResult:
        """Load thread: read ``load.keys`` through the store into one host tensor, one store
        read per run of blocks expected from the same tier (each timed: that tier's hop into
        host memory). Stops at the first missing block. Never raises: any failure is a short
        (possibly empty) result."""
        t0 = time.perf_counter()
        keys = list(load.keys)
        size = self.meta.payload_bytes
        tiers = load.source_tiers if len(load.source_tiers) == len(keys) else ("",) * len(keys)
        hops: list[TierSample] = []
        n = 0
        try:
            try:  # the scheduler side pinned the keys (prepare_load) when it planned the load
                data = torch.empty(
                    (len(keys), *self.kv_cache.spec.block_shape),
                    dtype=self.kv_cache.spec.dtype,
                    pin_memory=self._cuda,
                )
                rows = data.view(torch.uint8).view(len(keys), size).numpy()
                for tier, start, end in _runs(tiers):
                    t_run = time.perf_counter()
                    values = self.store.get_many(keys[start:end])
                    got = 0
                    while got < len(values) and values[got] is not None:
                        if len(values[got]) != size:  # type: ignore[arg-type]
                            break
                        rows[start + got] = memoryview(values[got]).cast("B")  # type: ignore[arg-type]
                        got += 1
                    n += got
                    if got:
                        hops.append(TierSample(tier, got * size, time.perf_counter() - t_run))
                    if got < end - start:
                        break
            finally:
                self.store.complete_load(keys)
        except Exception:  # a read that fails is a miss; the request recomputes
            log.exception("kv load for %s failed", load.req_id)
            return _ReadResult(0, None, time.perf_counter() - t0, 0)
        return _ReadResult(n, data[:n], time.perf_counter() - t0, n * size, tuple(hops))

    def _finish_loads(self, wait: bool) -> None:
        if wait and self._loads:
            first = min(self._loads.values(), key=lambda p: p.deadline)
            cf.wait([first.future], timeout=max(first.deadline - time.monotonic(), 0.0))
        now = time.monotonic()
        ids: list[int] = []
        chunks: list[torch.Tensor] = []
        for req_id, pending in list(self._loads.items()):
            load = pending.load
            if pending.future.done():
                res = pending.future.result()
            elif now >= pending.deadline:
                self.stats.add(timed_out_loads=1)
                res = _ReadResult(0, None, self.load_timeout_s, 0)
            else:
                continue
            del self._loads[req_id]
            if res.num_blocks and res.data is not None:
                ids.extend(load.block_ids[: res.num_blocks])
                chunks.append(res.data)
            short = res.num_blocks < len(load.keys)
            self.stats.add(
                num_loads=1,
                failed_loads=int(short),
                loaded_blocks=res.num_blocks,
                loaded_bytes=res.nbytes,
                load_seconds=res.seconds,
            )
            self._observe(res.hops)
            self._finished.append(LoadResult(req_id, res.num_blocks, len(load.keys), res.seconds))
        if ids:
            data = chunks[0] if len(chunks) == 1 else torch.cat(chunks)
            t0 = time.perf_counter()
            self.kv_cache.scatter_blocks(ids, data)  # from pinned memory: synchronous
            if self.cost_model is not None:  # the host -> device hop of every block loaded
                nbytes = data.numel() * data.element_size()
                self.cost_model.observe_transfer("host", nbytes, time.perf_counter() - t0)

    def _observe(self, hops: tuple[TierSample, ...]) -> None:
        """Feed the cost model each tier's read, per ``observe_transfer``'s contract (the hop
        from that tier into host memory). A run read from the host tier is not a hop: it is
        host memory already (its ``host`` hop is the scatter, observed there)."""
        if self.cost_model is None:
            return
        for hop in hops:
            if hop.tier and hop.tier != "host":
                self.cost_model.observe_transfer(hop.tier, hop.nbytes, hop.seconds)
