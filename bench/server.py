"""Cache daemon throughput vs redis-server, same run: get/put of 2 MiB and 64 KiB blocks.

Backends, each a separate server process on loopback:
- ``redis``: redis-server (no persistence) through redis-py + hiredis (GET/SET, MGET/MSET batched)
- ``daemon-tcp``: ``kvtier cache-server`` (a HierarchicalStore of one host-memory tier, no LMDB
  write-through, like the memory-only redis) through tiers.remote.tier, payload frames over the
  daemon's TCP stream (``cachestore.server.doorbell``, ``tcp``: a plain socket, one daemon thread)
- ``daemon-tcp-zmq``: the same over ZMQ (``use_stream=False``: the path before the stream)
- ``daemon-shm``: the same daemon and client, same-host path: requests and replies over the
  doorbell (a Unix socket, ``cachestore.server.doorbell``); gets of host blocks read in place from the
  daemon's slab under leases (``cachestore.server.leases``: no copy at all), puts through the client's
  shared-memory segment
- ``daemon-shm-copy``: ``daemon-shm`` with leases off (``use_leases=False``): gets copied into
  the client's segment (the path before leases)
- ``daemon-shm-zmq``: the same, but requests and replies over ZMQ (the path before the doorbell)
- ``daemon-tcp-cpu``: ``daemon-tcp`` against a second daemon started with ``--loop-cpu``
  (its loop and ZMQ I/O threads on one CPU; ``--loop-cpu N`` picks it, default 0)
For each: block size x {single key, batched} x {1, N concurrent client processes}, for
``--seconds`` each, split into ``--rounds`` rounds that alternate the backends (best round kept). Gets return bytes (redis) or memoryviews (daemon); ``--touch`` copies every
value once on the client too (``bytes(view)``, daemon only: redis's values are bytes already),
for an apples-to-apples "bytes in my hands" figure; ``--sink`` copies every value, of every
backend, into one reused buffer instead, as an engine copies blocks into its own memory.

Prints one JSON document (machine, per-case GB/s, ratios against redis) and a one-line summary.
Usage: .venv/bin/python bench/server.py [--seconds 2] [--clients 4] [--rounds 3] [--touch | --sink]
       [--sizes 2MiB,64KiB] [--ops get,put] [--modes single,batch]
       [--backends daemon-tcp,daemon-tcp-zmq,daemon-shm,daemon-shm-copy,daemon-shm-zmq,
                   daemon-tcp-cpu]
       [--loop-cpu 0]
       (redis always runs: the baseline; default backends: all but daemon-tcp-cpu)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import machine_info  # noqa: E402
from tests.servers import RedisServer, free_port  # noqa: E402

SIZES = {"2MiB": 2 << 20, "64KiB": 64 << 10}
BATCH = {"2MiB": 16, "64KiB": 64}
WORKING_SET = {"2MiB": 32, "64KiB": 256}
DAEMON_KINDS = {
    "daemon-tcp": "tcp_vs_redis",
    "daemon-tcp-zmq": "tcp_zmq_vs_redis",
    "daemon-shm": "shm_vs_redis",
    "daemon-shm-copy": "shm_copy_vs_redis",
    "daemon-shm-zmq": "shm_zmq_vs_redis",
    "daemon-tcp-cpu": "tcp_cpu_vs_redis",
}  # backend -> its ratio's field


def _subset(ap: argparse.ArgumentParser, flag: str, value: str, allowed: list[str]) -> list[str]:
    """The comma-separated ``value`` as a list, in ``allowed``'s order; exits on a bad name."""
    picked = [s for s in value.split(",") if s]
    if not picked or any(s not in allowed for s in picked):
        ap.error(f"{flag} takes a comma-separated subset of {allowed}")
    return [s for s in allowed if s in picked]


def _block(key: str, size: int) -> bytes:
    """Random bytes as one encoded block of exactly ``size`` bytes for ``key``'s namespace (the
    daemon refuses anything else; redis gets the same bytes)."""
    from cachestore.codec import BlockMeta, encode_block, encoded_size

    ns = key.split("/", 1)[0]
    n = size - encoded_size(BlockMeta("uint8", (0,), "bench", ns))
    return encode_block(os.urandom(n), BlockMeta("uint8", (n,), "bench", ns))


