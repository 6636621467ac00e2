"""``kvtier cache-server``: flags -> ``ServerConfig``, the store, the admin port, signal handling.

The store is a ``HierarchicalStore`` over: a host-memory tier (``--host-capacity``, on top),
the tiers of ``--config`` (YAML, ``tiers.config``) and, with ``--data-dir``, an LMDB
tier there (unless the YAML already has one). Puts write through to the first LMDB tier
(``StoreConfig.write_through_to``): LMDB commits before ``put_many`` returns, so a put the daemon
acknowledged survives SIGKILL of the daemon and a restart on the same ``--data-dir`` serves it
again. The tiers below get each tier's ``write_policy`` from the YAML, as in the engine
(``daemon_write_policies``; default write-through: a put is queued for Redis/S3 at once), and
host-tier evictions demote to LMDB, LMDB's to Redis/S3 below, in the background.

SIGTERM/SIGINT drain: requests already received are answered, then everything closes.
The only module of the daemon that reads files named on the command line (tokens, YAML).

Memory (docs/cache_server.md "Memory"): the daemon's anonymous memory beyond its
host tier is bounded by its queues and buffers. Two settings here bound what the defaults
left loose: the store's background queues hold at most ``DAEMON_QUEUE_BATCHES`` batches per
tier (each a put's worth of evicted block copies; with write-through they are already on
disk), and freed payload buffers go back to the OS every ``TRIM_INTERVAL_S``
(``cachestore.server.trim``: glibc's ``malloc_trim``) instead of staying in glibc's arenas
(about 300 MB after a load without it).
"""

from __future__ import annotations

import argparse
import faulthandler
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from cachestore.server.flags import (
    TIER_REQUIRED,
    add_arguments,
    admin_token,
    require_a_tier,
    server_config,
)
from cachestore.server.startup import (
    check_binds,
    daemon_host_tier,
    load_daemon_tiers,
    say,
    setup_logging,
    startup_block,
)
from cachestore.server.trim import start_trimming
from cachestore.server.usage import NamespaceUsage
from cachestore.store.hierarchical import HierarchicalStore, StoreConfig
from cachestore.store.types import WritePolicy, write_policies
from tiers.base import Tier
from tiers.config import TierConfig, TierStackConfig, parse_size

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from cachestore.server.admin import AdminMetrics, AdminServer
    from cachestore.server.daemon import CacheServer

__all__ = ["add_arguments", "main"]  # ``kvtier cache-server``'s entry points (engine/cli.py)

# The store's per-tier demotion/promotion queue bound for the daemon (StoreConfig's default,
# 64, held ~330 MiB of 2 MiB block copies under load with a 256 MiB host tier).
DAEMON_QUEUE_BATCHES = 8


def stack_configs(args: argparse.Namespace) -> list[TierConfig]:
    """The daemon's tier configs, top first, from ``--config`` (``load_daemon_tiers``),
    ``--host-capacity`` and ``--data-dir``; reads the YAML, allocates nothing. Raises ConfigError/ValueError with a one-line message
    naming the file or the flag (sizes need a unit: ``parse_size``)."""
    from tiers.config import HostTierConfig, LmdbTierConfig

    slot_bytes = parse_size(args.host_slot_bytes, "--host-slot-bytes")
    configs: list[TierConfig] = []
    if args.config:
        stack, _ = load_daemon_tiers(args.config)
        configs = [
            daemon_host_tier(c, slot_bytes) if isinstance(c, HostTierConfig) else c
            for c in stack.tiers
        ]
    if args.host_capacity and not any(isinstance(c, HostTierConfig) for c in configs):
        capacity = parse_size(args.host_capacity, "--host-capacity")
        configs.insert(
            0, HostTierConfig(capacity=capacity, slot_bytes=slot_bytes, pin_memory=False)
        )  # no GPU reads the daemon's memory
    if args.data_dir and not any(isinstance(c, LmdbTierConfig) for c in configs):
        lmdb = LmdbTierConfig(
            path=str(Path(args.data_dir) / "lmdb"),
            capacity=parse_size(args.lmdb_capacity, "--lmdb-capacity"),
        )
        at = 1 if configs and configs[0].kind == "host" else 0
        configs.insert(at, lmdb)
    if not configs:
        raise ValueError(f"no tiers in --config {args.config}: {TIER_REQUIRED}")
    return configs


