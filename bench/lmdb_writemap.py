"""LMDB tier writes through the map (``writemap: true``) or through ``write(2)`` (the default).

Each run opens a fresh ``LmdbTier`` of ``--capacity`` in ``--dir``, fills it with 2 MiB values
(8 a ``put_many``, as the write-through path batches), then writes as much again so that every
put evicts and reuses freed pages. Meanwhile the main thread runs a fixed loop of small torch
ops and Python allocations (the engine thread's launches stand-in) and times its own CPU per
loop (``time.thread_time``): a writer that disturbs the rest of the process shows there. Runs
alternate writemap on / off (``--runs`` each, a fresh directory each time).

Why: through the map, the kernel's writeback of dirty shared-mapped pages must write-protect
them again (TLB flushes across the process's threads) once dirty pages pass its background
threshold (``vm.dirty_background_ratio``, 10% of RAM by default). Below it, the map is faster;
past it, slower for the writer and for every other thread. Use a ``--capacity`` above 10% of
this machine's RAM to see the second regime, below to see the first.

Prints JSON (per run: put GB/s fresh and evicting, the side loop's CPU ms p50 / p90; the
machine; the dirty thresholds) and a one-line summary (medians over runs).

    python -m bench.lmdb_writemap [--dir /var/tmp] [--capacity 6GiB] [--runs 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import threading
import time
from typing import Any

from bench.common import emit_report, machine_info, percentile
from tiers.sizes import parse_size

VALUE_BYTES = 2 << 20
PER_CALL = 8


def side_loop_ms() -> float:
    """CPU ms of the main thread for one fixed loop of small ops (launch-like work)."""
    import torch

    x, w = torch.randn(64, 256), torch.randn(256, 256)
    t = time.thread_time()
    for _ in range(300):
        torch.nn.functional.linear(x, w).relu()
        _ = [object() for _ in range(50)]
    return (time.thread_time() - t) * 1e3


def one_run(directory: str, capacity: int, writemap: bool) -> dict[str, Any]:
    from tiers.lmdb import LmdbTier

    path = tempfile.mkdtemp(prefix=f"writemap{int(writemap)}-", dir=directory)
    tier = LmdbTier(path, capacity, writemap=writemap)
    value = os.urandom(VALUE_BYTES)
    count = capacity // VALUE_BYTES
    rates: dict[str, float] = {}

    def writer() -> None:
        for phase in ("fresh", "evicting"):
            t = time.perf_counter()
            for i in range(0, count, PER_CALL):
                tier.put_many([(f"{phase}{i + j}", value) for j in range(PER_CALL)])
            rates[phase] = count * VALUE_BYTES / (time.perf_counter() - t) / 1e9

    thread = threading.Thread(target=writer)
    try:
        thread.start()
        loops = []
        while thread.is_alive():
            loops.append(side_loop_ms())
        thread.join()
    finally:
        tier.close()
        shutil.rmtree(path, ignore_errors=True)
    loops.sort()
    return {
        "writemap": writemap,
        "put_fresh_gbps": round(rates["fresh"], 3),
        "put_evicting_gbps": round(rates["evicting"], 3),
        "side_loop_cpu_ms_p50": round(percentile(loops, 50), 1),
        "side_loop_cpu_ms_p90": round(percentile(loops, 90), 1),
        "side_loops": len(loops),
    }


def _sysctl(name: str) -> str | None:
    try:
        with open(f"/proc/sys/vm/{name}") as f:
            return f.read().strip()
    except OSError:
        return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dir", default="/var/tmp", help="where the LMDB directories go (a disk)")
    p.add_argument("--capacity", default="6GiB", help="tier capacity: written fresh, then again")
    p.add_argument("--runs", type=int, default=2, help="runs of each setting, alternating")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    capacity = parse_size(args.capacity, "--capacity")
    side_loop_ms()  # torch's first-call costs out of the first run
    quiet = sorted(side_loop_ms() for _ in range(9))[4]
    runs = [one_run(args.dir, capacity, wm) for _ in range(args.runs) for wm in (True, False)]

    def med(wm: bool, field: str) -> float:
        return statistics.median(r[field] for r in runs if r["writemap"] is wm)

    parts = []
    for wm, name in ((True, "writemap"), (False, "write(2)")):
        parts.append(
            f"{name} put fresh {med(wm, 'put_fresh_gbps'):.2f} / evicting "
            f"{med(wm, 'put_evicting_gbps'):.2f} GB/s, side loop CPU p50 "
            f"{med(wm, 'side_loop_cpu_ms_p50'):.0f} p90 {med(wm, 'side_loop_cpu_ms_p90'):.0f} ms"
        )
    summary = (
        f"lmdb_writemap ({args.capacity}, {args.runs} runs each, quiet side loop {quiet:.0f} ms): "
        + "; ".join(parts)
    )
    report = {
        "machine": machine_info(),
        "dir": args.dir,
        "capacity": args.capacity,
        "dirty_background_ratio": _sysctl("dirty_background_ratio"),
        "dirty_ratio": _sysctl("dirty_ratio"),
        "quiet_side_loop_cpu_ms": round(quiet, 1),
        "runs": runs,
        "summary": summary,
    }
    emit_report(report, args.out)


if __name__ == "__main__":
    main()
