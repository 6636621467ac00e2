"""``kvtier cache-server``: flags -> ``ServerConfig``, the store, the admin port, signal handling.

The store is a ``HierarchicalStore`` over: a host-memory tier (``--host-capacity``, on top),
the tiers of ``--config`` (YAML, ``tiers.config``) and, with ``--data-dir``, an LMDB
tier there (unless the YAML already has one). Puts write through to the first LMDB tier
(``StoreConfig.write_through_to``): LMDB commits before ``put_many`` returns, so a put the daemon
acknowledged survives SIGKILL of the daemon and a restart on the same ``--data-dir`` serves it
again. Host-tier evictions demote to LMDB, LMDB's to Redis/S3 below, in the background.

SIGTERM/SIGINT drain: requests already received are answered, then everything closes.
The only module of the daemon that reads files named on the command line (tokens, YAML).

Memory (docs/cache_server.md "Memory"): the daemon's anonymous memory beyond its
host tier is bounded by its queues and buffers. Two settings here bound what the defaults
left loose: the store's background queues hold at most ``DAEMON_QUEUE_BATCHES`` batches per
tier (each a put's worth of evicted block copies; with write-through they are already on
disk), and freed payload buffers go back to the OS every ``TRIM_INTERVAL_S``
(``start_trimming``: glibc's ``malloc_trim``) instead of staying in glibc's arenas (about
300 MB after a load without it).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import signal
import sys
import threading
from pathlib import Path

from cachestore.server.usage import NamespaceUsage
from cachestore.store.hierarchical import HierarchicalStore, StoreConfig
from tiers.base import Tier
from tiers.config import TierConfig, parse_size

# The store's per-tier demotion/promotion queue bound for the daemon (StoreConfig's default,
# 64, held ~330 MiB of 2 MiB block copies under load with a 256 MiB host tier).
DAEMON_QUEUE_BATCHES = 8
# glibc raises its mmap threshold after the first free of a large block, so freed 2 MiB
# payload buffers (ZMQ messages, copies) then stay in its per-thread arenas: anonymous RSS
# stayed ~300 MB after a load. A fixed threshold (mmap per buffer) cost page faults on every
# request; a periodic malloc_trim returns the free pages at no cost to the hot path.
TRIM_INTERVAL_S = 2.0


def start_trimming(stop: threading.Event, interval_s: float = TRIM_INTERVAL_S) -> bool:
    """Call glibc's ``malloc_trim(0)`` every ``interval_s`` on a daemon thread until ``stop``
    is set. False (nothing started) where the C library has no malloc_trim."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        trim = None
    if trim is None:
        return False

    def run() -> None:
        while not stop.wait(interval_s):
            trim(0)

    threading.Thread(target=run, name="kvtier-trim", daemon=True).start()
    return True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1",
                        help="bind address (anything but loopback needs --tokens)")
    parser.add_argument("--port", type=int, default=5555, help="ZMQ port (0: any free port)")
    parser.add_argument("--admin-port", type=int, default=5556,
                        help="HTTP admin port: /health /metrics /stats (-1: off)")
    parser.add_argument("--admin-host", default="127.0.0.1",
                        help="admin bind address (default loopback; anything else needs "
                             "--admin-token-file: the admin port lists every tenant's usage)")
    parser.add_argument("--admin-token-file", default=None,
                        help="file holding the admin port's bearer token (needed by /stats, "
                             "/namespaces, /metrics; /health stays open)")
    parser.add_argument("--data-dir", default=None, help="LMDB directory (persistence)")
    parser.add_argument("--lmdb-capacity", default="10GiB",
                        help="LMDB capacity under --data-dir (bytes with a unit: 10GiB, 200GB)")
    parser.add_argument("--host-capacity", default=None,
                        help="host-memory tier on top of the others, e.g. 4GiB (Gi = 2^30, "
                             "G = 10^9; a bare number is refused; default: none)")
    parser.add_argument("--host-slot-bytes", default="4MiB",
                        help="host tier slot: the largest block it holds (larger: LMDB only)")
    parser.add_argument("--config", default=None, help="tiers YAML (tiers.config)")
    parser.add_argument("--tokens", default=None,
                        help="file of 'TOKEN NAMESPACE [KEY_PREFIX...]' lines")
    parser.add_argument("--access-log", default=None, help="JSONL access log (ts, op, namespace, keys)")
    parser.add_argument("--workers", type=int, default=4, help="request worker threads")
    parser.add_argument("--max-frame-bytes", default="64MiB", help="largest block accepted")
    parser.add_argument("--max-keys", type=int, default=4096, help="keys per request")
    parser.add_argument("--namespace-quota", default=None, help="bytes per namespace (default: none)")
    parser.add_argument("--no-shm", action="store_true", help="disable the shared-memory path")
    parser.add_argument("--no-inline-reads", action="store_true",
                        help="send every request to the worker pool (no loop-thread host reads)")
    parser.add_argument("--no-doorbell", action="store_true",
                        help="no same-host Unix-socket doorbell (shm clients stay on ZMQ)")
    parser.add_argument("--no-stream", action="store_true",
                        help="no TCP stream (clients without shared memory stay on ZMQ)")
    parser.add_argument("--stream-port", type=int, default=0,
                        help="TCP stream port on --host (default 0: a free port, announced "
                             "to clients in the hello reply)")
    parser.add_argument("--no-leases", action="store_true",
                        help="no zero-copy same-host gets (doorbell clients mapping the host "
                             "slab; only ever offered when it holds one namespace)")
    parser.add_argument("--spin-us", type=float, default=100.0,
                        help="microseconds the loop polls for a next request before blocking")
    parser.add_argument("--loop-cpu", type=int, default=None,
                        help="run the ZMQ loop thread and ZMQ's I/O thread on this one CPU "
                             "(faster TCP on small VMs; default: unpinned)")


