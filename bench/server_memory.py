"""Cache daemon memory under load: how far its RSS goes past its host tier (issue 16, F7).

One ``kvtier cache-server --host-capacity 256MiB`` process (with ``--data-dir``: LMDB write
through, the deployed shape), and ``--procs`` client processes of ``--threads`` RemoteTier
threads each, mixing the same-host doorbell, the TCP stream and ZMQ, over 96 keys of 2 MiB
blocks: 35% puts of 1-8 keys, 57% gets, 8% deletes, for ``--seconds``. The daemon's
``/proc/<pid>/status`` is sampled every second (RssAnon: its own buffers and queues; RssShmem:
the host slab; RssFile: LMDB's mapped pages, reclaimable by the kernel); the report has the
peak during the load and the figures 3 s after it.

Prints one JSON document (machine, samples, peaks, ops) and a one-line summary.
Usage: .venv/bin/python bench/server_memory.py [--seconds 20] [--procs 4] [--threads 4]
       [--no-data-dir] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import emit_report, machine_info  # noqa: E402

FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem")


def _status_mib(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in FIELDS:
            out[name] = int(value.split()[0]) // 1024
    return out


def client(url: str, seconds: float, seed: int, threads: int) -> None:
    """One client process: ``threads`` RemoteTier threads (doorbell, stream, ZMQ in turn)."""
    from tests.cachestore.store_helpers import sized_block
    from tiers.remote.tier import RemoteTier

    blocks = {f"app/{k:08x}": sized_block(f"app/{k:08x}", 2 << 20) for k in range(96)}
    stop = time.monotonic() + seconds
    counts = [0, 0]  # ops, errors

    def run(i: int) -> None:
        rng = random.Random(seed * 100 + i)
        mode = i % 3
        tier = RemoteTier(url, use_shm=mode == 0, use_stream=mode == 1, timeout_s=30)
        try:
            while time.monotonic() < stop:
                keys = [f"app/{rng.randrange(96):08x}" for _ in range(rng.randint(1, 8))]
                r = rng.random()
                try:
                    if r < 0.35:
                        tier.put_many([(k, blocks[k]) for k in keys])
                    elif r < 0.92:
                        tier.get_many(keys)
                    else:
                        tier.delete_many(keys[:1])
                    counts[0] += 1
                except Exception:  # noqa: BLE001 - counted, the load goes on
                    counts[1] += 1
        finally:
            tier.close()

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    print(f"{counts[0]} {counts[1]}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--no-data-dir", action="store_true", help="memory only, no LMDB")
    parser.add_argument("--out", default=None)
    parser.add_argument("--client", nargs=2, metavar=("URL", "SEED"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        client(args.client[0], args.seconds, int(args.client[1]), args.threads)
        return
    from tests.servers import free_port

    data = tempfile.mkdtemp(prefix="kvtier-bench-mem-")
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "engine.cli",
        "cache-server",
        "--port",
        str(port),
        "--admin-port",
        "-1",
        "--host-capacity",
        "256MiB",
    ]
    if not args.no_data_dir:
        cmd += ["--data-dir", data, "--lmdb-capacity", "2GiB"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    daemon = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert daemon.stdout is not None and "listening" in daemon.stdout.readline()
        url = f"tcp://127.0.0.1:{port}"
        idle = _status_mib(daemon.pid)
        clients = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--client",
                    url,
                    str(i),
                    "--seconds",
                    str(args.seconds),
                    "--threads",
                    str(args.threads),
                ],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                text=True,
            )
            for i in range(args.procs)
        ]
        samples: list[dict[str, Any]] = []
        t0 = time.monotonic()
        while any(c.poll() is None for c in clients):
            time.sleep(1.0)
            samples.append({"t_s": round(time.monotonic() - t0, 1), **_status_mib(daemon.pid)})
        ops = errors = 0
        for c in clients:
            out, _ = c.communicate()
            n, e = out.split()[-2:]
            ops, errors = ops + int(n), errors + int(e)
        time.sleep(3.0)
        after = _status_mib(daemon.pid)
    finally:
        daemon.terminate()
        daemon.wait(30)
        shutil.rmtree(data, ignore_errors=True)
    peak = {f: max(s[f] for s in samples) for f in FIELDS} if samples else {}
    report = {
        "machine": machine_info(),
        "host_capacity_mib": 256,
        "data_dir": not args.no_data_dir,
        "seconds": args.seconds,
        "clients": args.procs * args.threads,
        "ops": ops,
        "errors": errors,
        "idle_mib": idle,
        "peak_mib": peak,
        "after_mib": after,
        "samples": samples,
    }
    report["summary"] = (
        f"daemon, 256 MiB host tier, {args.procs * args.threads} clients, {ops} ops: "
        f"peak RSS {peak.get('VmRSS')} MiB (anon {peak.get('RssAnon')}, file "
        f"{peak.get('RssFile')}, slab {peak.get('RssShmem')}); 3 s after: anon "
        f"{after.get('RssAnon')} MiB"
    )
    emit_report(report, args.out)


if __name__ == "__main__":
    main()
