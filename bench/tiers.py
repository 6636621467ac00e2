"""Tier throughput and latency, each beside a raw baseline measured in the same run.

For every tier, block size and call shape (``single``: one key per call, ``batched``: ``--batch``
keys per call) it times ``put_many`` then ``get_many`` over the same keys, and the same bytes
through the baseline:

    host   numpy copy into a preallocated buffer (memcpy)   get = get_many + copy out of the slab
    lmdb   one plain file per block: write() / read()        (page cache, no fsync, like the tier)
    redis  raw redis-py SET / GET (hiredis), pipelined when batched
    redis-lru  the same, the tier's ``capacity`` set (LRU bookkeeping in Lua, room for twice the
           working set: no evictions); ``lru_vs_plain`` compares it with the plain Redis tier
    s3     raw boto3 put_object / get_object, one object per block, parallel when batched

Redis and S3 are private redis-server / moto servers on loopback (tests/servers.py) unless
``--redis-url`` / ``--s3-endpoint`` name real ones. Prints one JSON document (machine info,
rows with GB/s, p50/p99 latency and the tier/baseline ratio) and a one-line summary.

    .venv/bin/python bench/tiers.py [--tiers host,lmdb] [--sizes 64KiB,2MiB] [--total 64MiB]
"""

from __future__ import annotations

import argparse
import json
import os
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


@dataclass(frozen=True, slots=True)
class Timing:
    gbps: float
    p50_ms: float
    p99_ms: float


@dataclass(frozen=True, slots=True)
class Row:
    tier: str
    block_bytes: int
    mode: str
    op: str
    num_blocks: int
    tier_gbps: float
    tier_p50_ms: float
    tier_p99_ms: float
    base_gbps: float
    base_p50_ms: float
    base_p99_ms: float
    ratio: float  # tier GB/s / baseline GB/s


def time_calls(calls: Sequence[Callable[[], object]], nbytes: int, repeats: int) -> Timing:
    """Run ``calls`` ``repeats`` times; the fastest pass counts (the first one pays page faults
    and connection set-up, which a cache in steady state does not)."""
    best: Timing | None = None
    for _ in range(repeats):
        lat = []
        start = time.perf_counter()
        for call in calls:
            t0 = time.perf_counter()
            call()
            lat.append(time.perf_counter() - t0)
        total = time.perf_counter() - start
        lat.sort()
        run = Timing(nbytes / total / 1e9, percentile(lat, 50) * 1e3, percentile(lat, 99) * 1e3)
        if best is None or run.gbps > best.gbps:
            best = run
    assert best is not None
    return best


class Backend:
    """One tier and its baseline, set up for one block size."""

    def __init__(self, tier: Tier, put: Callable[[Items], None],
                 get: Callable[[list[str]], list[Any]],
                 tier_get: Callable[[list[str]], object] | None = None) -> None:  # fmt: skip
        self.tier, self.base_put, self.base_get = tier, put, get
        self.tier_get = tier_get or tier.get_many

    def close(self) -> None:
        self.tier.close()


def host_backend(block: int, num: int, scratch: str) -> Backend:
    from tiers.host import HostTier

    tier = HostTier(capacity_bytes=num * block, slot_bytes=block)
    slab = np.empty(num * block, dtype=np.uint8)
    index: dict[str, int] = {}
    out = np.empty(block, dtype=np.uint8)

    def put(items: Items) -> None:
        for key, val in items:
            slot = index.setdefault(key, len(index))
            slab[slot * block : (slot + 1) * block] = np.frombuffer(val, dtype=np.uint8)

    def get(keys: list[str]) -> list[Any]:
        for key in keys:
            out[:] = slab[index[key] * block : (index[key] + 1) * block]
        return keys

    def tier_get(keys: list[str]) -> None:  # the consumer copies out of the slab, like memcpy
        for view in tier.get_many(keys):
            out[:] = np.frombuffer(view, dtype=np.uint8)  # type: ignore[arg-type]

    return Backend(tier, put, get, tier_get)


def lmdb_backend(block: int, num: int, scratch: str) -> Backend:
    from tiers.lmdb import LmdbTier

    tier = LmdbTier(os.path.join(scratch, "lmdb"), capacity_bytes=2 * num * block + (64 << 20))
    files = os.path.join(scratch, "files")
    os.makedirs(files, exist_ok=True)

    def put(items: Items) -> None:
        for key, val in items:
            with open(os.path.join(files, key.replace("/", "_")), "wb") as f:
                f.write(val)

    def get(keys: list[str]) -> list[Any]:
        out = []
        for key in keys:
            with open(os.path.join(files, key.replace("/", "_")), "rb") as f:
                out.append(f.read())
        return out

    return Backend(tier, put, get)


def redis_backend(url: str, lru: bool = False) -> Callable[[int, int, str], Backend]:
    def make(block: int, num: int, scratch: str) -> Backend:
        import redis

        from tiers.redis import RedisTier, RedisTierConfig

        capacity = 2 * num * block if lru else None
        tier = RedisTier(RedisTierConfig(url=url, key_prefix="bench:", capacity=capacity))
        raw = redis.Redis.from_url(url)
        raw.flushdb()

        def put(items: Items) -> None:
            pipe = raw.pipeline(transaction=False)
            for key, val in items:
                pipe.set("raw:" + key, val)
            pipe.execute()

        def get(keys: list[str]) -> list[Any]:
            pipe = raw.pipeline(transaction=False)
            for key in keys:
                pipe.get("raw:" + key)
            return list(pipe.execute())

        return Backend(tier, put, get)

    return make


