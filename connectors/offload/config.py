"""Configuration of the KV offload connector: the tier stack plus the connector's own knobs.

One YAML file (or the same dict) holds both::

    decision: cost          # cost | load | recompute | overlap (forced Cake split)
    load_timeout_s: 5.0     # a load still running after this falls back to recompute
    calibrate: true         # measure prefill and tier speeds at start-up (13 s for SmolLM2-135M on 2 CPU cores)
    in_step_host_loads: true  # host-tier hits load in the admitting step (false: async, +1 step)
    in_step_loads_per_step: 0  # at most this many in-step loads a step (0, the default: no
                               # limit); past it a host hit loads async and computes a step later
    async_copies_after_forward: false  # CUDA: an async load's host copies wait until the
                               # step's forward is queued (false, the default: issued before it,
                               # behind the step's input uploads)
    layered_loads: auto     # CUDA: in-step loads land layer by layer under the forward
                            # (auto: on, as true; false: whole blocks)
    layers_per_copy: 0      # layer-wise loads: layers a copy moves (0: automatic)
    load_issue_ahead: 0     # layer-wise raw loads: 0 issues every group's copies before the
                            # forward; N > 0 issues each group as the forward reaches N layers
                            # before it (a short driver queue; not yet measured on a GPU)
    coalesced_loads: false  # host loads copy runs of consecutive slots whole (one copy a run)
    load_chunk_bytes: 64MiB  # lower-tier loads: read and copy overlap in chunks this big
                                # (0: read all, then copy all)
    load_pipeline_depth: 2  # staging slots of that pipeline (chunks in flight)
    load_read_threads: 0    # reader threads a chunk is split over (0: one per core, at most 8)
    compression: none       # lossless: bf16/fp16 blocks stored in 12 bits a value (kv_compress)
    drain_timeout_s: 5.0    # shutdown: time to drain write-through queues, then as much to
                            # flush host-only blocks down to the tier below the host
    health_probe_s: 5.0     # ping a tier nothing used for this long (0: never): /health
    prefetch: true          # blocks below the host tier move up while their request waits
    prefetch_budget_blocks: 0  # blocks prefetches may pin at once (0: a quarter of the host tier)
    placement: all          # all | worth_loading: skip demoting into tiers no prefix would
                            # ever be worth loading from (cachestore/cost/placement.py)
    kv_head_group: 0        # KV heads per stored object (0: a TP rank's slice); engines at
                            # two TP degrees share blocks when both store e.g. 1 (docs/tp.md)
    tiers:
      - {kind: host, capacity: 4GiB}
      - {kind: lmdb, path: /var/cache/kvtier, capacity: 100GiB, write_policy: write_through}

``tiers`` is exactly ``tiers.config``'s format. Without a config, ``kv_offload=True``
uses ``default_offload_config``: a host tier of min(25% of MemAvailable, 8 GiB) and an LMDB tier
under the user's cache directory. This module is the only place the connector reads the
environment (``KVTIER_CACHE_DIR``, ``HOME``); /proc/meminfo is read by
``tiers.config.mem_available_bytes`` (re-exported here); constructors get the result.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from cachestore.kv_format import COMPRESSIONS
from engine.cache_dir import default_cache_dir
from tiers.config import (
    ConfigError,
    HostTierConfig,
    LmdbTierConfig,
    TierStackConfig,
    load_config_file,
    mem_available_bytes,
    parse_tier_config,
)
from tiers.sizes import parse_size

DECISIONS = ("cost", "load", "recompute", "overlap")
log = logging.getLogger(__name__)
DEFAULT_HOST_CAP_BYTES = 8 << 30
DEFAULT_LMDB_CAPACITY_BYTES = 32 << 30  # a sparse file: unused capacity costs nothing
# Lower-tier load pipeline (connectors/offload/pipeline.py): 32 blocks of Llama-3-8B a chunk,
# two chunks in flight. bench/offload/pipeline.py (``--sections pipeline``: 128 page-cached
# LMDB blocks of 2 MiB into the GPU cache, 8 reader threads): on one H200, 4 / 8 / 16 / 32
# blocks a chunk took 53.8 / 52.2 / 41.5 / 32.5 ms (8.2 GB/s at 32; a chunk's reads wait for
# the slowest of its readers, and the readers idle while the load thread issues the chunk's
# copies, so more blocks a chunk amortise both); on the 2-core CPU machine 8-32 blocks were
# within noise of each other (23.6-27.8 ms for 48 blocks).
DEFAULT_CHUNK_BYTES = 64 << 20
DEFAULT_DEPTH = 2
PLACEMENTS = ("all", "worth_loading")


@dataclass(frozen=True, slots=True)
class OffloadConfig:
    tiers: TierStackConfig
    decision: str = "cost"
    load_timeout_s: float = 5.0
    calibrate: bool = True
    # Host-tier loads copied before the forward of the step that admits the request (the
    # request runs at once); false: they wait in WAITING_FOR_KV like lower-tier loads (the
    # old behaviour, one more engine step; kept as the benchmark's baseline).
    in_step_host_loads: bool = True
    # A step's in-step loads all land before its forward; past this many, a step's host hits
    # load asynchronously on the same copy stream, behind the in-step ones, and compute in the
    # next step. 0 (the default since the ninth session): no limit. A limit of 1 (the sixth to
    # eighth sessions' default) did not spare the first request the second's copy on a GPU:
    # the forward's own input uploads queue on the copy engine behind the async copies issued
    # before it (H200 QA, docs/scheduling.md), so the first still waited for both and the
    # second lost a step.
    in_step_loads_per_step: int = 0
    # CUDA: the host-tier copies of a step's async loads wait until its forward and sampling
    # are queued. Host -> device copies run in issue order whatever their stream (H200:
    # bench/copy_order.py, a 64 KiB upload issued after a 512 MiB copy finished 9.8 ms later),
    # so the runner uploads a step's inputs before the connector issues any copy; holding the
    # async copies past the forward's launch as well cost the held load a step or more on the
    # H200 QA run (its copy starts only once the CPU has queued the forward, 15-40 ms), so it
    # is off by default (docs/scheduling.md, tenth session).
    async_copies_after_forward: bool = False
    # CUDA: in-step loads land a group of layers at a time, each layer's attention waiting only
    # for its group, so the forward runs under the rest of the load (raw blocks: per group, a
    # driver 2-D copy per run of slots into device staging, then a scatter into the blocks,
    # connectors/device/raw_layers.py; with compression: groups of layers' parts of every block
    # by driver 2-D copies, then decoded, connectors/device/decode.py). "auto" (the default):
    # on, raw blocks included since the staged path (H200, seventeenth session,
    # docs/scheduling.md: a pair of QA reloads' copies issued in 1.8 ms and run at 0.965x of
    # one contiguous copy, where whole-block copies ran at 0.925x; a lone reload of the QA
    # shape 21.9 against 32.5 ms; QA reused requests 49.0 against 55.1 ms engine-side). The
    # path before it (a driver copy per block and group) lost in the QA run: a pair's 2,032
    # copies filled the driver's queue (eleventh session). false: whole blocks.
    layered_loads: bool | str = "auto"
    # Layer-wise loads move this many layers per copy (0: automatic; raw blocks 4,
    # connectors/device/raw_layers.py STAGED_LAYERS_PER_COPY; compressed: rows of at least
    # 128 KiB, connectors/device/decode.py). Fewer layers a copy overlap more of the forward
    # but make more, smaller copies (bench/h2d_pieces.py).
    layers_per_copy: int = 0
    # Layer-wise loads of raw blocks (the staged path, connectors/device/raw_layers.py): 0
    # issues every layer group's copies before the forward; N > 0 issues the groups while the
    # forward is launched, each once the forward's reads come within N layers of it, so the
    # driver never holds a whole load's copies ahead of the forward's launches (the H100's
    # engine thread was held in its launches until a reload's copies ended: docs/scheduling.md,
    # twenty-seventh session). Off until measured on a GPU.
    load_issue_ahead: int = 0
    # Host-tier loads move each run of consecutive slab slots as one copy plus a device
    # scatter instead of one copy per block (connectors/device/copy.py). Off by default
    # until bench/offload/main.py "load_path" has measured it on a GPU.
    coalesced_loads: bool = False
    # "lossless": blocks are stored (every tier) in connectors.device.kv_compress's 12-bit format,
    # 0.76x of the bytes with the same values back; their keys live in their own namespace.
    compression: str = "none"
    # Lower-tier loads (connectors/offload/pipeline.py): tier read, pinned staging and the copy
    # into the cache overlap in chunks of this many bytes (rounded down to whole blocks, at
    # least one) through this many staging slots; 0 bytes: read everything, then copy.
    load_chunk_bytes: int = DEFAULT_CHUNK_BYTES
    load_pipeline_depth: int = DEFAULT_DEPTH
    # Reader threads each chunk's tier reads are split over (each a copy out of the medium into
    # pinned staging plus a checksum, both outside the GIL); 0: one per core, at most 8.
    load_read_threads: int = 0
    # Graceful shutdown (close): at most this long draining the write-through queues, and as
    # long again flushing host-only blocks down (HierarchicalStore.shutdown_writes).
    drain_timeout_s: float = 5.0
    # A tier no call reached for this long is pinged (StoreConfig.probe_interval_s), so an idle
    # engine's /health follows its tiers; 0: never.
    health_probe_s: float = 5.0
    # Prefetch on arrival (connectors/offload/prefetch.py): a waiting request's blocks below
    # the host tier move up while it waits; at most prefetch_budget_blocks pinned at once
    # (0: a quarter of the host tier's slots).
    prefetch: bool = True
    prefetch_budget_blocks: int = 0
    # "worth_loading": blocks are not demoted into a tier from which even the longest prefix
    # loads slower than it recomputes, priced after calibration (cachestore/cost/placement.py).
    placement: str = "all"
    # Heads per stored object under tensor parallelism (connectors/offload/tp.py, docs/tp.md):
    # 0: one object per rank's slice (TP=1: the whole block, as before). Engines at two TP
    # degrees share blocks when both store the same granularity, e.g. 1 (one KV head).
    kv_head_group: int = 0

    @property
    def layer_wise(self) -> bool:
        """Whether in-step loads should land layer by layer (``layered_loads`` resolved)."""
        return self.layered_loads == "auto" or bool(self.layered_loads)

    def __post_init__(self) -> None:
        if self.compression not in COMPRESSIONS:
            raise ConfigError(
                f"kv offload: compression {self.compression!r}; choose one of {COMPRESSIONS}"
            )
        if self.decision not in DECISIONS:
            raise ConfigError(f"kv offload: decision {self.decision!r}; choose one of {DECISIONS}")
        if not (isinstance(self.layered_loads, bool) or self.layered_loads == "auto"):
            raise ConfigError(
                f"kv offload: layered_loads must be true, false or auto, got {self.layered_loads!r}"
            )
        for name, low in (
            ("layers_per_copy", 0),
            ("load_issue_ahead", 0),
            ("load_chunk_bytes", 0),
            ("load_pipeline_depth", 1),
            ("load_read_threads", 0),
            ("kv_head_group", 0),
            ("in_step_loads_per_step", 0),
            ("prefetch_budget_blocks", 0),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"kv offload: {name} must be an integer >= {low}, got {value!r}")
        if not self.load_timeout_s > 0:
            raise ConfigError(f"kv offload: load_timeout_s must be > 0, got {self.load_timeout_s}")
        if not self.drain_timeout_s >= 0:
            raise ConfigError(
                f"kv offload: drain_timeout_s must be >= 0, got {self.drain_timeout_s}"
            )
        if not self.health_probe_s >= 0:
            raise ConfigError(f"kv offload: health_probe_s must be >= 0, got {self.health_probe_s}")
        if self.placement not in PLACEMENTS:
            raise ConfigError(
                f"kv offload: placement {self.placement!r}; choose one of {PLACEMENTS}"
            )


def _bytes(data: Mapping[str, object], name: str, default: int) -> object:
    """A byte count given as a size with its unit (``64MiB``, as tier capacities are) or as
    an integer number of bytes (``0``: off); anything else is left for ``__post_init__`` to
    refuse. Raises ConfigError for a size string that does not parse."""
    value = data.get(name, default)
    if not isinstance(value, str):
        return value
    try:
        return parse_size(value, f"kv offload: {name}")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def parse_offload_config(data: object) -> OffloadConfig:
    """``{"tiers": [...], "decision": ..., "load_timeout_s": ..., "calibrate": ...,
    "in_step_host_loads": ..., "in_step_loads_per_step": ..., "async_copies_after_forward": ...,
    "layered_loads": ...,
    "layers_per_copy": ..., "load_issue_ahead": ...,
    "coalesced_loads": ..., "compression": ..., "drain_timeout_s": ..., "health_probe_s": ...,
    "prefetch": ..., "prefetch_budget_blocks": ..., "load_chunk_bytes": ...,
    "load_pipeline_depth": ..., "load_read_threads": ..., "placement": ..., "kv_head_group": ...}``
    -> OffloadConfig.
    Raises ConfigError naming the bad field."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"kv offload config must be a mapping, got {data!r}")
    known = {f.name for f in dataclasses.fields(OffloadConfig)}
    extra = sorted(str(k) for k in data if k not in known)
    if extra:
        raise ConfigError(f"kv offload config: unknown field(s) {extra}; known: {sorted(known)}")
    numbers = _numbers(data)
    flags = _flags(data)
    return OffloadConfig(
        tiers=parse_tier_config({"tiers": data.get("tiers")}),
        decision=str(data.get("decision", "cost")),
        load_timeout_s=numbers["load_timeout_s"],
        drain_timeout_s=numbers["drain_timeout_s"],
        health_probe_s=numbers["health_probe_s"],
        calibrate=flags["calibrate"],
        in_step_host_loads=flags["in_step_host_loads"],
        in_step_loads_per_step=data.get("in_step_loads_per_step", 0),  # type: ignore[arg-type]
        async_copies_after_forward=flags["async_copies_after_forward"],
        layered_loads=data.get("layered_loads", "auto"),  # type: ignore[arg-type]
        layers_per_copy=data.get("layers_per_copy", 0),  # type: ignore[arg-type]
        load_issue_ahead=data.get("load_issue_ahead", 0),  # type: ignore[arg-type]
        coalesced_loads=flags["coalesced_loads"],
        compression=str(data.get("compression", "none")),
        prefetch=flags["prefetch"],
        prefetch_budget_blocks=data.get("prefetch_budget_blocks", 0),  # type: ignore[arg-type]
        load_chunk_bytes=_bytes(data, "load_chunk_bytes", DEFAULT_CHUNK_BYTES),  # type: ignore[arg-type]
        load_pipeline_depth=data.get("load_pipeline_depth", DEFAULT_DEPTH),  # type: ignore[arg-type]
        load_read_threads=data.get("load_read_threads", 0),  # type: ignore[arg-type]
        placement=str(data.get("placement", "all")),
        kv_head_group=data.get("kv_head_group", 0),  # type: ignore[arg-type]
    )


