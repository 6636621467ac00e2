"""Pipelined lower-tier loads: tier read, pinned staging and the copy into the GPU cache overlap.

A load from a tier below the host (LMDB, Redis, S3, the cache server) that read every block,
then staged them all, then copied them all would take the sum of the three. ``LoadPipeline``
splits the blocks into chunks of ``chunk_blocks`` and runs them through a ring of ``depth``
staging slots (pinned host memory on CUDA): while chunk ``i``'s copy into the cache runs, chunk
``i + 1`` is read into the next slot, so a reload takes about max(read, copy) plus one chunk.
With two slots or more that read runs on a read-ahead thread, started before the load thread
issues chunk ``i``'s copies (which it otherwise did with the readers idle); each chunk's reads
are split over ``readers`` threads (``load_read_threads``).

- The read step is one method, ``read_chunk(keys, rows)``. Given the blocks' ``headers``
  (``HeaderTemplate``; the worker's), the staging rows are whole encoded blocks and the read is
  the store's ``get_many_into``: each tier copies its value straight into the row (LMDB from
  its map), checked there (checksum, key; the header against the template: dtype and shape),
  so a block is copied once on its way to the staging row; the copies into the cache take the
  payload out of each row. These reads promote nothing into the host tier: the store's
  promotion copied each block once more on the reader threads (on the 2-core CPU it doubled
  a 2K-token LMDB reload's load time), and the blocks reach the host tier anyway once the GPU
  frees them (the saves store every block the top tier lacks). Without ``headers``: the
  store's ``read_pinned`` (checksummed; hits promoted into the host tier as usual) and one
  more copy of each payload into its row.
- The copy step: CUDA, ``non_blocking`` copies of runs of consecutive blocks on the worker's
  side stream, bracketed by timing events (the first waits for the load's ``ready`` event: the
  blocks' previous owner's forwards); CPU, the same copies on a copy thread (a plain memcpy
  would otherwise run between the reads, not beside them).
- A staging slot is reused only once its previous copy completed (the load thread waits: never
  the engine thread).

Ownership (``PipeJob``): the load thread issues copies into the request's blocks at any time,
not only at a step start; ``cancel`` (engine thread) stops further copies under the job's lock
and returns the last copy issued, which the engine waits for before the blocks can be reused
(CUDA: the compute stream waits on it; CPU: the copy is waited for). Blocks are leading-only:
the first miss, short value or failed read ends the load there (the rest is recomputed).
Codec-encoded payloads (``compression: lossless``) do not use the pipeline.

Thread-safety: ``run`` on one load thread at a time (the worker's single-thread pool);
``PipeJob.cancel`` and ``PipeJob.progress`` from the engine thread.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from cachestore.codec import HeaderTemplate, encoded_size
from cachestore.hashing import BlockKey
from cachestore.store.hierarchical import HierarchicalStore
from engine.kv_cache import KVCache

log = logging.getLogger(__name__)
READ_THREADS = 8  # reader threads a chunk is split over by default, at most (one per core)


class CpuCopyDone:
    """A CPU copy's completion with a CUDA event's ``query``/``synchronize``."""

    __slots__ = ("_future",)

    def __init__(self, future: cf.Future[float]) -> None:
        self._future = future

    def query(self) -> bool:
        return self._future.done()

    def synchronize(self) -> None:
        self._future.result()


@dataclass(slots=True)
class PipeJob:
    """One load's lower-tier part: ``keys`` into ``block_ids``. Shared by the engine thread
    (``cancel``, ``progress``) and the load thread (``run``), under ``lock``."""

    block_ids: tuple[int, ...]
    keys: tuple[BlockKey, ...]
    ready: object | None = None  # CUDA: recorded on the compute stream when the load began
    lock: threading.Lock = field(default_factory=threading.Lock)
    cancelled: bool = False
    copied: int = 0  # leading blocks whose copy was issued
    last: object | None = None  # the last issued copy's completion (event or CpuCopyDone)

    def cancel(self) -> tuple[int, object | None]:
        """No copy is issued after this returns; (blocks issued, the last copy's completion)."""
        with self.lock:
            self.cancelled = True
            return self.copied, self.last


@dataclass(frozen=True, slots=True)
class PipedLoad:
    """What ``run`` did: ``num_blocks`` leading blocks copied (their last completion ``last``),
    ``read_s`` the reads' wall time, ``cpu_copy_s`` the CPU copies' (CUDA: ``timings``)."""

    num_blocks: int
    read_s: float
    wall_s: float
    last: object | None = None
    cpu_copy_s: float = 0.0
    timings: tuple[tuple[object, object, int], ...] = ()  # CUDA start, end, bytes


class LoadPipeline:
    def __init__(
        self,
        kv_cache: KVCache,
        store: HierarchicalStore,
        side_stream: object | None,
        *,
        chunk_blocks: int,
        depth: int,
        headers: HeaderTemplate | None = None,
        readers: int = 0,
    ) -> None:
        """Raises ValueError unless ``chunk_blocks`` >= 1 and ``depth`` >= 1. The staging ring
        (``depth * chunk_blocks`` blocks) is allocated by the load thread: ``prepare``, or the
        first load.
        ``headers``: the stored blocks' header template; reads go straight into the staging
        rows (module docstring). ``readers``: threads a chunk's reads are split over
        (``pipeline_readers``)."""
        if chunk_blocks < 1 or depth < 1:
            raise ValueError(
                f"load pipeline: chunk_blocks={chunk_blocks} and depth={depth} must be >= 1"
            )
        self.kv_cache = kv_cache
        self.store = store
        self.chunk_blocks = chunk_blocks
        self.depth = depth
        self._side = side_stream
        self._rows = kv_cache.byte_rows()
        self._nbytes = kv_cache.bytes_per_block
        self._headers = headers
        # A staging row: a whole encoded block (header, payload, checksum) read in place, or the
        # payload alone; the payload starts at ``_offset``.
        self._offset = headers.size if headers is not None else 0
        self._row_bytes = (
            encoded_size(headers.meta, keyed=headers.keyed) if headers is not None else self._nbytes
        )
        self._ring: torch.Tensor | None = None
        self._slot_done: list[object | None] = [None] * depth
        self._reader_threads = pipeline_readers(readers)
        self._readers = (
            cf.ThreadPoolExecutor(self._reader_threads, thread_name_prefix="kvtier-load-read")
            if headers is not None and self._reader_threads > 1
            else None
        )
        self._copier = (
            cf.ThreadPoolExecutor(1, thread_name_prefix="kvtier-load-copy")
            if side_stream is None
            else None
        )
        # Read-ahead (two slots or more): chunk i + 1's reads start on this thread before the
        # load thread issues chunk i's copies, so the readers do not idle meanwhile.
        self._ahead = (
            cf.ThreadPoolExecutor(1, thread_name_prefix="kvtier-load-ahead") if depth > 1 else None
        )

    def run(self, job: PipeJob) -> PipedLoad:
        """Load thread: read and copy ``job`` chunk by chunk until done, a miss or a cancel.
        With two slots or more, chunk ``i + 1`` is read (into the next slot, once that slot's
        previous copy completed) while chunk ``i``'s copies are issued. Never raises (a failed
        read ends the load there); returns only once no read writes into the ring."""
        t0 = time.perf_counter()
        read_s = 0.0
        cpu_copy: list[cf.Future[float]] = []
        timings: list[tuple[object, object, int]] = []
        num_chunks = -(-len(job.keys) // self.chunk_blocks)
        ahead: cf.Future[tuple[int, float]] | None = None
        for c in range(num_chunks):
            start = c * self.chunk_blocks
            k, keys, rows = self._chunk(job, c)
            if ahead is not None:  # read while the previous chunk's copies were issued
                n, seconds = ahead.result()
                ahead = None
            else:
                n, seconds = self._read_slot(k, keys, rows)
            read_s += seconds
            if n == len(keys) and self._ahead is not None and c + 1 < num_chunks:
                ahead = self._ahead.submit(self._read_slot, *self._chunk(job, c + 1))
            with job.lock:
                if job.cancelled or n == 0:
                    break
                ids = job.block_ids[start : start + n]
                rows = rows[:, self._offset : self._offset + self._nbytes]  # the payloads
                if self._side is None:
                    future = self._copier.submit(self._copy_cpu, ids, rows[:n])  # type: ignore[union-attr]
                    cpu_copy.append(future)
                    done = CpuCopyDone(future)
                else:
                    begin, done = self._copy_cuda(ids, rows[:n], job.ready)
                    timings.append((begin, done, n * self._nbytes))
                self._slot_done[k] = done
                job.copied, job.last = start + n, done
            if n < len(keys):
                break
        if ahead is not None:  # the load ended early: its read-ahead must not outlive it
            ahead.result()
        with job.lock:
            copied, last = job.copied, job.last
        # A CPU copy's wall time is known once it ran; wait for ours here, off the engine thread.
        cpu_s = sum(f.result() for f in cpu_copy)
        return PipedLoad(copied, read_s, time.perf_counter() - t0, last, cpu_s, tuple(timings))

    def _chunk(self, job: PipeJob, c: int) -> tuple[int, tuple[BlockKey, ...], torch.Tensor]:
        """``job``'s chunk ``c``: its ring slot, its keys and that slot's staging rows."""
        k = c % self.depth
        start = c * self.chunk_blocks
        rows = self._staging()[k * self.chunk_blocks : (k + 1) * self.chunk_blocks]
        return k, job.keys[start : start + self.chunk_blocks], rows

    def _read_slot(
        self, k: int, keys: tuple[BlockKey, ...], rows: torch.Tensor
    ) -> tuple[int, float]:
        """Slot ``k``'s previous copy waited for, then ``keys`` read into ``rows`` (a slot of
        the ring): (leading blocks read, seconds reading). Never raises: a failed read is 0."""
        done = self._slot_done[k]
        if done is not None:  # the slot's previous copy must have read it
            done.synchronize()  # type: ignore[attr-defined]
        t1 = time.perf_counter()
        try:
            n = self.read_chunk(keys, rows)
        except Exception:
            log.exception("kv read of %d blocks failed", len(keys))
            n = 0
        return n, time.perf_counter() - t1

    def read_chunk(self, keys: tuple[BlockKey, ...], rows: torch.Tensor) -> int:
        """THE read step: ``keys`` into ``rows`` (uint8 staging, one row per key: whole encoded
        blocks when the rows are that wide and ``headers`` were given, else
        ``[len(keys), bytes_per_block]`` payloads); how many leading keys were read (a miss, a
        short value or another layout ends it)."""
        if self._headers is not None and rows.shape[1] == self._row_bytes:
            return self._read_encoded(keys, rows)
        with self.store.read_pinned(keys, decoded=True) as values:
            out = rows.numpy()
            for i, value in enumerate(values):
                if value is None or len(value) != self._nbytes:
                    return i
                out[i] = np.frombuffer(value, dtype=np.uint8)
            return len(values)

    def _read_encoded(self, keys: tuple[BlockKey, ...], rows: torch.Tensor) -> int:
        out = rows.numpy()
        bufs = [out[i] for i in range(len(keys))]
        # Parts of the chunk on reader threads: a tier's copy into the row (LMDB's
        # ``copy_into``, numpy) and the checksum (xxh3) release the GIL, so the reads add up
        # across cores instead of one core's memcpy rate bounding the load.
        step = -(-len(keys) // self._reader_threads)
        if self._readers is None or step >= len(keys):
            lengths = self.store.get_many_into(keys, bufs, promote=False)
        else:
            parts = [
                self._readers.submit(
                    self.store.get_many_into, keys[i : i + step], bufs[i : i + step], promote=False
                )
                for i in range(0, len(keys), step)
            ]
            lengths = [n for part in parts for n in part.result()]
        head = self._offset
        for i, (key, n) in enumerate(zip(keys, lengths, strict=True)):
            # the store checked checksum, namespace and key; the template checks the layout
            if n != self._row_bytes or out[i, :head].tobytes() != self._headers.for_key(key):  # type: ignore[union-attr]
                return i
        return len(keys)

    def close(self) -> None:
        """Stop the CPU copy thread (after its copies). Idempotent."""
        if self._copier is not None:
            self._copier.shutdown(wait=True)
        if self._readers is not None:
            self._readers.shutdown(wait=True)
        if self._ahead is not None:
            self._ahead.shutdown(wait=True)

    # -- copies ------------------------------------------------------------------------

    def prepare(self) -> None:
        """Allocate the staging ring now, its pages touched (pinned memory is resident once
        allocated; pageable is zeroed), so the first load does not pay for it. For the load
        thread, before its first ``run``."""
        ring = self._staging()
        if not ring.is_pinned():
            ring.zero_()

    def _staging(self) -> torch.Tensor:
        if self._ring is None:
            self._ring = torch.empty(
                (self.depth * self.chunk_blocks, self._row_bytes),
                dtype=torch.uint8,
                pin_memory=self._side is not None,
            )
        return self._ring

    def _copy_cpu(self, ids: tuple[int, ...], rows: torch.Tensor) -> float:
        t0 = time.perf_counter()
        for dst, src, n in _runs(ids):
            self._rows[dst : dst + n].copy_(rows[src : src + n])
        return time.perf_counter() - t0

    def _copy_cuda(
        self, ids: tuple[int, ...], rows: torch.Tensor, ready: object | None
    ) -> tuple[object, object]:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self._side):  # type: ignore[arg-type]
            if ready is not None:  # the blocks' previous owner's forwards wrote them first
                self._side.wait_event(ready)  # type: ignore[attr-defined]
            begin.record(self._side)  # type: ignore[arg-type]
            if rows.is_contiguous():
                for dst, src, n in _runs(ids):
                    self._rows[dst : dst + n].copy_(rows[src : src + n], non_blocking=True)
            else:  # payloads inside encoded rows: one contiguous copy each (a strided
                for j, dst in enumerate(ids):  # host source would be gathered unpinned first)
                    self._rows[dst].copy_(rows[j], non_blocking=True)
            end.record(self._side)  # type: ignore[arg-type]
        return begin, end


def _runs(ids: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(first block id, first staging row, length) of each run of consecutive block ids."""
    out: list[tuple[int, int, int]] = []
    for i, b in enumerate(ids):
        if out and out[-1][0] + out[-1][2] == b:
            d, s, n = out[-1]
            out[-1] = (d, s, n + 1)
        else:
            out.append((b, i, 1))
    return out


def pipeline_readers(requested: int = 0) -> int:
    """Reader threads a chunk is split over: ``requested`` (``load_read_threads``), or for 0
    one per core, at most ``READ_THREADS``."""
    if requested > 0:
        return requested
    return max(1, min(READ_THREADS, os.cpu_count() or 1))


def chunk_blocks_for(chunk_bytes: int, bytes_per_block: int) -> int:
    """Blocks per chunk for ``chunk_bytes`` (at least one); 0 bytes: the pipeline is off (0)."""
    return 0 if chunk_bytes <= 0 else max(1, chunk_bytes // bytes_per_block)
