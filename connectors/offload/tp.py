"""The offload connector under tensor parallelism, and KV blocks stored as head slices.

Keys (docs/tp.md): a stored object holds KV heads ``[lo, hi)`` of one block, and its key says
so: ``<store prefix>.h<lo>-<hi>/<chain hash>`` (``Namespace.kv_heads``). The chain hash does not
depend on the TP degree, so an engine at any degree finds the slices another degree stored as
long as both store the same granularity: ``kv_head_group`` heads per object (0: one object per
rank's slice). A rank holding several groups keeps one worker per group, each over a *shadow*
cache of that group's heads (one more copy of the KV pool, host-side on CPU): saved blocks are
copied into the shadows at the step start, loaded ones out of them once every group landed.

What runs where:
- rank 0 (``TPOffloadConnector``): the scheduler side decides with rank 0's first group's keys
  (presence as rank 0's store sees it); its workers save and load rank 0's groups.
- every other rank (``RankConnector``, built by ``create_rank_connector`` from what rank 0
  sends): its own store (its own host slab, the lower tiers shared) and a worker per group,
  renaming each key to its group's prefix.
- Capacities are the machine's: each rank's host slab is ``1/size`` of the config's
  (``tiers.config.process_share``), as its slices are ``1/size`` of a block; the LMDB
  directory the ranks share counts all their bytes against its capacity (``tiers.lmdb``).
- A load counts once every rank and group finished it, as the fewest blocks any of them
  loaded (``LoadMerger``): a block is present only when all its slices are. Host loads are
  asynchronous here (no in-step loads: their slab offsets are rank 0's), and no prefetch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from cachestore.hashing import Namespace
from connectors.device.kv_compress import Hi4Codec
from connectors.offload.config import ConfigError, OffloadConfig
from connectors.offload.metadata import BlockSave, KVConnectorMetadata, LoadResult, WorkerReport
from connectors.offload.worker import OffloadWorker, block_meta
from engine.core_types import KVConnectorOutput
from engine.kv_cache import KVCache
from engine.kv_connector import CalibrationTarget
from tiers.config import process_share

# The idle save (``save_pending``) as every rank runs it: copies issued, seals not waited for.
SAVE_SOON = "save_soon"


def head_groups(total: int, rank: int, size: int, group: int) -> list[tuple[int, int]]:
    """The head ranges rank ``rank`` of ``size`` stores, ``group`` heads each (0: its whole
    slice). Raises ConfigError when ``group`` does not divide a rank's heads."""
    per = total // size
    g = group or per
    if per % g:
        raise ConfigError(
            f"kv offload: kv_head_group {group} does not divide the {per} KV heads a rank holds"
        )
    return [(h, h + g) for h in range(rank * per, (rank + 1) * per, g)]


def slice_namespace(namespace: Namespace, heads: tuple[int, int], total: int) -> Namespace:
    """``namespace`` for objects holding ``heads`` (all ``total`` heads: no range)."""
    return dataclasses.replace(namespace, kv_heads=None if heads == (0, total) else heads)


class LoadMerger:
    """Joins ``parts`` reports of the same loads (ranks, head groups): a load is finished once
    every part finished it, with the fewest leading blocks any part loaded."""

    def __init__(self, parts: int) -> None:
        self._parts = parts
        self._seen: dict[str, dict[int, LoadResult]] = {}

    def forget(self, req_ids: Iterable[str]) -> None:
        """Drop partial results (a cancelled load, or a new load of the same request)."""
        for req_id in req_ids:
            self._seen.pop(req_id, None)

    def merge(self, reports: Sequence[Iterable[LoadResult]]) -> tuple[LoadResult, ...]:
        done: list[LoadResult] = []
        for part, results in enumerate(reports):
            for r in results:
                got = self._seen.setdefault(r.req_id, {})
                got[part] = r
                if len(got) < self._parts:
                    continue
                del self._seen[r.req_id]
                rs = list(got.values())
                done.append(
                    LoadResult(
                        r.req_id,
                        min(x.num_loaded_blocks for x in rs),
                        r.num_requested_blocks,
                        max(x.seconds for x in rs),
                        max(x.copy_s for x in rs),
                        max(x.read_s for x in rs),
                        all(x.in_step for x in rs),
                    )
                )
        return tuple(done)