def build_tiers_for(
    configs: list[TierConfig], source: str | None = None, shared_host: bool = False
) -> list[Tier]:
    """The daemon's tier stack from ``stack_configs``' ``configs``, top first; ``source``
    (the YAML file) named in a resource check's error. ``shared_host``: the host tier's slab
    in a sealed memfd that clients can map read-only (``cachestore.server.leases``; private
    memory where that is not supported). Raises ConfigError/ValueError with a clear message."""
    from tiers import build_tiers
    from tiers.config import HostTierConfig, TierStackConfig, check_resources

    check_resources(TierStackConfig(tiers=tuple(configs)), source=source)
    host = configs[0] if shared_host and isinstance(configs[0], HostTierConfig) else None
    if host is None or host.slot_bytes is None or host.pin_memory:
        return build_tiers(TierStackConfig(tiers=tuple(configs)))
    from tiers.host import HostTier

    try:
        top = HostTier(host.capacity, host.slot_bytes, shared=True)
    except OSError:  # no memfd/seals here: a private slab, gets copy as before
        top = HostTier(host.capacity, host.slot_bytes, pin_memory=False)
    try:
        return [
            top,
            *(build_tiers(TierStackConfig(tiers=tuple(configs[1:]))) if len(configs) > 1 else []),
        ]
    except BaseException:
        top.close()
        raise


def durable_index(tiers: list[Tier]) -> int | None:
    """The tier puts write through to: the first LMDB tier below the top (None: none)."""
    durable = next((i for i, t in enumerate(tiers) if t.name == "lmdb"), None)
    return durable if durable else None


def daemon_write_policies(
    configs: list[TierConfig], durable: int | None
) -> tuple[WritePolicy, ...]:
    """Each tier's write policy, top first: the tiers file's ``write_policy`` fields, as the
    engine's store reads them (``write_policies``: write-through below the host tier unless
    the file says otherwise), so Redis/S3 get a put's blocks at once, not only once LMDB
    evicts them. The durable tier is the exception: ``put_many`` already writes it
    synchronously, a queued copy would only find every block there."""
    policies = write_policies(TierStackConfig(tiers=tuple(configs)))
    return tuple(WritePolicy() if i == durable else p for i, p in enumerate(policies))


def build_store(
    tiers: list[Tier],
    configs: list[TierConfig],
    usage: NamespaceUsage,
    registry: CollectorRegistry | None = None,
) -> HierarchicalStore:
    """The daemon's store over ``tiers`` (owned from here on; built from ``configs``),
    writing through to the first LMDB tier below the top synchronously and to the others
    as their write policies say; blocks dropped at the bottom leave ``usage``. With
    ``registry``, the per-tier ``kvtier_store_*`` counters are exported there (``/metrics``)."""
    durable = durable_index(tiers)
    # Keys are ``tenant/`` + the client's key: blocks carry the client's (codec version 2).
    config = StoreConfig(
        write_through_to=durable,
        block_key_skip=1,
        queue_batches=DAEMON_QUEUE_BATCHES,
        write_policies=daemon_write_policies(configs, durable),
    )
    return HierarchicalStore(tiers, config, registry=registry, on_drop=usage.remove)


def read_tokens(path: str) -> str:
    """The text of the ``--tokens`` file. Raises ValueError naming the flag and the path."""
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ValueError(f"--tokens: cannot read {path}: {why}") from None


def _fail(message: object, code: int = 2) -> int:
    print(f"kvtier cache-server: {message}", file=sys.stderr, flush=True)
    return code


