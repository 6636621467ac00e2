"""Tier throughput and latency, each beside the best plain use of the same medium, same run.

For every tier, block size and call shape (``single``: one key per call, ``batched``: ``--batch``
keys per call) it times ``put_many``, ``get_many`` and ``get_many_into`` (into one preallocated
staging buffer) over the same keys, and the same bytes through the baseline:

    host   numpy copy into a preallocated buffer (memcpy)   get = get_many + copy out of the slab
    lmdb   put: a plain write transaction on an environment opened like the tier's;
           get: a plain read transaction on the TIER'S OWN environment (``buffers=True``,
           zero-copy), each value copied once into the staging buffer
    redis  raw redis-py (hiredis) pipelined SET / GET, the batch split over the tier's
           ``read_connections`` pipelines in parallel, as the tier does
    redis-lru  the same, the tier's ``capacity`` set (LRU bookkeeping in Lua, room for twice the
           working set: no evictions); ``lru_vs_plain`` compares it with the plain Redis tier
    s3     raw boto3 put_object / get_object, one object per block, at the tier's
           ``max_pool_connections`` concurrency

Passes are interleaved (tier, baseline, tier into, per pass) and the median of ``--repeats``
passes counts; every pass is in the JSON. Redis and S3 are private redis-server / moto servers
on loopback (tests/servers.py) unless ``--redis-url`` / ``--s3-endpoint`` name real ones.
Prints one JSON document (machine info, rows with GB/s, p50/p99 latency and the tier/baseline
ratio) and a one-line summary of the batched 2 MiB reads.

    .venv/bin/python bench/tiers.py [--tiers host,lmdb] [--sizes 64KiB,2MiB] [--total 192MiB]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import machine_info, percentile  # noqa: E402
from tiers.base import Tier  # noqa: E402
from tiers.config import parse_size  # noqa: E402

Items = list[tuple[str, bytes]]
Op = Callable[[list[int]], object]


@dataclass(frozen=True, slots=True)
class Row:
    tier: str
    block_bytes: int
    mode: str
    op: str  # put, get (get_many), get_into (get_many_into); the baseline is the same for both gets
    num_blocks: int
    tier_gbps: float  # median over passes
    tier_p50_ms: float
    tier_p99_ms: float
    base_gbps: float
    base_p50_ms: float
    base_p99_ms: float
    ratio: float  # tier GB/s / baseline GB/s (medians)
    tier_runs: list[float]
    base_runs: list[float]


class Backend:
    """One tier and its baseline, set up for one block size. ``base_get`` copies or receives
    each value once, like the tier; ``dest`` is the staging buffer both may read into."""

    def __init__(self, tier: Tier, put: Callable[[Items], None], get: Callable[[list[str]], Any],
                 tier_get: Callable[[list[str]], object] | None = None) -> None:  # fmt: skip
        self.tier, self.base_put, self.base_get = tier, put, get
        self.tier_get = tier_get or tier.get_many
        self.closers: list[Callable[[], object]] = [tier.close]

    def close(self) -> None:
        for close in self.closers:
            close()


class Staging:
    """A preallocated buffer cut into one slot per key of a call (the host slab's role)."""

    def __init__(self, block: int, slots: int) -> None:
        self.array = np.empty(block * slots, dtype=np.uint8)
        self.array[:] = 0  # fault it in before any timing
        view = memoryview(self.array)
        self.slots = [view[i * block : (i + 1) * block] for i in range(slots)]


def host_backend(block: int, num: int, scratch: str, staging: Staging) -> Backend:
    from tiers.host import HostTier

    tier = HostTier(capacity_bytes=num * block, slot_bytes=block)
    slab = np.empty(num * block, dtype=np.uint8)
    index: dict[str, int] = {}

    def put(items: Items) -> None:
        for key, val in items:
            slot = index.setdefault(key, len(index))
            slab[slot * block : (slot + 1) * block] = np.frombuffer(val, dtype=np.uint8)

    def get(keys: list[str]) -> None:
        for i, key in enumerate(keys):
            staging.slots[i][:] = memoryview(slab)[index[key] * block : (index[key] + 1) * block]

    def tier_get(keys: list[str]) -> None:  # the consumer copies out of the slab, like memcpy
        for i, view in enumerate(tier.get_many(keys)):
            staging.slots[i][:] = view  # type: ignore[index]

    return Backend(tier, put, get, tier_get)


def lmdb_backend(block: int, num: int, scratch: str, staging: Staging) -> Backend:
    import lmdb

    from tiers.lmdb import LmdbTier

    tier = LmdbTier(os.path.join(scratch, "lmdb"), capacity_bytes=2 * num * block + (64 << 20))
    # the plain environment writes as the tier's does (writemap or write(2): its default)
    raw = lmdb.open(os.path.join(scratch, "raw"), map_size=4 * num * block + (64 << 20),
                    sync=False, metasync=False, readahead=False,
                    writemap=tier._env.flags()["writemap"])  # fmt: skip

    def put(items: Items) -> None:
        with raw.begin(write=True) as txn:
            for key, val in items:
                txn.put(key.encode(), val)

    def get(keys: list[str]) -> None:  # the tier's own environment and sub-database
        with tier._env.begin(db=tier._blocks, buffers=True) as txn:
            for i, key in enumerate(keys):
                staging.slots[i][:] = txn.get(key.encode())

    backend = Backend(tier, put, get)
    backend.closers.append(raw.close)
    return backend


def redis_backend(url: str, lru: bool = False) -> Callable[..., Backend]:
    def make(block: int, num: int, scratch: str, staging: Staging) -> Backend:
        import redis

        from tiers.redis import RedisTier, RedisTierConfig

        capacity = 2 * num * block if lru else None
        tier = RedisTier(RedisTierConfig(url=url, key_prefix="bench:", capacity=capacity))
        raw = redis.Redis.from_url(url)
        raw.flushdb()
        parallel = tier.config.read_connections
        pool = ThreadPoolExecutor(parallel)

        def put(items: Items) -> None:
            pipe = raw.pipeline(transaction=False)
            for key, val in items:
                pipe.set("raw:" + key, val)
            pipe.execute()

        def get_one(keys: Sequence[str]) -> list[Any]:
            pipe = raw.pipeline(transaction=False)
            for key in keys:
                pipe.get("raw:" + key)
            return list(pipe.execute())

        def get(keys: list[str]) -> list[Any]:  # split like the tier: len // 2 pipelines at most
            parts = max(1, min(parallel, len(keys) // 2))
            step = -(-len(keys) // parts)
            chunks = [keys[s : s + step] for s in range(0, len(keys), step)]
            return [v for part in pool.map(get_one, chunks) for v in part]

        backend = Backend(tier, put, get)
        backend.closers += [pool.shutdown, raw.close]
        return backend

    return make


def s3_backend(endpoint: str, creds: dict[str, str]) -> Callable[..., Backend]:
    def make(block: int, num: int, scratch: str, staging: Staging) -> Backend:
        import uuid

        import boto3
        from botocore.config import Config

        from tiers.s3 import S3Tier, S3TierConfig

        bucket = f"bench-{uuid.uuid4().hex[:10]}"
        tier = S3Tier(S3TierConfig(bucket=bucket, endpoint_url=endpoint, region=creds["region_name"],
                                   access_key_id=creds["aws_access_key_id"],
                                   secret_access_key=creds["aws_secret_access_key"]))  # fmt: skip
        workers = tier.config.max_pool_connections
        client = boto3.session.Session().client(
            "s3", endpoint_url=endpoint, config=Config(max_pool_connections=workers), **creds
        )
        client.create_bucket(Bucket=bucket)
        pool = ThreadPoolExecutor(workers)

        def put(items: Items) -> None:
            list(pool.map(lambda kv: client.put_object(Bucket=bucket, Key="raw/" + kv[0],
                                                       Body=kv[1]), items))  # fmt: skip

        def get(keys: list[str]) -> list[Any]:
            return list(pool.map(lambda k: client.get_object(
                Bucket=bucket, Key="raw/" + k)["Body"].read(), keys))  # fmt: skip

        backend = Backend(tier, put, get)
        backend.closers.append(pool.shutdown)
        return backend

    return make


def measure(backend: Backend, items: Items, staging: Staging, size: int, repeats: int,
            puts: bool = True) -> dict[tuple[str, str], tuple[list[float], list[float]]]:  # fmt: skip
    """(op, side) -> (GB/s of each pass, latency of every call). Passes interleave the sides;
    puts come first in each pass so that the gets hit (``puts=False``: stored once, untimed)."""
    keys = [k for k, _ in items]
    num = len(items)
    chunks = [list(range(s, min(s + size, num))) for s in range(0, num, size)]
    ops: dict[tuple[str, str], Op] = {
        ("put", "tier"): lambda c: backend.tier.put_many([items[i] for i in c]),
        ("put", "base"): lambda c: backend.base_put([items[i] for i in c]),
        ("get", "tier"): lambda c: backend.tier_get([keys[i] for i in c]),
        ("get", "base"): lambda c: backend.base_get([keys[i] for i in c]),
        ("get_into", "tier"): lambda c: backend.tier.get_many_into(
            [keys[i] for i in c], staging.slots[: len(c)]
        ),
    }
    if not puts:
        for side in ("tier", "base"):
            put = ops.pop(("put", side))
            for chunk in chunks:
                put(chunk)
    out: dict[tuple[str, str], tuple[list[float], list[float]]] = {k: ([], []) for k in ops}
    nbytes = sum(len(v) for _, v in items)
    for _ in range(repeats):
        for name, op in ops.items():
            runs, lat = out[name]
            start = time.perf_counter()
            for chunk in chunks:
                t0 = time.perf_counter()
                op(chunk)
                lat.append(time.perf_counter() - t0)
            runs.append(nbytes / (time.perf_counter() - start) / 1e9)
    return out


def run_one(name: str, make: Callable[..., Backend], block: int, total: int, batch: int,
            repeats: int) -> list[Row]:  # fmt: skip
    num = max(4, min(512, total // block))
    rng = np.random.default_rng(block)
    items = [(f"bench/{name}/{i:06d}", rng.integers(0, 256, block, dtype=np.uint8).tobytes())
             for i in range(num)]  # fmt: skip
    rows = []
    staging = Staging(block, min(batch, num))
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-") as scratch:
        backend = make(block, num, scratch, staging)
        try:
            backend.tier.put_many(items[:1])  # warm connections and pools
            backend.tier_get([items[0][0]])
            for mode, size in (("single", 1), ("batched", min(batch, num))):
                res = measure(backend, items, staging, size, repeats)
                for op in ("put", "get", "get_into"):
                    (t, t_lat), (b, b_lat) = (
                        res[(op, "tier")],
                        res[("get" if op != "put" else op, "base")],
                    )
                    t_med, b_med = statistics.median(t), statistics.median(b)
                    t_lat, b_lat = sorted(t_lat), sorted(b_lat)
                    rows.append(Row(name, block, mode, op, num, round(t_med, 3),
                                    round(percentile(t_lat, 50) * 1e3, 3),
                                    round(percentile(t_lat, 99) * 1e3, 3), round(b_med, 3),
                                    round(percentile(b_lat, 50) * 1e3, 3),
                                    round(percentile(b_lat, 99) * 1e3, 3),
                                    round(t_med / b_med, 3) if b_med else 0.0,
                                    [round(x, 3) for x in t], [round(x, 3) for x in b]))  # fmt: skip
        finally:
            backend.close()
    return rows


def read_ratios(make: Callable[..., Backend], block: int, num: int, repeats: int = 5
                ) -> dict[str, Any]:  # fmt: skip
    """Batched reads of ``num`` blocks in one call, tier over baseline (median GB/s of
    ``repeats`` interleaved passes): ``{"get": ratio, "get_into": ratio, "runs": {...}}``.
    The figures the tests assert (tests/tiers/test_read_speed.py)."""
    rng = np.random.default_rng(block)
    items = [(f"speed/{i:06d}", rng.integers(0, 256, block, dtype=np.uint8).tobytes())
             for i in range(num)]  # fmt: skip
    staging = Staging(block, num)
    with tempfile.TemporaryDirectory(prefix="kvtier-speed-") as scratch:
        backend = make(block, num, scratch, staging)
        try:
            res = measure(backend, items, staging, num, repeats, puts=False)
        finally:
            backend.close()
    med = {k: statistics.median(runs) for k, (runs, _) in res.items()}
    return {"get": med[("get", "tier")] / med[("get", "base")],
            "get_into": med[("get_into", "tier")] / med[("get", "base")],
            "runs": {f"{op}/{side}": [round(x, 3) for x in runs]
                     for (op, side), (runs, _) in res.items()}}  # fmt: skip


BASELINES = {
    "host": "memcpy",
    "lmdb": "plain LMDB txn",
    "redis": "raw pipelined redis-py",
    "redis-lru": "raw pipelined redis-py",
    "s3": "raw boto3",
}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tiers", default="host,lmdb,redis,redis-lru,s3")
    p.add_argument("--sizes", default="64KiB,2MiB,8MiB")
    p.add_argument(
        "--total",
        default="192MiB",
        help="bytes moved per tier, size and call shape (at most 512 blocks)",
    )
    p.add_argument("--batch", type=int, default=32, help="keys per call in batched mode")
    p.add_argument(
        "--repeats", type=int, default=5, help="passes per measurement; the median counts"
    )
    p.add_argument("--redis-url", default=None, help="default: a private redis-server")
    p.add_argument("--s3-endpoint", default=None, help="default: a private moto server")
    p.add_argument(
        "--s3-latency-ms",
        type=float,
        default=0.0,
        help="add this delay to every S3 request, tier and raw alike (bench/latency_proxy.py): "
        "a loopback moto answering like a remote endpoint",
    )
    args = p.parse_args(argv)
    names = [t.strip() for t in args.tiers.split(",") if t.strip()]
    sizes = [parse_size(s.strip()) for s in args.sizes.split(",")]
    total = parse_size(args.total)

    started: list[Any] = []
    makers: dict[str, Callable[..., Backend]] = {"host": host_backend, "lmdb": lmdb_backend}
    if "redis" in names or "redis-lru" in names:
        url = args.redis_url
        if url is None:
            from tests.servers import RedisServer

            server = RedisServer()
            server.start()
            started.append(server)
            url = server.url
        makers["redis"], makers["redis-lru"] = redis_backend(url), redis_backend(url, lru=True)
    if "s3" in names:
        from tests.servers import S3Server

        s3 = S3Server()
        if args.s3_endpoint is None:
            s3.start()
            started.append(s3)
        endpoint = args.s3_endpoint or s3.endpoint_url
        if args.s3_latency_ms > 0:
            from urllib.parse import urlsplit

            from bench.latency_proxy import DelayProxy

            where = urlsplit(endpoint)
            proxy = DelayProxy(where.hostname or "127.0.0.1", where.port or 80,
                               args.s3_latency_ms / 1e3)  # fmt: skip
            endpoint = f"http://127.0.0.1:{proxy.start()}"
            started.append(proxy)
        makers["s3"] = s3_backend(endpoint, s3.credentials())
    rows: list[Row] = []
    try:
        for name in names:
            for size in sizes:
                rows += run_one(name, makers[name], size, total, args.batch, args.repeats)
    finally:
        for server in started:
            server.cleanup()
    plain = {(r.block_bytes, r.mode, r.op): r.tier_gbps for r in rows if r.tier == "redis"}
    lru_vs_plain = [{"block_bytes": r.block_bytes, "mode": r.mode, "op": r.op,
                     "ratio": round(r.tier_gbps / plain[(r.block_bytes, r.mode, r.op)], 3)}
                    for r in rows if r.tier == "redis-lru" and plain.get((r.block_bytes, r.mode, r.op))]  # fmt: skip
    print(json.dumps({"benchmark": "tiers", "machine": machine_info(), "baselines": BASELINES,
                      "s3_latency_ms": args.s3_latency_ms,
                      "rows": [asdict(r) for r in rows], "lru_vs_plain": lru_vs_plain},
                     indent=1))  # fmt: skip
    parts = [f"{r.tier} {r.op} {r.tier_gbps:.2f}GB/s = {r.ratio:.2f}x {BASELINES[r.tier]}"
             for r in rows if r.mode == "batched" and r.block_bytes == 2 << 20]  # fmt: skip
    parts += [f"redis-lru/redis {c['op']} {c['ratio']:.2f}x" for c in lru_vs_plain
              if c["mode"] == "batched" and c["block_bytes"] == 2 << 20]  # fmt: skip
    machine = machine_info()
    where = f"{machine['cpu_count']} CPUs, {machine['cpu_model'] or machine['platform']}"
    if args.s3_latency_ms > 0 and "s3" in names:
        where += f"; S3 requests +{args.s3_latency_ms:g} ms"
    print(
        f"summary ({where}; batched 2 MiB blocks, median of {args.repeats}): "
        + "; ".join(parts or [f"{len(rows)} rows"])
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