class GroupedWorker:
    """One rank's worker side (``KVConnectorWorker``): a worker per head group, keys renamed
    from the scheduler's prefix (``base``) to each group's. Engine thread only."""

    layered_loads = False
    load_stages = 1

    def __init__(
        self,
        kv_cache: KVCache,
        workers: list[OffloadWorker],
        base: str,
        prefixes: list[str],
        shadows: list[KVCache] | None,
    ) -> None:
        self.kv_cache = kv_cache
        self.workers = workers
        self._base = base
        self._prefixes = prefixes
        self._shadows = shadows
        self._groups = LoadMerger(len(workers))
        self._ranks: LoadMerger | None = None  # rank 0 under TP: ``add_ranks``
        self.mergers: list[LoadMerger] = [self._groups]
        self._targets: dict[str, tuple[int, ...]] = {}  # req_id -> its load's blocks

    def _rename(self, key: str, g: int) -> str:
        return (
            key if self._prefixes[g] == self._base else self._prefixes[g] + key[len(self._base) :]
        )

    def _saves(self, saves: tuple[BlockSave, ...], g: int) -> tuple[BlockSave, ...]:
        return tuple(BlockSave(s.block_id, self._rename(s.key, g)) for s in saves)

    def _meta(self, meta: KVConnectorMetadata, g: int) -> KVConnectorMetadata:
        if self._prefixes[g] == self._base:
            return meta
        loads = tuple(
            dataclasses.replace(x, keys=tuple(self._rename(k, g) for k in x.keys))
            for x in meta.loads
        )
        return dataclasses.replace(meta, saves=self._saves(meta.saves, g), loads=loads)

    def start_load_kv(self, metadata: object | None) -> None:
        if isinstance(metadata, KVConnectorMetadata):
            gone = set(metadata.cancelled_loads) | {x.req_id for x in metadata.loads}
            for merger in self.mergers:
                merger.forget(gone)
            for req_id in metadata.cancelled_loads:
                self._targets.pop(req_id, None)
            self._targets.update((x.req_id, x.block_ids) for x in metadata.loads)
            self._to_shadows([s.block_id for s in metadata.saves])
        for g, worker in enumerate(self.workers):
            worker.start_load_kv(
                self._meta(metadata, g) if isinstance(metadata, KVConnectorMetadata) else metadata
            )

    def forward_queued(self) -> None:
        for worker in self.workers:
            worker.forward_queued()

    def wait_for_save(self) -> None:
        for worker in self.workers:
            worker.wait_for_save()

    def after_step(self, metadata: object | None) -> KVConnectorOutput:
        """This rank's report (``take_report``): rank 0's joins the others' (``join_ranks``)."""
        return self.take_report().as_output()

    def add_ranks(self, size: int) -> None:
        """Rank 0 of ``size`` ranks: ``join_ranks`` merges every rank's report."""
        self._ranks = LoadMerger(size)
        self.mergers.append(self._ranks)

    def join_ranks(self, outputs: Sequence[KVConnectorOutput | None]) -> KVConnectorOutput:
        """Every rank's report of one step (rank order): a load counts once every rank
        finished it, as the fewest blocks any of them loaded."""
        if self._ranks is None:
            raise RuntimeError("join_ranks on a worker that was not given its ranks (add_ranks)")
        parts = [o.report if o is not None else None for o in outputs]
        merged = self._ranks.merge(
            [r.finished_loads if isinstance(r, WorkerReport) else () for r in parts]
        )
        return WorkerReport(finished_loads=merged).as_output()

    def take_report(self) -> WorkerReport:
        """This rank's finished loads (every group landed; shadows copied into the cache)."""
        merged = self._groups.merge([w.take_report().finished_loads for w in self.workers])
        for r in merged:
            ids = self._targets.pop(r.req_id, ())[: r.num_loaded_blocks]
            self._from_shadows(list(ids))
        return WorkerReport(finished_loads=merged)

    def save_now(self, saves: tuple[BlockSave, ...], wait: bool = True) -> None:
        self._to_shadows([s.block_id for s in saves])
        for g, worker in enumerate(self.workers):
            worker.save_now(self._saves(saves, g), wait)

    def close(self) -> None:
        for worker in self.workers:
            worker.close()

    def _to_shadows(self, ids: list[int]) -> None:
        if self._shadows is None or not ids:
            return
        idx = torch.as_tensor(ids, dtype=torch.long, device=self.kv_cache.device)
        src = self.kv_cache.tensor.index_select(0, idx)  # [n, layers, 2, bs, heads, dim]
        width = self._shadows[0].spec.num_kv_heads
        for g, shadow in enumerate(self._shadows):
            shadow.tensor[idx] = src[:, :, :, :, g * width : (g + 1) * width]

    def _from_shadows(self, ids: list[int]) -> None:
        if self._shadows is None or not ids:
            return
        idx = torch.as_tensor(ids, dtype=torch.long, device=self.kv_cache.device)
        width = self._shadows[0].spec.num_kv_heads
        for g, shadow in enumerate(self._shadows):
            self.kv_cache.tensor[idx, :, :, :, g * width : (g + 1) * width] = shadow.tensor[idx]


