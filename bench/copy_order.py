"""Does a step's small host -> device upload wait behind a large copy issued before it on
another stream? The question behind the runner's order (inputs up before the connector's KV
copies, async loads' copies held until the forward is queued: docs/scheduling.md).

Usage: python -m bench.copy_order [--big-mib 512] [--small-kib 64] [--reps 5]   (CUDA only)

Per repetition, on one CUDA device: a ``--big-mib`` pinned copy on a side stream, and a
``--small-kib`` pinned non-blocking copy plus a tiny kernel on the compute stream, issued
(a) after the big copy, (b) before it, and (c) alone. Reports, in ms (median of ``--reps``), the
big copy's own time and how long after the first issue the small copy's kernel finished; the
ratio a/c is how much a step's uploads are delayed by a load queued ahead of them. Prints JSON,
then a one-line summary.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from bench.common import cuda_missing, machine_info


def _run(big_mib: int, small_kib: int, reps: int) -> dict[str, object]:
    import torch

    dev = torch.device("cuda")
    big_src = torch.empty(big_mib << 20, dtype=torch.uint8).pin_memory()
    big_dst = torch.empty(big_mib << 20, dtype=torch.uint8, device=dev)
    small_src = torch.ones(small_kib << 8, dtype=torch.int32).pin_memory()
    small_dst = torch.empty(small_kib << 8, dtype=torch.int32, device=dev)
    side = torch.cuda.Stream(dev)
    compute = torch.cuda.current_stream(dev)

    def once(order: str) -> tuple[float, float]:
        torch.cuda.synchronize()
        t0 = torch.cuda.Event(enable_timing=True)
        big_end = torch.cuda.Event(enable_timing=True)
        small_end = torch.cuda.Event(enable_timing=True)
        t0.record(compute)
        side.wait_event(t0)

        def big() -> None:
            with torch.cuda.stream(side):
                big_dst.copy_(big_src, non_blocking=True)
                big_end.record(side)

        def small() -> None:
            small_dst.copy_(small_src, non_blocking=True)
            small_dst.add_(1)
            small_end.record(compute)

        if order == "after":
            big()
            small()
        elif order == "before":
            small()
            big()
        else:
            small()
            big_end.record(compute)
        torch.cuda.synchronize()
        return t0.elapsed_time(big_end), t0.elapsed_time(small_end)

    for order in ("after", "before", "alone"):  # warm-up
        once(order)
    out: dict[str, object] = {}
    for order in ("after", "before", "alone"):
        runs = [once(order) for _ in range(reps)]
        out[order] = {
            "big_ms": round(statistics.median(r[0] for r in runs), 3),
            "small_done_ms": round(statistics.median(r[1] for r in runs), 3),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--big-mib", type=int, default=512)
    ap.add_argument("--small-kib", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    if (missing := cuda_missing("copy_order")) is not None:
        print(missing, file=sys.stderr)
        return 2
    res = _run(args.big_mib, args.small_kib, args.reps)
    after, alone = res["after"], res["alone"]
    wait = after["small_done_ms"] / max(alone["small_done_ms"], 1e-6)  # type: ignore[index]
    report = {
        "bench": "copy_order",
        "machine": machine_info(),
        "big_mib": args.big_mib,
        "small_kib": args.small_kib,
        "results": res,
        "small_after_vs_alone": round(wait, 2),
    }
    report["summary"] = (
        f"copy_order: a {args.small_kib} KiB upload issued after a {args.big_mib} MiB copy on "
        f"another stream finished at {after['small_done_ms']} ms "  # type: ignore[index]
        f"(alone {alone['small_done_ms']} ms, before it "  # type: ignore[index]
        f"{res['before']['small_done_ms']} ms; the big copy {after['big_ms']} ms): "  # type: ignore[index]
        f"{wait:.1f}x"
    )
    print(json.dumps(report, indent=1))
    print(report["summary"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