def _numbers(data: Mapping[str, object]) -> dict[str, float]:
    """The config's durations (seconds, 5 by default). Raises ConfigError for a non-number."""
    numbers: dict[str, float] = {}
    for name in ("load_timeout_s", "drain_timeout_s", "health_probe_s"):
        value = data.get(name, 5.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"kv offload config: {name} must be a number, got {value!r}")
        numbers[name] = float(value)
    return numbers


def _flags(data: Mapping[str, object]) -> dict[str, bool]:
    """The config's switches, with their defaults. Raises ConfigError for a non-boolean."""
    flags: dict[str, bool] = {}
    for name, default in (
        ("calibrate", True),
        ("in_step_host_loads", True),
        ("coalesced_loads", False),
        ("prefetch", True),
        ("async_copies_after_forward", False),
    ):
        value = data.get(name, default)
        if not isinstance(value, bool):
            raise ConfigError(f"kv offload config: {name} must be true or false, got {value!r}")
        flags[name] = value
    return flags


def load_offload_config(source: str | os.PathLike[str] | Mapping[str, object]) -> OffloadConfig:
    """A YAML path or an already-parsed dict -> OffloadConfig. Raises ConfigError."""
    if isinstance(source, Mapping):
        return parse_offload_config(source)
    return load_config_file(source, parse_offload_config)