def _codec(config: OffloadConfig, cache: KVCache) -> Hi4Codec | None:
    if config.compression != "lossless":
        return None
    codec = Hi4Codec.for_cache(cache)
    codec.warm(cache.device)  # the first reload must not pay the kernels' compilation
    return codec


def _stored_namespace(namespace: Namespace, codec: Hi4Codec | None) -> Namespace:
    # As OffloadConnector's: compressed blocks live under a prefix of their own.
    return namespace if codec is None else dataclasses.replace(namespace, kv_format=codec.name)


def _build(
    cls: Any,
    config: OffloadConfig,
    kv_cache: KVCache,
    namespace: Namespace,
    calibration: CalibrationTarget | None,
    rank: int,
    size: int,
    total: int,
) -> tuple[Any, GroupedWorker]:
    """Rank ``rank``'s connector: its store, its scheduler side (used on rank 0 only) and
    a worker per head group."""
    groups = head_groups(total, rank, size, config.kv_head_group)
    width = groups[0][1] - groups[0][0]
    shadows = None
    if len(groups) > 1:
        spec = dataclasses.replace(kv_cache.spec, num_kv_heads=width)
        shadows = [KVCache(spec, kv_cache.num_blocks, kv_cache.device) for _ in groups]
    caches = shadows or [kv_cache]
    inner = cls.create(
        config, caches[0], slice_namespace(namespace, groups[0], total), calibration=calibration
    )
    codec = _codec(config, caches[0])
    workers = [inner.worker]
    for cache in caches[1:]:
        meta = block_meta(cache, _stored_namespace(namespace, codec).store_prefix(), codec)
        workers.append(
            OffloadWorker(
                cache,
                inner.store,
                meta,
                load_timeout_s=config.load_timeout_s,
                stats=inner.counters,
                cost_model=inner.cost_model,
                coalesced_loads=config.coalesced_loads,
                codec=_codec(config, cache),
                load_chunk_bytes=config.load_chunk_bytes,
                load_pipeline_depth=config.load_pipeline_depth,
                load_read_threads=config.load_read_threads,
                hold_async_copies=config.async_copies_after_forward,
            )
        )
    first = head_groups(total, 0, size, config.kv_head_group)[0]
    base = _stored_namespace(slice_namespace(namespace, first, total), codec).key_prefix()
    prefixes = [
        _stored_namespace(slice_namespace(namespace, g, total), codec).key_prefix() for g in groups
    ]
    grouped = GroupedWorker(kv_cache, workers, base, prefixes, shadows)
    inner.worker = grouped  # type: ignore[assignment]
    # A block costs a rank all its groups' objects: price the bytes of its whole slice (the
    # ranks read in parallel; the reads of one rank are batched, so one latency per run).
    inner.cost_model.block_bytes = kv_cache.bytes_per_block
    return inner, grouped