def _admin_token(args: argparse.Namespace) -> str | None:
    """The admin port's bearer token (None: none). Raises ValueError for an admin port on a
    non-loopback address without one, or an empty or unreadable token file."""
    from tiers.remote.protocol import is_loopback

    token = None
    if args.admin_token_file:
        try:
            token = Path(args.admin_token_file).read_text().strip()
        except OSError as exc:
            raise ValueError(f"--admin-token-file: cannot read {args.admin_token_file}: "
                             f"{exc.strerror}") from None
        if len(token) < 16:
            raise ValueError(f"--admin-token-file {args.admin_token_file}: the token must be "
                             "at least 16 characters")
    host = f"[{args.admin_host}]" if ":" in args.admin_host else args.admin_host
    if args.admin_port >= 0 and token is None and not is_loopback(f"tcp://{host}:0"):
        raise ValueError(f"--admin-host {args.admin_host} exposes every tenant's name and usage: "
                         "give --admin-token-file, or keep the admin port on loopback")
    return token


def stack_configs(args: argparse.Namespace) -> list[TierConfig]:
    """The daemon's tier configs, top first, from ``--config``, ``--host-capacity`` and
    ``--data-dir``; reads the YAML, allocates nothing. Raises ConfigError/ValueError with a
    one-line message naming the file or the flag (sizes need a unit: ``parse_size``)."""
    from tiers.config import HostTierConfig, LmdbTierConfig, load_tier_config

    configs = list(load_tier_config(args.config).tiers) if args.config else []
    if args.host_capacity and not any(isinstance(c, HostTierConfig) for c in configs):
        capacity = parse_size(args.host_capacity, "--host-capacity")
        slot_bytes = parse_size(args.host_slot_bytes, "--host-slot-bytes")
        configs.insert(0, HostTierConfig(capacity=capacity, slot_bytes=slot_bytes,
                                         pin_memory=False))  # no GPU reads the daemon's memory
    if args.data_dir and not any(isinstance(c, LmdbTierConfig) for c in configs):
        lmdb = LmdbTierConfig(path=str(Path(args.data_dir) / "lmdb"),
                              capacity=parse_size(args.lmdb_capacity, "--lmdb-capacity"))
        at = 1 if configs and configs[0].kind == "host" else 0
        configs.insert(at, lmdb)
    if not configs:
        raise ValueError("give --data-dir (LMDB) and/or --config (tiers YAML)")
    return configs


def build_tiers_for(args: argparse.Namespace, shared_host: bool = False) -> list[Tier]:
    """The daemon's tier stack, top first (``stack_configs``). ``shared_host``: the host tier's
    slab in a sealed memfd that clients can map read-only (``cachestore.server.leases``; private
    memory where that is not supported). Raises ConfigError/ValueError with a clear message."""
    from tiers import build_tiers
    from tiers.config import HostTierConfig, TierStackConfig, check_resources, load_tier_config

    if args.config:  # the file's own tiers first: an error names the file and its index there
        check_resources(load_tier_config(args.config), source=args.config)
    configs = stack_configs(args)

    host = configs[0] if shared_host and isinstance(configs[0], HostTierConfig) else None
    if host is None or host.slot_bytes is None or host.pin_memory:
        return build_tiers(TierStackConfig(tiers=tuple(configs)))
    from tiers.host import HostTier

    check_resources(TierStackConfig(tiers=tuple(configs)))  # before the slab is allocated
    try:
        top = HostTier(host.capacity, host.slot_bytes, shared=True)
    except OSError:  # no memfd/seals here: a private slab, gets copy as before
        top = HostTier(host.capacity, host.slot_bytes, pin_memory=False)
    try:
        return [top, *(build_tiers(TierStackConfig(tiers=tuple(configs[1:])))
                       if len(configs) > 1 else [])]
    except BaseException:
        top.close()
        raise