def _client(kind: str, url: str) -> Any:
    if kind == "redis":
        import redis

        return redis.Redis.from_url(url)
    from tiers.remote.tier import RemoteTier

    return RemoteTier(
        url,
        use_shm=kind.startswith("daemon-shm"),
        use_doorbell=kind in ("daemon-shm", "daemon-shm-copy"),
        use_leases=(kind == "daemon-shm"),
        use_stream=(kind != "daemon-tcp-zmq"),
        timeout_s=30.0,
        batch_keys=64,
    )


def _worker(
    kind: str,
    url: str,
    op: str,
    size: int,
    batch: int,
    keys: list[str],
    seconds: float,
    touch: str,
    start: Any,
    out: Any,
) -> None:
    client = _client(kind, url)
    payload = _block(keys[0], size)
    sink = memoryview(bytearray(size * batch)) if touch == "sink" else None
    # Warm up: connections, the shm segment at full size, page faults.
    _one(client, kind, op, keys[:batch], payload, touch, sink)
    _one(client, kind, op, keys[:batch], payload, touch, sink)
    start.wait()
    moved, calls, i = 0, 0, 0
    in_place0 = getattr(client, "num_in_place", 0)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        chunk = [keys[(i + j) % len(keys)] for j in range(batch)]
        i += batch
        moved += _one(client, kind, op, chunk, payload, touch, sink)
        calls += 1
    # Values read in place (leased views of the daemon's slab) during the timed part.
    out.put(
        (moved, time.perf_counter() - t0, calls, getattr(client, "num_in_place", 0) - in_place0)
    )
    if kind != "redis":
        client.close()


def _one(
    client: Any,
    kind: str,
    op: str,
    keys: list[str],
    payload: bytes,
    touch: str,
    sink: memoryview | None = None,
) -> int:
    if kind == "redis":
        if op == "put":
            if len(keys) == 1:
                client.set(keys[0], payload)
            else:
                client.mset({k: payload for k in keys})
            return len(payload) * len(keys)
        values = [client.get(keys[0])] if len(keys) == 1 else client.mget(keys)
    else:
        if op == "put":
            client.put_many([(k, payload) for k in keys])
            return len(payload) * len(keys)
        values = client.get_many(keys)
        if touch == "bytes":
            values = [bytes(v) for v in values]
    assert all(v is not None and len(v) == len(payload) for v in values), "bench miss"
    if sink is not None:
        for j, v in enumerate(values):
            sink[j * len(v) : (j + 1) * len(v)] = v
    return sum(len(v) for v in values)