def _tp_config(config: OffloadConfig, rank: int, size: int) -> OffloadConfig:
    """Rank ``rank``'s config: its share of the machine's host memory
    (``tiers.config.process_share``: each rank holds its own slices, so the machine holds
    what the file says); only rank 0 calibrates (its prefills run on every rank)."""
    return dataclasses.replace(
        config,
        tiers=process_share(config.tiers, size),
        in_step_host_loads=False,
        prefetch=False,
        calibrate=config.calibrate and rank == 0,
    )


class TPOffloadConnector:
    """Rank 0's connector (``engine.kv_connector.KVConnector``): the inner connector's
    scheduler side, store, stats; its between-step calls run on every rank."""

    def __init__(self, inner: Any, grouped: GroupedWorker, tp: Any) -> None:
        self.inner = inner
        self._tp = tp
        if tp is not None:  # the driver hands every rank's report to ``join_ranks``
            grouped.add_ranks(tp.size)
        self._closed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["inner"], name)

    def _everywhere(self, what: str) -> tuple[BlockSave, ...]:
        saves = self.inner.scheduler.take_pending_saves()
        if self._tp is not None:
            self._tp.command("offload_call", (what, saves))
        self.inner.worker.save_now(saves, wait=what != SAVE_SOON)
        return saves

    def save_pending(self) -> None:
        self._everywhere(SAVE_SOON)

    def flush(self) -> None:
        self._everywhere("flush")
        self.inner.store.flush(self.inner.config.drain_timeout_s)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._everywhere("close")
        finally:
            self.inner.close()


class RankConnector:
    """A rank's share other than rank 0's: its worker and store, driven by rank 0."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.worker = inner.worker

    def call(self, what: str, saves: tuple[BlockSave, ...]) -> None:
        self.worker.save_now(saves, wait=what != SAVE_SOON)
        if what == "flush":
            self.inner.store.flush(self.inner.config.drain_timeout_s)
        elif what == "close":
            self.inner.close()

    def close(self) -> None:
        self.inner.close()  # idempotent


def create_tp_connector(
    cls: Any,
    config: OffloadConfig,
    kv_cache: KVCache,
    namespace: Namespace,
    calibration: CalibrationTarget | None,
    tp: Any,
) -> TPOffloadConnector:
    """Rank 0's connector, ``cls`` (``OffloadConnector``) per head group's store; with
    ``tp`` (the engine's driver), every other rank builds its share first
    (``create_rank_connector``)."""
    size = tp.size if tp is not None else 1
    total = kv_cache.spec.num_kv_heads * size
    head_groups(total, 0, size, config.kv_head_group)  # a bad granularity: before any rank
    if tp is not None:
        tp.command("offload", ("offload", (config, namespace, total)))
        tp.offload_ranks = True
    inner, grouped = _build(
        cls, _tp_config(config, 0, size), kv_cache, namespace, calibration, 0, size, total
    )
    return TPOffloadConnector(inner, grouped, tp)


def create_rank_connector(
    cls: Any, spec: tuple[OffloadConfig, Namespace, int], kv_cache: KVCache, rank: int, size: int
) -> RankConnector:
    config, namespace, total = spec
    inner, _ = _build(
        cls, _tp_config(config, rank, size), kv_cache, namespace, None, rank, size, total
    )
    return RankConnector(inner)