def build_store(tiers: list[Tier], usage: NamespaceUsage) -> HierarchicalStore:
    """The daemon's store over ``tiers`` (owned from here on), writing through to the first
    LMDB tier below the top; blocks dropped at the bottom leave ``usage``."""
    durable = next((i for i, t in enumerate(tiers) if t.name == "lmdb"), None)
    # Keys are ``tenant/`` + the client's key: blocks carry the client's (codec version 2).
    config = StoreConfig(write_through_to=durable if durable else None, block_key_skip=1,
                         queue_batches=DAEMON_QUEUE_BATCHES)
    return HierarchicalStore(tiers, config, on_drop=usage.remove)


def main(args: argparse.Namespace) -> int:
    from cachestore.server.admin import AdminMetrics, AdminServer, create_app
    from cachestore.server.daemon import CacheServer, ServerConfig
    from tiers.remote.protocol import ServerLimits, TokenTable

    try:
        admin_token = _admin_token(args)
        tokens = None
        if args.tokens:
            tokens = TokenTable.parse(Path(args.tokens).read_text(), args.tokens)
        quota = (parse_size(args.namespace_quota, "--namespace-quota") if args.namespace_quota
                 else None)
        limits = ServerLimits(max_keys_per_request=args.max_keys,
                              max_frame_bytes=parse_size(args.max_frame_bytes,
                                                         "--max-frame-bytes"),
                              max_namespace_bytes=quota)
        host = f"[{args.host}]" if ":" in args.host else args.host
        config = ServerConfig(url=f"tcp://{host}:{args.port}", limits=limits,
                              num_workers=args.workers, shm_enabled=not args.no_shm,
                              access_log_path=args.access_log,
                              inline_reads=not args.no_inline_reads,
                              doorbell=not args.no_doorbell, spin_us=args.spin_us,
                              stream=not args.no_stream, stream_port=args.stream_port,
                              loop_cpu=args.loop_cpu, leases=not args.no_leases)
        usage = NamespaceUsage()
        # A mappable slab only where leases may be offered (one namespace in it).
        shared = (config.leases and config.doorbell and config.shm_enabled
                  and config.inline_reads and (tokens is None or tokens.one_open_namespace()))
        store = build_store(build_tiers_for(args, shared_host=shared), usage)
    except (OSError, ValueError) as exc:
        print(f"kvtier cache-server: {exc}", file=sys.stderr)
        return 2
    metrics = AdminMetrics()
    try:
        server = CacheServer(config, store, tokens, on_request=metrics.record, usage=usage)
    except ValueError as exc:
        store.close()
        print(f"kvtier cache-server: {exc}", file=sys.stderr)
        return 2
    metrics.bind(server)
    admin = None
    if args.admin_port >= 0:
        admin = AdminServer(create_app(server, metrics, admin_token), args.admin_host,
                            args.admin_port).start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: server.request_stop())
    trimming = threading.Event()
    start_trimming(trimming)
    server.start()
    print(f"kvtier cache-server listening on {server.bound_url}"
          + (f", admin http://{args.admin_host}:{args.admin_port}" if admin else ""),
          flush=True)
    try:
        while not server.wait(0.2):
            pass
        # The write-through queues below the durable tier, and host-only blocks: what a
        # restart would otherwise miss (acknowledged puts are in LMDB already).
        report = store.shutdown_writes(config.drain_timeout_s)
        problem: str | None = server.drain_problem
        if report.dropped or report.flush_left:
            problem = f"kv store drain incomplete: {report.describe()}"
    finally:
        trimming.set()
        if admin is not None:
            admin.stop()
        store.close()
    if problem is not None:  # a supervisor sees a non-zero exit
        print(f"kvtier cache-server stopped without a clean drain: {problem}", file=sys.stderr,
              flush=True)
        return 1
    print("kvtier cache-server stopped (drained)", flush=True)
    return 0