def s3_backend(endpoint: str, creds: dict[str, str]) -> Callable[[int, int, str], Backend]:
    def make(block: int, num: int, scratch: str) -> Backend:
        import uuid

        import boto3

        from tiers.s3 import S3Tier, S3TierConfig

        bucket = f"bench-{uuid.uuid4().hex[:10]}"
        client = boto3.session.Session().client("s3", endpoint_url=endpoint, **creds)
        client.create_bucket(Bucket=bucket)
        tier = S3Tier(S3TierConfig(bucket=bucket, endpoint_url=endpoint, region=creds["region_name"],
                                   access_key_id=creds["aws_access_key_id"],
                                   secret_access_key=creds["aws_secret_access_key"]))  # fmt: skip
        pool = ThreadPoolExecutor(32)

        def put(items: Items) -> None:
            list(pool.map(lambda kv: client.put_object(Bucket=bucket, Key="raw/" + kv[0],
                                                       Body=kv[1]), items))  # fmt: skip

        def get(keys: list[str]) -> list[Any]:
            return list(pool.map(lambda k: client.get_object(
                Bucket=bucket, Key="raw/" + k)["Body"].read(), keys))  # fmt: skip

        backend = Backend(tier, put, get)
        backend.close = lambda: (tier.close(), pool.shutdown())  # type: ignore[method-assign]
        return backend

    return make


def run_one(name: str, make: Callable[[int, int, str], Backend], block: int, total: int,
            batch: int, repeats: int) -> list[Row]:  # fmt: skip
    num = max(4, min(512, total // block))
    rng = np.random.default_rng(block)
    items = [(f"bench/{name}/{i:06d}", rng.integers(0, 256, block, dtype=np.uint8).tobytes())
             for i in range(num)]  # fmt: skip
    keys = [k for k, _ in items]
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-") as scratch:
        backend = make(block, num, scratch)
        try:
            backend.tier.put_many(items[:1])  # warm connections and pools
            backend.tier_get(keys[:1])
            for mode, size in (("single", 1), ("batched", min(batch, num))):
                chunks = [list(range(s, min(s + size, num))) for s in range(0, num, size)]
                ops: dict[tuple[str, str], Callable[[list[int]], object]] = {
                    ("put", "tier"): lambda c: backend.tier.put_many([items[i] for i in c]),
                    ("put", "base"): lambda c: backend.base_put([items[i] for i in c]),
                    ("get", "tier"): lambda c: backend.tier_get([keys[i] for i in c]),
                    ("get", "base"): lambda c: backend.base_get([keys[i] for i in c]),
                }  # timed in this order: puts first, so that the gets hit
                res = {k: time_calls([lambda c=c, f=f: f(c) for c in chunks], num * block, repeats)
                       for k, f in ops.items()}  # fmt: skip
                for op in ("put", "get"):
                    t, b = res[(op, "tier")], res[(op, "base")]
                    rows.append(Row(name, block, mode, op, num, round(t.gbps, 3),
                                    round(t.p50_ms, 3), round(t.p99_ms, 3), round(b.gbps, 3),
                                    round(b.p50_ms, 3), round(b.p99_ms, 3),
                                    round(t.gbps / b.gbps, 3) if b.gbps else 0.0))  # fmt: skip
        finally:
            backend.close()
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tiers", default="host,lmdb,redis,redis-lru,s3")
    p.add_argument("--sizes", default="64KiB,2MiB,8MiB")
    p.add_argument("--total", default="32MiB", help="bytes moved per tier, size and call shape")
    p.add_argument("--batch", type=int, default=32, help="keys per call in batched mode")
    p.add_argument("--repeats", type=int, default=2, help="passes per measurement; best counts")
    p.add_argument("--redis-url", default=None, help="default: a private redis-server")
    p.add_argument("--s3-endpoint", default=None, help="default: a private moto server")
    args = p.parse_args(argv)
    names = [t.strip() for t in args.tiers.split(",") if t.strip()]
    sizes = [parse_size(s.strip()) for s in args.sizes.split(",")]
    total = parse_size(args.total)

    started: list[Any] = []
    makers: dict[str, Callable[[int, int, str], Backend]] = {
        "host": host_backend, "lmdb": lmdb_backend}
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
        makers["s3"] = s3_backend(args.s3_endpoint or s3.endpoint_url, s3.credentials())
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
    print(json.dumps({"benchmark": "tiers", "machine": machine_info(),
                      "rows": [asdict(r) for r in rows], "lru_vs_plain": lru_vs_plain},
                     indent=1))  # fmt: skip
    parts = [f"{r.tier} {r.block_bytes >> 10}KiB {r.mode} {r.op} {r.tier_gbps:.2f}GB/s "
             f"({r.ratio:.2f}x {'memcpy' if r.tier == 'host' else 'raw'})"
             for r in rows if r.mode == "batched" and r.block_bytes == 2 << 20]  # fmt: skip
    parts += [f"redis-lru/redis {c['op']} {c['ratio']:.2f}x" for c in lru_vs_plain
              if c["mode"] == "batched" and c["block_bytes"] == 2 << 20]  # fmt: skip
    print("summary: " + "; ".join(parts or [f"{len(rows)} rows"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