def main(args: argparse.Namespace) -> int:
    """Runs the daemon. Exit codes: 0 after a SIGTERM/SIGINT drained cleanly; 1 when the
    drain lost blocks, or a tier failed to start (TierError: one line on stderr, as the
    engine's other start-up failures); 2 for a usage or start-up error (one line on stderr,
    printed before anything is bound or allocated where the flags show it: taken ports, bad
    addresses)."""
    from cachestore.server.admin import AdminMetrics
    from cachestore.server.daemon import CacheServer
    from tiers.base import TierError
    from tiers.remote.protocol import TokenTable

    setup_logging()
    try:
        require_a_tier(args)
        token = admin_token(args)
        check_binds(args)
        tokens = None
        if args.tokens:  # a malformed line is named "--tokens FILE:LINE: ..."
            tokens = TokenTable.parse(read_tokens(args.tokens), f"--tokens {args.tokens}")
        config = server_config(args)
        usage = NamespaceUsage()
        # A mappable slab only where leases may be offered (one namespace in it).
        shared = (
            config.leases
            and config.doorbell
            and config.shm_enabled
            and config.inline_reads
            and (tokens is None or tokens.one_open_namespace())
        )
        configs = stack_configs(args)
        ignored = load_daemon_tiers(args.config)[1] if args.config else []
        tiers = build_tiers_for(configs, args.config, shared_host=shared)
        metrics = AdminMetrics()
        store = build_store(tiers, configs, usage, metrics.registry)
    except (OSError, ValueError) as exc:
        return _fail(exc)
    except TierError as exc:  # an LMDB directory another process holds unreadable, ...
        return _fail(exc, 1)
    try:
        server = CacheServer(config, store, tokens, on_request=metrics.record, usage=usage)
    except ValueError as exc:
        store.close()
        return _fail(exc)
    metrics.bind(server)
    admin, error = _start(args, server, metrics, token)
    if error is not None:
        store.close()
        return _fail(error)
    admin_url = f"http://{args.admin_host}:{args.admin_port}" if admin else None
    for line in startup_block(
        server.bound_url,
        admin_url,
        configs,
        durable_index(tiers),
        ignored,
        args.config,
        store.config.write_policies,
    ):
        say(line)
    return _serve_until_stopped(server, store, admin)


def _start(
    args: argparse.Namespace, server: CacheServer, metrics: AdminMetrics, token: str | None
) -> tuple[AdminServer | None, str | None]:
    """Start the admin port (``--admin-port``), the stop signals' handlers and the daemon:
    (the admin server or None, None), or (None, the error) with nothing left running."""
    from cachestore.server.admin import AdminServer, create_app

    admin = None
    if args.admin_port >= 0:
        admin = AdminServer(create_app(server, metrics, token), args.admin_host, args.admin_port)
        admin.start()
        if not admin.wait_started():  # taken since check_binds: fatal, as any bind failure
            return None, f"--admin-port: cannot serve http://{args.admin_host}:{args.admin_port}"
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: server.request_stop())
    # ``kill -USR1``: every thread's stack to stderr, serving on (as ``kvtier serve``)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        server.start()
    except RuntimeError as exc:  # the ZMQ bind, taken since check_binds
        if admin is not None:
            admin.stop()
        return None, str(exc)
    return admin, None


def _serve_until_stopped(
    server: CacheServer, store: HierarchicalStore, admin: AdminServer | None
) -> int:
    """Serve until a stop signal, drain, close everything; the exit code (1: blocks lost)."""
    trimming = threading.Event()
    start_trimming(trimming)
    try:
        while not server.wait(0.2):
            pass
        # The write-through queues below the durable tier, and host-only blocks: what a
        # restart would otherwise miss (acknowledged puts are in LMDB already).
        report = store.shutdown_writes(server.config.drain_timeout_s)
        problem: str | None = server.drain_problem
        if report.dropped or report.flush_left:
            problem = f"kv store drain incomplete: {report.describe()}"
    finally:
        trimming.set()
        if admin is not None:
            admin.stop()
        store.close()
    if problem is not None:  # a supervisor sees a non-zero exit
        say(f"kvtier cache-server stopped without a clean drain: {problem}", sys.stderr)
        return 1
    say("kvtier cache-server stopped (drained)")
    return 0