def run_case(
    kind: str,
    url: str,
    op: str,
    size_name: str,
    batched: bool,
    clients: int,
    seconds: float,
    touch: str,
) -> tuple[float, int, int]:
    """GB/s over all clients, values got in place and values moved (blocks)."""
    size = SIZES[size_name]
    batch = BATCH[size_name] if batched else 1
    ctx = mp.get_context("fork")
    start, out = ctx.Barrier(clients + 1), ctx.Queue()
    procs = []
    for c in range(clients):
        keys = [f"bench{c}/{i:08x}" for i in range(WORKING_SET[size_name] // clients or 1)]
        if op == "get":  # every client reads keys that exist (written by its own put pass)
            keys = [f"bench0/{i:08x}" for i in range(WORKING_SET[size_name])]
        p = ctx.Process(
            target=_worker, args=(kind, url, op, size, batch, keys, seconds, touch, start, out)
        )
        p.start()
        procs.append(p)
    start.wait()
    results = [out.get(timeout=seconds + 60) for _ in procs]
    for p in procs:
        p.join()
    gbps = sum(r[0] for r in results) / max(r[1] for r in results) / 1e9
    return gbps, sum(r[3] for r in results), sum(r[0] for r in results) // size


def _prefill(kind: str, url: str, size_name: str) -> None:
    client = _client(kind, url)
    keys = [f"bench0/{i:08x}" for i in range(WORKING_SET[size_name])]
    _one(client, kind, "put", keys, _block(keys[0], SIZES[size_name]), "")
    if kind != "redis":
        client.close()


def _start_daemon(procs: list[subprocess.Popen[str]], cfg: str, extra: list[str]) -> str:
    """Start a memory-only ``kvtier cache-server`` (appended to ``procs``); its url."""
    port = free_port()
    procs.append(
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "engine.cli",
                "cache-server",
                "--port",
                str(port),
                "--admin-port",
                "-1",
                "--config",
                cfg,
                "--max-keys",
                "4096",
                *extra,
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
    )
    assert procs[-1].stdout is not None and "listening" in procs[-1].stdout.readline()
    return f"tcp://127.0.0.1:{port}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--clients", type=int, default=4)
    copy = ap.add_mutually_exclusive_group()
    copy.add_argument(
        "--touch", action="store_true", help="bytes() of each got daemon value on the client"
    )
    copy.add_argument(
        "--sink",
        action="store_true",
        help="copy each got value (all backends) into one reused client buffer",
    )
    ap.add_argument("--sizes", default=",".join(SIZES), help=f"block sizes, of {list(SIZES)}")
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="interleaved rounds per case (each --seconds/rounds long; best kept)",
    )
    ap.add_argument("--ops", default="get,put", help="of get, put")
    ap.add_argument("--modes", default="single,batch", help="of single, batch")
    ap.add_argument(
        "--backends",
        default="daemon-tcp,daemon-shm,daemon-shm-zmq",
        help=f"daemon backends, of {list(DAEMON_KINDS)} (redis always runs)",
    )
    ap.add_argument("--loop-cpu", type=int, default=0, help="daemon-tcp-cpu's --loop-cpu")
    args = ap.parse_args()
    touch = "bytes" if args.touch else "sink" if args.sink else ""
    sizes = _subset(ap, "--sizes", args.sizes, list(SIZES))
    ops = _subset(ap, "--ops", args.ops, ["get", "put"])
    modes = _subset(ap, "--modes", args.modes, ["single", "batch"])
    backends = _subset(ap, "--backends", args.backends, list(DAEMON_KINDS))
    tmp = tempfile.mkdtemp(prefix="kvtier-bench-")
    redis_server = RedisServer(maxmemory_bytes=2 << 30)  # no persistence, like the daemon here
    procs: list[subprocess.Popen[str]] = []
    try:
        redis_server.start()
        cfg = os.path.join(tmp, "tiers.yaml")
        with open(cfg, "w") as f:
            f.write(
                "tiers:\n  - {kind: host, capacity: 1GiB, slot_bytes: 2MiB, pin_memory: false}\n"
            )
        urls = {"redis": redis_server.url}
        daemon = _start_daemon(procs, cfg, [])
        for kind in backends:
            urls[kind] = (
                _start_daemon(procs, cfg, ["--loop-cpu", str(args.loop_cpu)])
                if kind == "daemon-tcp-cpu"
                else daemon
            )
        cases: list[dict[str, Any]] = []
        for size_name in sizes:
            for kind in urls:
                _prefill(kind, urls[kind], size_name)
            for op in ops:
                for batched in [m == "batch" for m in modes]:
                    for clients in sorted({1, args.clients}):
                        row: dict[str, Any] = {
                            "size": size_name,
                            "op": op,
                            "batched": batched,
                            "clients": clients,
                        }
                        # Backends alternate, --rounds times, each case keeping its best
                        # round: load from other processes on a shared machine hits all alike.
                        best = dict.fromkeys(urls, 0.0)
                        in_place = [0, 0]  # daemon-shm's values read in place, of all
                        for _ in range(args.rounds):
                            for kind, url in urls.items():
                                gbps, leased, blocks = run_case(
                                    kind,
                                    url,
                                    op,
                                    size_name,
                                    batched,
                                    clients,
                                    args.seconds / args.rounds,
                                    touch,
                                )
                                best[kind] = max(best[kind], gbps)
                                if kind == "daemon-shm" and op == "get":
                                    in_place = [in_place[0] + leased, in_place[1] + blocks]
                        row.update({kind: round(v, 3) for kind, v in best.items()})
                        if in_place[1]:
                            row["shm_in_place"] = round(in_place[0] / in_place[1], 3)
                        for kind, ratio in DAEMON_KINDS.items():
                            if kind in row:
                                row[ratio] = round(row[kind] / row["redis"], 2)
                        cases.append(row)
                        print(json.dumps(row), file=sys.stderr, flush=True)
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
        redis_server.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)
    print(
        json.dumps(
            {
                "bench": "server",
                "unit": "GB/s",
                "machine": machine_info(),
                "seconds": args.seconds,
                "rounds": args.rounds,
                "touch": touch,
                "cases": cases,
            },
            indent=1,
        )
    )
    big = [c for c in cases if c["size"] == "2MiB" and c["clients"] == 1]
    summary = ", ".join(
        f"{c['op']}{'-batch' if c['batched'] else ''} "
        + " ".join(
            f"{kind[len('daemon-') :]} {c[ratio]}x"
            for kind, ratio in DAEMON_KINDS.items()
            if ratio in c
        )
        for c in big
    )
    print(f"server bench (2 MiB, 1 client, vs redis GB/s): {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
