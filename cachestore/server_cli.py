"""``kvtier cache-server``: flags -> ``ServerConfig``, the store, the admin port, signal handling.

The store: the tiers of ``--config`` (YAML, ``cachestore.tier_config``) plus, with
``--data-dir``, an LMDB tier there (unless the YAML already has one). LMDB commits a put before
it returns, so a put the daemon acknowledged survives a crash of the daemon and a restart on the
same ``--data-dir`` serves it again.

SIGTERM/SIGINT drain: requests already received are answered, then everything closes.
The only module of the daemon that reads files named on the command line (tokens, YAML).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cachestore.sizes import parse_size
from tiers.base import Evicted, Tier, Value


class TierBackend:
    """The daemon's ``Backend`` over a top-first list of tiers, written through to all.

    Reads go top-down (a hit in a lower tier is not promoted); puts go to every tier, so the
    durable one holds every acknowledged block. Thread-safe because tiers are.

    Zero copy from a top tier that can pin (the host slab): ``get_many`` pins what it returns
    views of, and ``release`` (the daemon calls it once it copied them out) unpins, so a
    concurrent put can never overwrite a slot being read. Other values are bytes.
    """

    def __init__(self, tiers: Sequence[Tier]) -> None:
        if not tiers:
            raise ValueError("the cache server needs at least one tier")
        self.tiers = list(tiers)
        self._local = threading.local()

    def release(self) -> None:
        """Unpin what this thread's last ``get_many`` pinned. Idempotent."""
        pinned = getattr(self._local, "pinned", None)
        if pinned:
            self._local.pinned = None
            self.tiers[0].unpin(pinned)  # type: ignore[attr-defined]

    def lookup(self, keys: Sequence[str]) -> int:
        return max(t.lookup(keys) for t in self.tiers)

    def get_many(self, keys: Sequence[str]) -> list[Value | None]:
        self.release()
        top = self.tiers[0]
        pinned: set[str] = set()
        if hasattr(top, "pin"):
            pinned = {k for k in keys if top.pin([k]) == 1}
            self._local.pinned = list(pinned)
        out: list[Value | None] = [None] * len(keys)
        missing = list(range(len(keys)))
        for tier in self.tiers:
            if not missing:
                break
            values = tier.get_many([keys[i] for i in missing])
            still = []
            for i, value in zip(missing, values, strict=True):
                if value is None:
                    still.append(i)
                elif isinstance(value, bytes) or (tier is top and keys[i] in pinned):
                    out[i] = value
                else:
                    out[i] = bytes(value)  # an unpinned view could be overwritten: own it
            missing = still
        return out

    def put_many(self, items: Sequence[tuple[str, Value]]) -> list[Evicted]:
        evicted: list[Evicted] = []
        for tier in self.tiers:
            evicted = tier.put_many(items)
        return evicted  # what the bottom tier dropped is gone from the daemon

    def delete_many(self, keys: Sequence[str]) -> int:
        return max(t.delete_many(keys) for t in self.tiers)

    def stats(self) -> dict[str, Any]:
        tiers = {}
        for tier in self.tiers:
            u = tier.usage()
            tiers[tier.name] = {"used_bytes": u.used_bytes, "capacity_bytes": u.capacity_bytes,
                                "num_entries": u.num_entries}
        return {"tiers": tiers}

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1",
                        help="bind address (anything but loopback needs --tokens)")
    parser.add_argument("--port", type=int, default=5555, help="ZMQ port (0: any free port)")
    parser.add_argument("--admin-port", type=int, default=5556,
                        help="HTTP admin port: /health /metrics /stats (-1: off)")
    parser.add_argument("--admin-host", default=None, help="admin bind address (default --host)")
    parser.add_argument("--data-dir", default=None, help="LMDB directory (persistence)")
    parser.add_argument("--lmdb-capacity", default="10GiB", help="LMDB capacity under --data-dir")
    parser.add_argument("--config", default=None, help="tiers YAML (cachestore.tier_config)")
    parser.add_argument("--tokens", default=None,
                        help="file of 'TOKEN NAMESPACE [KEY_PREFIX...]' lines")
    parser.add_argument("--access-log", default=None, help="JSONL access log (ts, op, namespace, keys)")
    parser.add_argument("--workers", type=int, default=4, help="request worker threads")
    parser.add_argument("--max-frame-bytes", default="64MiB", help="largest block accepted")
    parser.add_argument("--max-keys", type=int, default=4096, help="keys per request")
    parser.add_argument("--namespace-quota", default=None, help="bytes per namespace (default: none)")
    parser.add_argument("--no-shm", action="store_true", help="disable the shared-memory path")


def build_tiers_for(args: argparse.Namespace) -> list[Tier]:
    """The daemon's tier stack, top first. Raises ConfigError/ValueError with a clear message."""
    from cachestore.tier_config import LmdbTierConfig, build_tiers, load_tier_config

    configs = list(load_tier_config(args.config).tiers) if args.config else []
    if args.data_dir and not any(isinstance(c, LmdbTierConfig) for c in configs):
        lmdb = LmdbTierConfig(path=str(Path(args.data_dir) / "lmdb"),
                              capacity=parse_size(args.lmdb_capacity))
        at = 1 if configs and configs[0].kind == "host" else 0
        configs.insert(at, lmdb)
    if not configs:
        raise ValueError("give --data-dir (LMDB) and/or --config (tiers YAML)")
    from cachestore.tier_config import TierStackConfig

    return build_tiers(TierStackConfig(tiers=tuple(configs)))


def main(args: argparse.Namespace) -> int:
    from cachestore.server import CacheServer, ServerConfig
    from cachestore.server_admin import AdminMetrics, AdminServer, create_app
    from cachestore.server_protocol import ServerLimits, TokenTable

    try:
        tokens = None
        if args.tokens:
            tokens = TokenTable.parse(Path(args.tokens).read_text(), args.tokens)
        quota = parse_size(args.namespace_quota) if args.namespace_quota else None
        limits = ServerLimits(max_keys_per_request=args.max_keys,
                              max_frame_bytes=parse_size(args.max_frame_bytes),
                              max_namespace_bytes=quota)
        host = f"[{args.host}]" if ":" in args.host else args.host
        config = ServerConfig(url=f"tcp://{host}:{args.port}", limits=limits,
                              num_workers=args.workers, shm_enabled=not args.no_shm,
                              access_log_path=args.access_log)
        backend = TierBackend(build_tiers_for(args))
    except (OSError, ValueError) as exc:
        print(f"kvtier cache-server: {exc}", file=sys.stderr)
        return 2
    metrics = AdminMetrics()
    try:
        server = CacheServer(config, backend, tokens, on_request=metrics.record)
    except ValueError as exc:
        backend.close()
        print(f"kvtier cache-server: {exc}", file=sys.stderr)
        return 2
    metrics.bind(server)
    admin = None
    if args.admin_port >= 0:
        admin = AdminServer(create_app(server, metrics), args.admin_host or args.host,
                            args.admin_port).start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: server.request_stop())
    server.start()
    print(f"kvtier cache-server listening on {server.bound_url}"
          + (f", admin http://{args.admin_host or args.host}:{args.admin_port}" if admin else ""),
          flush=True)
    try:
        while not server.wait(0.2):
            pass
    finally:
        if admin is not None:
            admin.stop()
        backend.close()
    print("kvtier cache-server stopped", flush=True)
    return 0