def lmcache_settings_note(env: Mapping[str, str] | None = None) -> str | None:
    """One line for a user who set LMCache's environment variables (``LMCACHE_CONFIG_FILE``,
    ``LMCACHE_*``) expecting kvtier to read them: it does not, and saying so beats applying
    nothing silently. None when none is set. Its settings (``chunk_size``, ``local_cpu``, ...)
    are refused by name in the offload YAML; docs/offload.md maps them."""
    env = os.environ if env is None else env
    names = sorted(k for k in env if k.startswith("LMCACHE_"))
    if not names:
        return None
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return (
        f"kv offload: {shown} set: kvtier does not read LMCache's settings; its tiers are in "
        "the offload YAML (docs/offload.md, 'Coming from LMCache')"
    )


def warn_lmcache_settings() -> None:
    """Log ``lmcache_settings_note`` as a WARNING when there is one (at a connector's start)."""
    note = lmcache_settings_note()
    if note:
        log.warning(note)


def default_offload_config(
    namespace_prefix: str, *, mem_available: int | None = None, cache_dir: Path | None = None
) -> OffloadConfig:
    """Host tier (min(25% of MemAvailable, 8 GiB)) over LMDB at ``<cache>/lmdb/<prefix>``."""
    mem = mem_available_bytes() if mem_available is None else mem_available
    root = default_cache_dir() if cache_dir is None else cache_dir
    host = HostTierConfig(capacity=max(min(mem // 4, DEFAULT_HOST_CAP_BYTES), 1 << 20))
    lmdb = LmdbTierConfig(
        path=str(root / "lmdb" / namespace_prefix), capacity=DEFAULT_LMDB_CAPACITY_BYTES
    )
    return OffloadConfig(tiers=TierStackConfig(tiers=(host, lmdb)))
