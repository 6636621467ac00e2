"""The connector's worker side: vLLM's per-layer KV tensors <-> kvtier's encoded blocks.

Torch, no vLLM (``connectors.vllm.connector`` adapts it), so it is testable on plain tensors.

- Layout (``KvLayout``): vLLM hands one tensor per attention layer; the block dimension is the
  one of size ``num_blocks`` (dim 0 on CPU, ``[num_blocks, kv_heads, block_size, 2*head]``;
  dim 1 for the ``[2, num_blocks, ...]`` GPU layouts). A stored block is every layer's block,
  ``[num_layers, *one layer's block]`` in that per-layer order, raw (``cachestore.codec``
  with the block's key). The namespace names the layout (``keys.layout_name``).
- Loads (``load``): one batched, pinned ``get_many`` of every key this step loads, copied into
  the jobs' blocks before the forward. A key that misses or fails its checks is a load error:
  its vLLM block id is returned (vLLM recomputes from the first failed block on).
- Saves (``save``): the blocks are copied out of the KV tensors and encoded after the forward
  (they may be reused by the next step), then handed to a background thread that writes them
  to the store (``put_many``: the host tier, then the tiers' write policies). A full queue
  drops the batch (counted); a store failure is a miss later, never an error here.
- ``close``: drain the save queue, ``shutdown_writes`` (write-through queues drained, host
  blocks flushed down), write the stats file, close the store.

Driven by one thread (vLLM's worker), plus the one save thread this class owns.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cachestore.codec import BlockMeta, encode_block
from cachestore.store.hierarchical import HierarchicalStore
from connectors.vllm.metadata import LoadJob, SaveJob, WorkerFeedback
from connectors.vllm.stats import Counters

log = logging.getLogger(__name__)
_STOP = object()


@dataclass(frozen=True)
class KvLayout:
    """vLLM's KV tensors seen block-major: ``views[l][b]`` is layer ``l``'s block ``b``."""

    names: tuple[str, ...]
    views: tuple[torch.Tensor, ...]
    block_shape: tuple[int, ...]  # one layer's block
    dtype: torch.dtype

    @classmethod
    def from_caches(cls, kv_caches: Mapping[str, torch.Tensor], num_blocks: int) -> KvLayout:
        """Raises ValueError when the layers differ or none has a ``num_blocks`` dimension."""
        if not kv_caches:
            raise ValueError("kvtier: vLLM registered no KV cache tensors")
        names, views = [], []
        for name, t in kv_caches.items():
            dims = [d for d in range(min(t.dim(), 2)) if t.shape[d] == num_blocks]
            if not dims:
                raise ValueError(
                    f"kvtier: KV tensor {name} {tuple(t.shape)} has no block "
                    f"dimension of size {num_blocks} among its first two"
                )
            names.append(name)
            views.append(t.movedim(dims[0], 0))
        shapes = {tuple(v.shape[1:]) for v in views}
        dtypes = {v.dtype for v in views}
        if len(shapes) != 1 or len(dtypes) != 1:
            raise ValueError(
                f"kvtier: KV layers differ ({shapes}, {dtypes}); hybrid models are not supported"
            )
        return cls(tuple(names), tuple(views), shapes.pop(), dtypes.pop())

    @property
    def block_numel(self) -> int:
        n = len(self.views)
        for d in self.block_shape:
            n *= d
        return n

    @property
    def block_bytes(self) -> int:
        return self.block_numel * self.dtype.itemsize

    def block_meta(self, namespace_prefix: str, layout: str) -> BlockMeta:
        return BlockMeta(
            dtype=str(self.dtype),
            shape=(len(self.views), *self.block_shape),
            layout=layout,
            namespace=namespace_prefix,
        )

    def gather(self, block_ids: Sequence[int]) -> torch.Tensor:
        """``[n, num_layers, *block_shape]`` on the CPU (a copy)."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.views[0].device)
        out = torch.stack([v.index_select(0, idx) for v in self.views], dim=1)
        return out.cpu()

    def scatter(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """Write ``data`` (``[n, num_layers, *block_shape]``) into the blocks (mutates vLLM's
        KV tensors)."""
        dev = self.views[0].device
        idx = torch.tensor(block_ids, dtype=torch.long, device=dev)
        data = data.to(dev, non_blocking=True)
        for layer, view in enumerate(self.views):
            view.index_copy_(0, idx, data[:, layer])


class VllmWorker:
    def __init__(
        self,
        store: HierarchicalStore,
        layout: KvLayout,
        meta: BlockMeta,
        counters: Counters,
        block_tokens: int,
        *,
        drain_timeout_s: float = 5.0,
        stats_file: str | None = None,
        stats_interval_s: float = 10.0,
        save_queue_batches: int = 64,
    ) -> None:
        """Takes ownership of ``store`` (``close`` closes it)."""
        self.store = store
        self.layout = layout
        self.meta = meta
        self.counters = counters
        self.block_tokens = block_tokens
        self.drain_timeout_s = drain_timeout_s
        self.stats_file = stats_file
        self.stats_interval_s = stats_interval_s
        self._feedback = WorkerFeedback()
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=save_queue_batches)
        self._saver = threading.Thread(target=self._save_loop, name="kvtier-vllm-save", daemon=True)
        self._saver.start()
        self._last_stats = time.monotonic()
        self._closed = False

    # -- loads ---------------------------------------------------------------------------

    def load(self, jobs: Sequence[LoadJob]) -> set[int]:
        """Copy every job's blocks into vLLM's KV tensors; return the block ids that failed."""
        keys = [k for job in jobs for k in job.keys]
        if not keys:
            return set()
        t0 = time.perf_counter()
        before = self._tier_hits()
        failed: set[int] = set()
        # Host hits are views into the slab, valid while pinned for this read (inside).
        with self.store.read_pinned(keys, decoded=True) as values:
            ok_ids, rows = [], []
            nbytes = self.layout.block_bytes
            block_ids = [b for job in jobs for b in job.block_ids]
            for bid, value in zip(block_ids, values, strict=True):
                if value is None or memoryview(value).nbytes != nbytes:
                    failed.add(bid)
                    continue
                ok_ids.append(bid)
                rows.append(value)
            if rows:
                staging = torch.empty((len(rows), nbytes), dtype=torch.uint8)
                flat = staging.numpy()
                for i, row in enumerate(rows):
                    flat[i] = memoryview(row).cast("B")
                data = staging.view(self.layout.dtype).view(
                    len(rows), len(self.layout.views), *self.layout.block_shape
                )
                self.layout.scatter(ok_ids, data)
        seconds = time.perf_counter() - t0
        loaded = len(keys) - len(failed)
        self._count_load(jobs, loaded, failed, seconds, before)
        return failed

    def _count_load(
        self,
        jobs: Sequence[LoadJob],
        loaded: int,
        failed: set[int],
        seconds: float,
        before: dict[str, int],
    ) -> None:
        self.counters.add(
            loaded_tokens=loaded * self.block_tokens,
            load_failed_blocks=len(failed),
            load_seconds=seconds,
        )
        if failed:
            log.warning(
                "kvtier: %d of %d blocks failed to load; vLLM recomputes them",
                len(failed),
                loaded + len(failed),
            )
        served = {
            n: h - before.get(n, 0) for n, h in self._tier_hits().items() if h > before.get(n, 0)
        }
        planned = {t for job in jobs for t in job.tiers}
        if loaded and len(served) == 1 and set(served) == planned:
            self._feedback.transfers.append(
                (planned.pop(), loaded * self.layout.block_bytes, seconds)
            )

    def _tier_hits(self) -> dict[str, int]:
        return {row["name"]: row["hits"] for row in self.store.stats()["tiers"]}

    # -- saves ---------------------------------------------------------------------------

    def save(self, jobs: Sequence[SaveJob]) -> None:
        """Copy the jobs' blocks out now; the store writes them in the background."""
        keys = [k for job in jobs for k in job.keys]
        if not keys:
            return
        t0 = time.perf_counter()
        data = self.layout.gather([b for job in jobs for b in job.block_ids])
        raw = data.contiguous().view(torch.uint8).reshape(len(keys), -1).numpy()
        items = [(key, encode_block(raw[i], self.meta, key=key)) for i, key in enumerate(keys)]
        self.counters.add(save_seconds=time.perf_counter() - t0)
        try:
            self._queue.put_nowait(items)
        except queue.Full:
            self.counters.add(save_dropped_blocks=len(items))

    def _save_loop(self) -> None:
        while True:
            items = self._queue.get()
            try:
                if items is _STOP:
                    return
                written = self.store.put_many(items)
                self.counters.add(saved_blocks=written, save_dropped_blocks=len(items) - written)
            except Exception:  # never kill the thread: a lost save is a later miss
                log.exception("kvtier: saving %d blocks failed", len(items))
                self.counters.add(save_dropped_blocks=len(items))
            finally:
                self._queue.task_done()

    def wait_saves(self) -> None:
        """Block until every queued save reached the store (tests, shutdown)."""
        self._queue.join()

    # -- feedback, stats, lifecycle ------------------------------------------------------

    def record_prefill(self, new_tokens: int, context_tokens: int, seconds: float) -> None:
        self._feedback.prefills.append((new_tokens, context_tokens, seconds))

    def take_feedback(self) -> WorkerFeedback | None:
        fb, self._feedback = self._feedback, WorkerFeedback()
        return fb if fb.transfers or fb.prefills else None

    def maybe_write_stats(self, force: bool = False) -> None:
        """Rewrite the stats file (atomically) every ``stats_interval_s``, or now."""
        if self.stats_file is None:
            return
        now = time.monotonic()
        if not force and now - self._last_stats < self.stats_interval_s:
            return
        self._last_stats = now
        doc = {
            "counters": self.counters.totals(),
            "store": self.store.stats(),
            "namespace": self.meta.namespace,
            "layout": self.meta.layout,
        }
        tmp = f"{self.stats_file}.{os.getpid()}.tmp"
        with open(tmp, "w") as fh:
            json.dump(doc, fh, indent=1, default=str)
        os.replace(tmp, self.stats_file)

    def close(self) -> None:
        """Drain saves and the write policy's queues, write the stats file, close the store.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._queue.put(_STOP)
            self._saver.join(self.drain_timeout_s)
            self.store.shutdown_writes(self.drain_timeout_s)
            self.maybe_write_stats(force=True)
        finally:
            self.store.close()
