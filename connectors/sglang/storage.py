"""``KvtierHiCacheStorage``: kvtier's tiers as SGLang's HiCache storage backend ("L3").

SGLang builds it through its ``StorageBackendFactory`` (``--hicache-storage-backend dynamic``
with ``module_path: connectors.sglang`` and ``class_name: KvtierHiCacheStorage``; docs/sglang.md),
then registers its host KV pool. The store is built then, once the page layout is known: a
``HierarchicalStore`` over the YAML's tiers (host, LMDB, Redis, S3, the cache server) with
their write policies; its namespace (``keys``) carries the model, page size, layout, TP rank
and size (MLA: shared by all ranks) and pipeline / context-parallel shard.

- Pages are stored as kvtier's keyed, checksummed blocks (``cachestore.codec``, version 2):
  the header names the namespace, layout and key, so a corrupt page, another key's page or a
  page of another layout is a miss (and SGLang recomputes), never data in the pool.
- Zero-copy interface (``"interface_v1": 1``: ``batch_get_v1`` / ``batch_set_v1``): SGLang
  hands host indices; the backend reads and writes the pool's memory in place through its
  page pointers (``pages.HostPages``). A read lands in a per-thread staging buffer (the
  checksum covers the whole block) and is copied once into the pool; a write is encoded
  straight from the pool into the block the store keeps.
- Generic interface (``get``/``set``/``batch_get``/``batch_set``): flat page tensors.
- ``batch_exists``: how many leading pages some tier holds (``HierarchicalStore.lookup``).
- Writes skip the leading pages already stored; a tier failure is a miss or a failed write
  (False), never an exception to SGLang. ``clear`` deletes nothing (the tiers may be shared).
- Metrics: ``get_stats`` returns SGLang's ``StorageMetrics`` fields (pages and GB/s a call);
  ``stats()`` the backend's counters and the store's per-tier counters.

Thread-safe as SGLang uses it (prefetch and backup threads at once): the store is, the
staging buffers are per thread. This module is the only one of kvtier importing SGLang.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from cachestore.codec import (
    CHECKSUM_BYTES,
    DTYPE_ITEMSIZE,
    PAYLOAD_ALIGN,
    BlockMeta,
    HeaderTemplate,
    encoded_size,
    seal_block,
)
from cachestore.store.hierarchical import HierarchicalStore, StoreConfig
from cachestore.store.types import write_policies
from connectors.sglang.config import parse_storage_config
from connectors.sglang.keys import make_namespace, page_key, shard_name
from connectors.sglang.pages import HostPages, copy_in, copy_out
from connectors.sglang.stats import Counters, StorageWindow
from tiers import build_tiers
from tiers.config import ConfigError

log = logging.getLogger(__name__)
Sink = Callable[[int, memoryview], None]  # (page number in the call, payload)


class KvtierHiCacheStorage(HiCacheStorage):
    def __init__(
        self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None
    ) -> None:
        """Parses the extra config (ConfigError, one line); builds nothing until SGLang
        registers its host pool (``register_mem_pool_host``)."""
        self.storage_config = storage_config
        self.config = parse_storage_config(storage_config.extra_config)
        self.counters = Counters()
        self.store: HierarchicalStore | None = None
        self.pages: HostPages | None = None
        self._local = threading.local()
        self._closed = False

    # -- set-up --------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Build the store for this pool's page layout (once; a second pool of the same
        layout is accepted, of another layout raises ValueError)."""
        super().register_mem_pool_host(mem_pool_host)
        cfg = self.storage_config
        shard = shard_name(
            cfg.pp_rank, cfg.pp_size, cfg.attn_cp_rank, cfg.attn_cp_size, cfg.dcp_rank, cfg.dcp_size
        )
        pages = HostPages(mem_pool_host, cfg.is_mla_model, shard)
        if self.store is not None:
            if self.pages is not None and pages.layout != self.pages.layout:
                raise ValueError(
                    f"kvtier: a second host pool of layout {pages.layout}; "
                    f"the store holds {self.pages.layout}"
                )
            self.pages = pages
            return
        model = self.config.model_fingerprint or cfg.model_name
        if not model:
            raise ConfigError(
                "kvtier SGLang backend: SGLang gave no model name; set "
                "'model_fingerprint' in the extra config"
            )
        self.namespace = make_namespace(
            model, pages.layout, pages.page_size, cfg.tp_rank, cfg.tp_size, cfg.is_mla_model
        )
        prefix = self.namespace.key_prefix()
        itemsize = DTYPE_ITEMSIZE.get(pages.dtype, 0)
        dtype = pages.dtype if itemsize and pages.page_bytes % itemsize == 0 else "uint8"
        self.meta = BlockMeta(
            dtype=dtype,
            shape=(pages.page_bytes // DTYPE_ITEMSIZE[dtype],),
            layout=pages.layout,
            namespace=prefix,
        )
        self._template = HeaderTemplate(self.meta, keyed=True)
        self._block_bytes = encoded_size(self.meta, keyed=True)
        slot = -(-self._block_bytes // PAYLOAD_ALIGN) * PAYLOAD_ALIGN
        stack = self.config.offload.tiers
        self.store = HierarchicalStore(
            build_tiers(stack, host_slot_bytes=slot),
            StoreConfig(
                namespace=prefix,
                write_policies=write_policies(stack),
                probe_interval_s=self.config.offload.health_probe_s,
            ),
        )
        self.pages = pages
        self.counters.page_gb = pages.page_bytes / 1e9
        log.info(
            "kvtier SGLang backend: namespace %s (%s), page %d B, tiers %s",
            prefix,
            self.namespace.describe(),
            pages.page_bytes,
            [t.name for t in self.store.tiers],
        )

    def _keys(self, keys: Sequence[str]) -> list[str]:
        if self.store is None:
            raise RuntimeError("kvtier: SGLang has not registered its host pool yet")
        prefix = self.namespace.key_prefix()
        return [page_key(prefix, k) for k in keys]

    # -- existence -------------------------------------------------------------------------

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many leading pages of ``keys`` some tier holds. Never raises for tiers."""
        if not keys:
            return 0
        skeys = self._keys(keys)
        assert self.store is not None
        found = len(self.store.lookup(skeys).served_by)
        self.counters.add(exists_pages=len(keys), exists_hits=found)
        return found

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- zero-copy interface (interface_v1) -------------------------------------------------

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Read pages into the host pool at ``host_indices`` (``page_size`` a page); per
        page, whether it was read (a miss leaves its slots undefined)."""
        self._keys(keys)
        assert self.pages is not None
        views = self.pages.views(host_indices)
        return self._read(keys, lambda i, payload: copy_in(views[i], payload))

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Write the host pool's pages at ``host_indices``; per page, whether it is stored."""
        self._keys(keys)
        assert self.pages is not None
        views = self.pages.views(host_indices)
        return self._write(keys, lambda i, out: copy_out(views[i], out))

    # -- generic interface (flat page tensors) ---------------------------------------------

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Read each page into ``target_locations[i]`` (a contiguous tensor of one page, as
        ``get_dummy_flat_data_page``; None: a new uint8 tensor). None for a miss."""
        self._keys(keys)
        assert self.pages is not None
        nbytes = self.pages.page_bytes
        targets = list(target_locations or [None] * len(keys))
        for i, t in enumerate(targets):
            if t is None:
                targets[i] = torch.empty(nbytes, dtype=torch.uint8)
            elif not t.is_contiguous() or t.numel() * t.element_size() != nbytes:
                raise ValueError(
                    f"kvtier: target tensor {tuple(t.shape)} {t.dtype} is not "
                    f"one contiguous {nbytes}-byte page"
                )
        dst = [memoryview(t.view(-1).view(torch.uint8).numpy()) for t in targets]

        def sink(i: int, payload: memoryview) -> None:
            dst[i][:] = payload

        ok = self._read(keys, sink)
        return [t if hit else None for t, hit in zip(targets, ok, strict=True)]

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Write flat page tensors; True when every page is stored."""
        if not keys:
            return False
        self._keys(keys)
        src = [memoryview(v.contiguous().view(-1).view(torch.uint8).numpy()) for v in values]

        def fill(i: int, out: memoryview) -> None:
            if src[i].nbytes != out.nbytes:
                raise ValueError(
                    f"kvtier: page tensor of {src[i].nbytes} bytes, the layout needs {out.nbytes}"
                )
            out[:] = src[i]

        return all(self._write(keys, fill))

    # -- the two paths under both interfaces -----------------------------------------------

    def _staging(self, num_pages: int) -> memoryview:
        need = num_pages * self._block_bytes
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < need:
            buf = self._local.buf = bytearray(need)
        return memoryview(buf)

    def _read(self, keys: Sequence[str], sink: Sink) -> list[bool]:
        assert self.store is not None
        t0 = time.perf_counter()
        skeys = self._keys(keys)
        size, head = self._block_bytes, self._template.size
        chunk = max(1, self.config.staging_bytes // size)
        ok = [False] * len(keys)
        bad = 0
        for start in range(0, len(keys), chunk):
            part = skeys[start : start + chunk]
            staging = self._staging(len(part))
            bufs = [staging[j * size : (j + 1) * size] for j in range(len(part))]
            for j, n in enumerate(self.store.get_many_into(part, bufs)):
                if n is None:
                    continue
                buf = bufs[j]
                if n != size or buf[:head] != self._template.for_key(part[j]):
                    bad += 1  # checksummed, but not this layout: a miss
                    continue
                sink(start + j, buf[head : size - CHECKSUM_BYTES])
                ok[start + j] = True
        hits = sum(ok)
        seconds = time.perf_counter() - t0
        self.counters.add(
            get_pages=len(keys),
            get_hits=hits,
            get_misses=len(keys) - hits,
            get_bad_layout=bad,
            get_bytes=hits * self.meta.payload_bytes,
            get_seconds=seconds,
        )
        self.counters.record(False, hits, seconds)
        return ok

    def _write(self, keys: Sequence[str], fill: Sink) -> list[bool]:
        """Skip the leading pages some tier holds; encode the rest from ``fill`` into blocks
        the store keeps (its write-through queues hold them); per page, stored or not."""
        assert self.store is not None
        t0 = time.perf_counter()
        skeys = self._keys(keys)
        present = len(self.store.lookup(skeys).served_by)
        size, head = self._block_bytes, self._template.size
        items: list[tuple[str, memoryview]] = []
        for i in range(present, len(skeys)):
            block = bytearray(size)
            block[:head] = self._template.for_key(skeys[i])
            view = memoryview(block)
            fill(i, view[head : size - CHECKSUM_BYTES])
            seal_block(view, size)
            items.append((skeys[i], view))
        written = self.store.put_many(items) if items else 0
        stored = written > 0 or not items
        seconds = time.perf_counter() - t0
        self.counters.add(
            set_pages=len(keys),
            set_present=present,
            set_written=written,
            set_failed=0 if stored else len(items),
            set_bytes=written * self.meta.payload_bytes,
            set_seconds=seconds,
        )
        self.counters.record(True, len(items) if stored else 0, seconds)
        return [True] * present + [stored] * len(items)

    # -- lifecycle and metrics ---------------------------------------------------------------

    def clear(self) -> bool:
        """Deletes nothing: the tiers may hold other engines' and instances' pages."""
        log.warning("kvtier SGLang backend: clear() leaves kvtier's tiers as they are")
        return False

    def get_stats(self) -> StorageWindow:
        """SGLang's ``StorageMetrics`` fields for the calls since the last ``get_stats``
        (pages and GB/s of each read and write call)."""
        return self.counters.take_window()

    def stats(self) -> dict[str, Any]:
        """The backend's counters, and the store's per-tier counters once built."""
        out: dict[str, Any] = {"counters": self.counters.totals()}
        if self.store is not None:
            out.update(
                namespace=self.namespace.key_prefix(),
                layout=self.meta.layout,
                store=self.store.stats(),
            )
        return out

    def close(self) -> None:
        """Drain the write-through queues, write the stats file, close the tiers.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.store is None:
            return
        self.store.shutdown_writes(self.config.offload.drain_timeout_s)
        if self.config.stats_file:
            tmp = f"{self.config.stats_file}.tmp"
            with open(tmp, "w") as f:
                json.dump(self.stats(), f, indent=1, default=str)
            os.replace(tmp, self.config.stats_file)
        self.store.close()
