"""The offload worker's save path: GPU blocks straight into host-tier slots.

Per step (engine thread): ``start(saves, reuse)`` before the forward drops keys the store holds
or another caller is storing (``prepare_store``), and blocks a lower tier holds while saving
them again does not pay (``worth_saving``: ``cachestore.store.resave``), reserves one host slot per block
(``store.reserve_host``: evictions go to the demotion queue), writes each slot's codec header
(``header_bytes``, a few dozen bytes) on the CPU, and copies the payloads into the slots:
CUDA: one ``index_select`` of the blocks on a side stream (after the compute stream's earlier
writes; the compute stream waits on it only when ``reuse``), then one 2 MiB D2H copy per block
into the pinned slab, and an event; CPU: synchronous copies. ``end_step()`` after the forward
hands the batch to the seal thread (CUDA) or seals it at once (CPU): wait for the event, write
each checksum (``seal_block``), ``commit_host``. So the checksum is in place before a block is
visible and thus before it can be demoted; no pinned allocation and no encode on the engine
thread. A slot that cannot be reserved (top tier not a slab, a write-through store, no room)
falls back to
``encode_block`` + ``put_many`` in the same seal job.

Not thread-safe: the engine thread calls ``start``/``end_step``/``drain``; the seal thread only
touches the store (thread-safe), the stats (locked) and its own batch.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from dataclasses import dataclass

import torch

from cachestore.codec import BlockMeta, HeaderTemplate, encode_block, encoded_size, seal_block
from cachestore.launch_gate import STEP_LAUNCHES
from cachestore.store.hierarchical import HierarchicalStore
from connectors.device.copy import SlabCopier
from connectors.device.kv_compress import Hi4Codec
from connectors.offload.metadata import BlockSave
from connectors.offload.stats import OffloadStats
from engine.kv_cache import KVCache

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Batch:
    slotted: list[tuple[str, memoryview]]  # key, its reserved slot (whole encoded block)
    spilled: list[tuple[str, torch.Tensor]]  # key, payload on the host (no slot)
    event: object | None  # the copies' CUDA event
    started: float


class HostSaver:
    def __init__(
        self,
        kv_cache: KVCache,
        store: HierarchicalStore,
        meta: BlockMeta,
        stats: OffloadStats,
        side_stream: object | None,
        codec: Hi4Codec | None = None,
    ) -> None:
        """``codec``: blocks are stored encoded (``meta`` describes the encoded payload)."""
        self.kv_cache = kv_cache
        self.codec = codec
        self.store = store
        self.meta = meta
        self.stats = stats
        self._side = side_stream
        # Blocks carry their key (codec version 2): a read under another key is a miss.
        self._headers = HeaderTemplate(meta, keyed=True)
        self._total = encoded_size(meta, keyed=True)
        slab = store.host_slab()
        host = slab.slab_tensor() if slab is not None else None
        if store.config.write_through_to is not None:
            host = None  # ``put_many`` writes through to the durable tier: keep that path
        self._copier = SlabCopier(kv_cache, host, codec=codec) if host is not None else None
        self._pending: _Batch | None = None
        # CUDA: recorded on the save stream after this step's gather (None: nothing gathered).
        # Loads run on another stream and wait for it: a block saved and reloaded in one step
        # must be read out before it is written.
        self.gather_event: object | None = None
        self._sealing: list[cf.Future[None]] = []
        self._pool = (
            cf.ThreadPoolExecutor(1, thread_name_prefix="kvtier-seal")
            if side_stream is not None
            else None
        )

    def start(self, saves: tuple[BlockSave, ...], reuse: bool) -> None:
        """Reserve slots and issue the copies of ``saves`` (engine thread, before the forward)."""
        self.gather_event = None
        if not saves:
            return
        if self._pending is not None:  # the last step raised before end_step: finish it
            self.end_step()
        t0 = time.perf_counter()
        # Blocks a lower tier holds may not be worth saving again (cachestore.store.resave).
        wanted = self.store.worth_saving([s.key for s in saves])
        fresh = set(self.store.prepare_store(wanted))
        todo: dict[str, int] = {}
        for s in saves:
            if s.key in fresh and s.key not in todo:
                todo[s.key] = s.block_id
        self.stats.add(save_skipped_blocks=len(saves) - len(todo))
        if not todo:
            return
        slotted, offsets, rows, spill = self._reserve(list(todo))
        ids = list(todo.values())
        event = None
        spilled: list[tuple[str, torch.Tensor]] = []
        if self._side is None:
            if self._copier is not None:
                self._copier.to_host([ids[r] for r in rows], offsets)
            spilled = [
                (k, self._encode(self.kv_cache.gather_blocks([ids[r]]))[0].clone())
                for r, k in spill
            ]
        else:
            compute = torch.cuda.current_stream(self.kv_cache.device)
            event = torch.cuda.Event()
            with torch.cuda.stream(self._side):  # type: ignore[arg-type]
                self._side.wait_stream(compute)  # type: ignore[attr-defined]
                gathered = self.kv_cache.byte_rows().index_select(
                    0, torch.as_tensor(ids, device=self.kv_cache.device)
                )
                gather_done = torch.cuda.Event()
                gather_done.record(self._side)
                self.gather_event = gather_done
                if reuse:  # a block has a new owner: the forward waits for the gather only
                    compute.wait_event(gather_done)
                payloads = self._encode(gathered)
                if self._copier is not None:
                    self._copier.rows_to_host(payloads, rows, offsets)
                spilled = [(k, payloads[r].to("cpu", non_blocking=True)) for r, k in spill]
                event.record(self._side)  # type: ignore[arg-type]
            gathered.record_stream(self._side)  # type: ignore[arg-type]
            payloads.record_stream(self._side)  # type: ignore[arg-type]
        self._pending = _Batch(slotted, spilled, event, t0)

    def _reserve(
        self, keys: list[str]
    ) -> tuple[list[tuple[str, memoryview]], list[int], list[int], list[tuple[int, str]]]:
        """A host slot for each of ``keys`` (row ``i`` of the batch), its header written: the
        slotted keys and their slot views, each payload's slab offset and batch row, and the
        ``(row, key)`` of every key that got no slot (no host tier, or full: it spills)."""
        slotted: list[tuple[str, memoryview]] = []
        offsets: list[int] = []
        rows: list[int] = []
        spill: list[tuple[int, str]] = []
        hsize = self._headers.size
        for row, key in enumerate(keys):
            res = self.store.reserve_host(key, self._total) if self._copier is not None else None
            if res is None:
                spill.append((row, key))
                continue
            res.view[:hsize] = self._headers.for_key(key)
            slotted.append((key, res.view))
            offsets.append(res.offset + hsize)
            rows.append(row)
        return slotted, offsets, rows, spill

    def _encode(self, blocks: torch.Tensor) -> torch.Tensor:
        """Whole blocks (any shape with a leading block dim) -> the stored payload rows."""
        rows = blocks.reshape(len(blocks), -1).view(torch.uint8)
        return rows if self.codec is None else self.codec.encode(rows)

    def _storable(self, payload: memoryview | torch.Tensor) -> bool:
        """False for an encoded block that lost escapes (``Hi4Codec.overflowed``)."""
        if self.codec is None:
            return True
        if isinstance(payload, torch.Tensor):
            payload = memoryview(payload.contiguous().view(torch.uint8).numpy())
        return not self.codec.overflowed(payload)

    def end_step(self) -> None:
        """After the forward: seal this step's batch (in the background with CUDA)."""
        batch, self._pending = self._pending, None
        if batch is None:
            return
        if self._pool is None:
            self._seal(batch)
            return
        self._sealing = [f for f in self._sealing if not f.done()]
        self._sealing.append(self._pool.submit(self._seal, batch))

    def drain(self) -> None:
        """End the step and wait until every batch is sealed and visible."""
        self.end_step()
        for future in self._sealing:
            future.result()
        self._sealing = []

    def close(self) -> None:
        """Drain, then stop the seal thread. Idempotent."""
        self.drain()
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def _seal(self, batch: _Batch) -> None:
        """Wait for the copies, checksum and commit each slot, write spilled blocks through the
        store. Never raises: a failure aborts the slots (a later save may store them again)."""
        keys = [k for k, _ in batch.slotted] + [k for k, _ in batch.spilled]
        written = dropped = 0
        try:
            if batch.event is not None:
                batch.event.synchronize()  # type: ignore[attr-defined]
            hsize = self._headers.size
            for key, view in batch.slotted:
                STEP_LAUNCHES.wait_turn()  # a block at a time, not while a step launches
                if not self._storable(view[hsize:]):
                    self.store.abort_host(key)
                    dropped += 1
                    continue
                seal_block(view, self._total)
                written += self.store.commit_host(key, self._total)
            spilled = [(k, t) for k, t in batch.spilled if self._storable(t)]
            dropped += len(batch.spilled) - len(spilled)
            if spilled:
                items = []
                for k, t in spilled:
                    STEP_LAUNCHES.wait_turn()
                    raw = memoryview(t.contiguous().view(torch.uint8).numpy())
                    items.append((k, encode_block(raw, self.meta, key=k)))
                written += self.store.put_many(items)
        except Exception:
            log.exception("kv save of %d blocks failed", len(keys))
            for key, _ in batch.slotted:
                self.store.abort_host(key)
        finally:
            self.store.complete_store(keys, True)
        self.stats.add(
            saved_blocks=written,
            saved_bytes=written * self.meta.payload_bytes,
            save_seconds=time.perf_counter() - batch.started,
            save_incompressible_blocks=dropped,
        )
