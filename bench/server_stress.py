"""Cache-server stress: many clients, two tenants on the same key names, every read verified.

Why (issue 16, F1): under concurrent put, evict and delete the daemon once served another
key's block (another tenant's too), about 1 read in 10-40K. This drives one real
``kvtier cache-server`` (memory only unless ``--data-dir``; a host tier smaller than the keys'
bytes, so slots are evicted and reused all the time) from ``--processes`` x ``--threads``
``RemoteTier`` threads, each on one transport (``TRANSPORTS``: the doorbell with shared memory
-- leases when the daemon holds one tenant --, shared memory over ZMQ, the TCP stream, plain
ZMQ), both tenants on every transport. Ops: 35% puts of 1-8 keys (a new version each time),
60% gets of 1-8 keys, 5% deletes of 1-8 keys, over ``--keys`` key names that every tenant uses.

Every payload is derived from (tenant, key, version) and starts with them, so each hit is
checked whole: the codec checksum, namespace and key, then tenant and key, then every byte
against the payload that (tenant, key, version) gives. A hit failing any of it is a wrong
read. Misses (evicted, deleted, a put that lost a race) are fine; client errors
(``TierError``) are counted. Blocks carry their key (codec version 2), so the daemon itself
turns a block it finds under another key into a miss: its ``wrong_key`` and ``corrupt``
counters (admin ``/stats``, summed over tiers) are reported too, and must stay 0 as well.

Reports JSON (config, machine, ops, hits, misses, wrong reads with the first examples, errors
by kind, per-transport counts, the daemon's RSS over time) and a one-line summary; with
``--repeat N`` N runs in a row, each against a fresh daemon (one summary line per run).
Usage: .venv/bin/python bench/server_stress.py [--seconds 30] [--processes 4] [--threads 4]
       [--block-bytes 2MiB] [--host-capacity 256MiB] [--keys 96] [--tenants 2]
       [--no-inline-reads] [--data-dir DIR] [--repeat 1] [--out FILE]
``run_stress`` is what tests/cachestore/server/test_stress.py calls (shorter, smaller).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import xxhash  # noqa: E402

from cachestore.codec import BlockMeta, CodecError, decode_block, encode_block  # noqa: E402
from tests.servers import free_port  # noqa: E402
from tiers.config import parse_size  # noqa: E402

# (name, RemoteTier options): what ``RemoteTier.transport()`` must then say, in RUN_TRANSPORT.
TRANSPORTS: dict[str, dict[str, bool]] = {
    "shm": {"use_shm": True, "use_doorbell": True},
    "shm-zmq": {"use_shm": True, "use_doorbell": False},
    "stream": {"use_shm": False, "use_stream": True},
    "zmq": {"use_shm": False, "use_stream": False},
}
TENANTS = (("tok-stress-alpha-01", "alpha"), ("tok-stress-beta-002", "beta"))
PREFIX = "app"  # the key names' namespace, the same for every tenant
TAG_BYTES = 64  # the payload's first bytes: "tenant|key|version|", zero padded
MAX_EXAMPLES = 5


@dataclass(frozen=True)
class StressConfig:
    seconds: float = 30.0
    processes: int = 4
    threads: int = 4  # per process
    block_bytes: int = 2 << 20  # payload bytes of a block (encoded: a few bytes more)
    host_capacity: int = 256 << 20
    host_slot_bytes: int = 4 << 20
    keys: int = 96
    tenants: int = 2
    inline_reads: bool = True
    data_dir: str | None = None  # LMDB under the host tier (write-through) when given
    lmdb_capacity: int = 1 << 30
    put_share: float = 0.35
    delete_share: float = 0.05
    max_batch: int = 8
    seed: int = 0
    rss_every_s: float = 1.0


def payload_for(tenant: str, key: str, version: str, nbytes: int) -> bytes:
    """The payload of (tenant, key, version): a tag naming them, then a pattern seeded by it."""
    tag = f"{tenant}|{key}|{version}|".encode().ljust(TAG_BYTES, b"\0")
    seed = xxhash.xxh3_64_digest(tag)
    return (tag + seed * ((nbytes - TAG_BYTES) // 8 + 1))[:nbytes]


def block_for(tenant: str, key: str, version: str, nbytes: int) -> bytes:
    """The encoded block, carrying ``key`` (codec version 2) as the engine's blocks do."""
    return encode_block(
        payload_for(tenant, key, version, nbytes),
        BlockMeta("uint8", (nbytes,), "stress", PREFIX),
        key=key,
    )


