"""How fast can a reload's host -> GPU copies be issued and run, whole blocks or a group of
layers at a time? The question behind layer-wise in-step loads of raw blocks
(``connectors/device/copy.py``): a step's forward can start on its first layers while later
ones land only if each block moves in pieces, and pieces cost host time to issue and copy-engine
time per copy.

Usage: python -m bench.h2d_pieces [--blocks 508] [--reps 5]   (CUDA only)

Llama-3-8B's block (32 layers, 8 KV heads, 128 dims, bf16, 16 tokens: 2 MiB). ``--blocks``
payloads in consecutive slots of a pinned slab (with a header, as the host tier keeps them) go
to random blocks of a 1,200-block cache through ``SlabCopier``: per block by torch ``copy_``
(the old path), per block by the driver, layer-wise by one driver copy per block and group
with 16, 8, 4 and 2 layers a copy (``staged_layers`` False), and layer-wise staged
(``connectors/device/raw_layers.py``: one 2-D copy per run of slots and group into device
staging, then a scatter on a second stream) with 8 and 4 layers a copy; beside them the plain
use of the link: one contiguous copy of the same bytes.
Per variant (median of ``--reps``): host time to issue, GPU time from the first copy to the
last, GB/s, and the ratio to the contiguous copy. Prints JSON, then a one-line summary.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

from bench.common import cuda_missing, machine_info

HEADER = 64  # bytes before each payload in a slot, as the host tier's codec header


def _run(blocks: int, reps: int) -> dict[str, object]:
    import torch

    from connectors.device.copy import SlabCopier
    from engine.kv_cache import KVCache, KVCacheSpec

    dev = torch.device("cuda")
    spec = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    n = spec.bytes_per_block
    cache = KVCache(spec, max(1200, blocks + 1), dev)
    slot = n + HEADER
    host = torch.randint(0, 256, (blocks * slot,), dtype=torch.uint8).pin_memory()
    offsets = [i * slot + HEADER for i in range(blocks)]
    ids = random.Random(0).sample(range(cache.num_blocks), blocks)
    whole_src = torch.empty(blocks * n, dtype=torch.uint8).pin_memory()
    whole_dst = torch.empty(blocks * n, dtype=torch.uint8, device=dev)
    side = torch.cuda.Stream(dev)

    def timed(issue) -> tuple[float, float]:
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(side):
            begin.record(side)
            t0 = time.perf_counter()
            issue()
            host_s = time.perf_counter() - t0
            end.record(side)
        torch.cuda.synchronize()
        return host_s * 1e3, begin.elapsed_time(end)

    variants: dict[str, object] = {
        "contiguous": lambda: whole_dst.copy_(whole_src, non_blocking=True)
    }
    torch_copier = SlabCopier(cache, host)
    torch_copier.use_driver = False
    variants["torch_per_block"] = lambda: torch_copier.to_device(ids, offsets)
    driver = SlabCopier(cache, host)
    if driver._driver:
        variants["driver_per_block"] = lambda: driver.to_device(ids, offsets)
        for per in (16, 8, 4, 2):
            c = SlabCopier(cache, host, layered=True, layers_per_copy=per)
            c.staged_layers = False  # one driver copy per block and group
            variants[f"driver_layers_{per}"] = lambda c=c: c.to_device_layers(ids, offsets)
        for per in (8, 4):
            c = SlabCopier(cache, host, layered=True, layers_per_copy=per)
            if c._staged is not None:  # the driver's 2-D copies
                variants[f"staged_layers_{per}"] = lambda c=c: c.to_device_layers(ids, offsets)
    check = cache.byte_rows()
    out: dict[str, object] = {}
    for name, issue in variants.items():
        timed(issue)  # warm-up
        runs = [timed(issue) for _ in range(reps)]
        gpu = statistics.median(r[1] for r in runs)
        out[name] = {
            "issue_ms": round(statistics.median(r[0] for r in runs), 3),
            "gpu_ms": round(gpu, 3),
            "gb_per_s": round(blocks * n / gpu / 1e6, 1),
        }
        if name != "contiguous":  # every variant lands the same bytes
            j = blocks // 2
            if not torch.equal(check[ids[j]].cpu(), host[offsets[j] : offsets[j] + n]):
                raise RuntimeError(f"{name}: block {ids[j]} does not hold its payload")
            cache.tensor.zero_()
    base = out["contiguous"]["gpu_ms"]  # type: ignore[index]
    for row in out.values():
        row["vs_contiguous"] = round(base / row["gpu_ms"], 3)  # type: ignore[index]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=508, help="a pair of QA reloads: 2 x 254")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    if (missing := cuda_missing("h2d_pieces")) is not None:
        print(missing, file=sys.stderr)
        return 2
    res = _run(args.blocks, args.reps)
    report = {
        "bench": "h2d_pieces",
        "machine": machine_info(),
        "blocks": args.blocks,
        "results": res,
    }
    report["summary"] = f"h2d_pieces ({args.blocks} blocks of 2 MiB): " + "; ".join(
        f"{k} issue {v['issue_ms']} ms gpu {v['gpu_ms']} ms ({v['vs_contiguous']}x)"  # type: ignore[index]
        for k, v in res.items()
    )
    print(json.dumps(report, indent=1))
    print(report["summary"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