def check_read(tenant: str, key: str, value: Any, nbytes: int) -> str | None:
    """None when ``value`` is a block of ``key`` put by ``tenant`` (some version), whole;
    else what is wrong with it (a short description)."""
    try:
        payload = decode_block(value, PREFIX, expected_key=key).payload
    except CodecError as exc:
        return f"codec: {exc.reason}"
    head = bytes(payload[:TAG_BYTES]).rstrip(b"\0").decode(errors="replace").split("|")
    if len(head) < 3:
        return f"no tag: {head!r}"
    got_tenant, got_key, version = head[0], head[1], head[2]
    if got_tenant != tenant or got_key != key:
        return f"got {got_tenant}:{got_key} (version {version})"
    if len(payload) != nbytes or payload != payload_for(tenant, key, version, nbytes):
        return f"bytes differ from version {version}"
    return None


@dataclass
class ThreadCounts:
    ops: Counter[str] = field(default_factory=Counter)
    keys_read: int = 0
    hits: int = 0
    misses: int = 0
    wrong: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)
    transport: str = "none"
    in_place: int = 0


def _client_thread(
    cfg: StressConfig, index: int, url: str, deadline: float, counts: ThreadCounts
) -> None:
    from tiers.base import TierError
    from tiers.remote.tier import RemoteTier

    transport = list(TRANSPORTS)[index % len(TRANSPORTS)]
    token, tenant = TENANTS[(index // len(TRANSPORTS)) % cfg.tenants]
    rng = random.Random(cfg.seed * 1_000_003 + index)
    names = [f"{PREFIX}/{k:08x}" for k in range(cfg.keys)]
    tier = RemoteTier(url, token=token, timeout_s=10.0, **TRANSPORTS[transport])
    serial = 0
    try:
        while time.monotonic() < deadline:
            keys = rng.sample(names, rng.randint(1, cfg.max_batch))
            r = rng.random()
            op = (
                "put"
                if r < cfg.put_share
                else ("delete" if r < cfg.put_share + cfg.delete_share else "get")
            )
            try:
                if op == "put":
                    serial += 1
                    version = f"{index}.{serial}"
                    tier.put_many(
                        [(k, block_for(tenant, k, version, cfg.block_bytes)) for k in keys]
                    )
                elif op == "delete":
                    tier.delete_many(keys)
                else:
                    values = tier.get_many(keys)
                    counts.keys_read += len(keys)
                    for key, value in zip(keys, values, strict=True):
                        if value is None:
                            counts.misses += 1
                            continue
                        counts.hits += 1
                        wrong = check_read(tenant, key, value, cfg.block_bytes)
                        if wrong is not None:
                            counts.wrong += 1
                            if len(counts.examples) < MAX_EXAMPLES:
                                counts.examples.append(f"{transport} {tenant} get({key}): {wrong}")
                    del values  # views: valid until this thread's next call only
                counts.ops[op] += 1
            except TierError as exc:
                counts.errors[str(exc).split(":")[0][:80]] += 1
                time.sleep(0.02)  # the tier fails fast for a moment after a timeout
            counts.transport = tier.transport()
        counts.in_place = tier.num_in_place
    finally:
        tier.close()


def _client_process(
    cfg: StressConfig, proc_index: int, url: str, start_at: float
) -> list[dict[str, Any]]:
    """One client process: ``cfg.threads`` threads until ``start_at + cfg.seconds`` (wall
    clock: processes start at different times). Returns each thread's counts as a dict."""
    time.sleep(max(0.0, start_at - time.time()))
    deadline = time.monotonic() + cfg.seconds
    counts = [ThreadCounts() for _ in range(cfg.threads)]
    threads = [
        threading.Thread(
            target=_client_thread, args=(cfg, proc_index * cfg.threads + t, url, deadline, c)
        )
        for t, c in enumerate(counts)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [{**asdict(c), "ops": dict(c.ops), "errors": dict(c.errors)} for c in counts]


def _rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def start_daemon(cfg: StressConfig, workdir: str) -> tuple[subprocess.Popen[str], str, int]:
    """A ``kvtier cache-server`` child for ``cfg`` (tokens of ``cfg.tenants`` tenants);
    returns it, its ZMQ url and its admin port once it listens. Raises RuntimeError if it
    does not start."""
    tokens = os.path.join(workdir, "tokens")
    with open(tokens, "w") as f:
        f.writelines(f"{tok} {name}\n" for tok, name in TENANTS[: cfg.tenants])
    port, admin = free_port(), free_port()
    cmd = [
        sys.executable,
        "-m",
        "engine.cli",
        "cache-server",
        "--port",
        str(port),
        "--admin-host",
        "127.0.0.1",
        "--admin-port",
        str(admin),
        "--tokens",
        tokens,
        "--host-capacity",
        f"{cfg.host_capacity}B",
        "--host-slot-bytes",
        f"{cfg.host_slot_bytes}B",
    ]
    if not cfg.inline_reads:
        cmd.append("--no-inline-reads")
    if cfg.data_dir is not None:
        cmd += ["--data-dir", cfg.data_dir, "--lmdb-capacity", f"{cfg.lmdb_capacity}B"]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline() if proc.stdout is not None else ""
    if "listening" not in line:
        proc.kill()
        proc.wait(10)
        raise RuntimeError(f"cache-server did not start: {line!r}")
    return proc, f"tcp://127.0.0.1:{port}", admin


def daemon_counters(admin_port: int) -> dict[str, int] | None:
    """The daemon's ``wrong_key`` and ``corrupt`` reads summed over its tiers (admin
    ``/stats``), or None when the admin port does not answer."""
    import json
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/stats", timeout=10) as r:
            rows = json.load(r)["store"]["tiers"]
    except (OSError, ValueError, KeyError):
        return None
    return {k: sum(int(row.get(k, 0)) for row in rows) for k in ("wrong_key", "corrupt")}


def run_stress(cfg: StressConfig) -> dict[str, Any]:
    """One run against a fresh daemon: the report (no machine info; ``main`` adds it)."""
    if cfg.tenants not in (1, 2) or cfg.block_bytes <= TAG_BYTES:
        raise ValueError("tenants must be 1 or 2 and block_bytes larger than the tag")
    with tempfile.TemporaryDirectory(prefix="kvtier-stress-") as workdir:
        proc, url, admin = start_daemon(cfg, workdir)
        rss: list[tuple[float, float | None]] = []
        try:
            t0 = time.monotonic()
            start_at = time.time() + 2.0 + 0.5 * cfg.processes  # spawn + imports, all alike
            ctx = mp.get_context("spawn")
            with concurrent.futures.ProcessPoolExecutor(cfg.processes, mp_context=ctx) as pool:
                futures = [
                    pool.submit(_client_process, cfg, p, url, start_at)
                    for p in range(cfg.processes)
                ]
                while not all(f.done() for f in futures):
                    rss.append((round(time.monotonic() - t0, 1), _rss_mb(proc.pid)))
                    concurrent.futures.wait(futures, timeout=cfg.rss_every_s)
                threads = [c for f in futures for c in f.result()]
            alive = proc.poll() is None
            rss.append((round(time.monotonic() - t0, 1), _rss_mb(proc.pid)))
            counters = daemon_counters(admin) if alive else None
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
    return summarize(cfg, threads, rss, alive, counters)


def summarize(
    cfg: StressConfig,
    threads: list[dict[str, Any]],
    rss: list[tuple[float, float | None]],
    alive: bool,
    counters: dict[str, int] | None,
) -> dict[str, Any]:
    ops: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    per_transport: dict[str, dict[str, int]] = {}
    examples: list[str] = []
    for i, t in enumerate(threads):
        ops.update(t["ops"])
        errors.update(t["errors"])
        examples.extend(t["examples"])
        name = list(TRANSPORTS)[i % len(TRANSPORTS)]
        row = per_transport.setdefault(name, Counter())
        row.update(
            hits=t["hits"],
            misses=t["misses"],
            wrong=t["wrong"],
            in_place=t["in_place"],
            ops=sum(t["ops"].values()),
            errors=sum(t["errors"].values()),
        )
        row[f"seen:{t['transport']}"] += 1
    totals = {k: sum(t[k] for t in threads) for k in ("keys_read", "hits", "misses", "wrong")}
    samples = [mb for _, mb in rss if mb is not None]
    report = {
        "bench": "server_stress",
        "config": asdict(cfg),
        "daemon_alive": alive,
        "ops": dict(ops),
        "ops_total": sum(ops.values()),
        "ops_per_s": round(sum(ops.values()) / cfg.seconds, 1),
        **totals,
        "wrong_reads": totals["wrong"],
        "wrong_examples": examples[:MAX_EXAMPLES],
        "daemon_wrong_key": None if counters is None else counters["wrong_key"],
        "daemon_corrupt": None if counters is None else counters["corrupt"],
        "errors": sum(errors.values()),
        "errors_by_kind": dict(errors),
        "per_transport": {k: dict(v) for k, v in per_transport.items()},
        "rss_mb": rss,
        "rss_peak_mb": max(samples, default=None),
        "rss_last_mb": samples[-1] if samples else None,
    }
    report["summary"] = (
        f"server stress {cfg.seconds:g}s, {cfg.processes}x{cfg.threads} clients, "
        f"{cfg.tenants} tenant(s), host {cfg.host_capacity >> 20} MiB, "
        f"{cfg.block_bytes >> 10} KiB blocks: {report['ops_total']} ops, "
        f"{totals['hits']} verified hits, {totals['wrong']} wrong reads "
        f"(daemon wrong_key {report['daemon_wrong_key']}, corrupt {report['daemon_corrupt']}), "
        f"{report['errors']} errors, daemon RSS peak {report['rss_peak_mb']} MB"
        f"{'' if alive else ', DAEMON DIED'}"
    )
    return report


def main() -> int:
    from bench.common import emit_report, machine_info

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--processes", type=int, default=4)
    ap.add_argument("--threads", type=int, default=4, help="client threads per process")
    ap.add_argument("--block-bytes", default="2MiB")
    ap.add_argument("--host-capacity", default="256MiB")
    ap.add_argument("--host-slot-bytes", default="4MiB")
    ap.add_argument("--keys", type=int, default=96, help="key names (every tenant uses them)")
    ap.add_argument("--tenants", type=int, default=2, choices=(1, 2))
    ap.add_argument("--no-inline-reads", action="store_true")
    ap.add_argument("--data-dir", default=None, help="LMDB under the host tier (write-through)")
    ap.add_argument("--repeat", type=int, default=1, help="runs in a row, a fresh daemon each")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="also write the JSON report here")
    args = ap.parse_args()
    # SIGTERM: unwind (the daemon child is stopped in run_stress's finally), not just vanish.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    runs = []
    for i in range(args.repeat):
        cfg = StressConfig(
            seconds=args.seconds,
            processes=args.processes,
            threads=args.threads,
            block_bytes=parse_size(args.block_bytes),
            host_capacity=parse_size(args.host_capacity),
            host_slot_bytes=parse_size(args.host_slot_bytes),
            keys=args.keys,
            tenants=args.tenants,
            inline_reads=not args.no_inline_reads,
            data_dir=os.path.join(args.data_dir, f"run{i}") if args.data_dir else None,
            seed=args.seed + i,
        )
        runs.append(run_stress(cfg))
        print(f"run {i + 1}/{args.repeat}: {runs[-1]['summary']}", file=sys.stderr, flush=True)
    wrong = sum(r["wrong_reads"] for r in runs)
    report = {
        "bench": "server_stress",
        "machine": machine_info(),
        "runs": runs,
        "wrong_reads": wrong,
        "summary": (
            runs[0]["summary"]
            if len(runs) == 1
            else f"server stress x{len(runs)} runs of {args.seconds:g}s: "
            f"{sum(r['ops_total'] for r in runs)} ops, "
            f"{sum(r['hits'] for r in runs)} verified hits, {wrong} wrong reads "
            f"(per run: {[r['wrong_reads'] for r in runs]}), "
            f"{sum(r['errors'] for r in runs)} errors"
        ),
    }
    emit_report(report, args.out)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
