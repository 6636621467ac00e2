"""CPU prefill attention: kvtier's C kernel beside torch's best plain path, same inputs, one run.

For each shape (``HEADS``: query heads / KV heads / head dim) and prompt length ``T`` (a whole
causal prompt, float32): the C kernel (``engine/kernels/cpu_prefill.py``), torch's
``scaled_dot_product_attention`` (causal, GQA; torch picks its flash CPU kernel) and the
engine's own torch fallback (``causal_gemm_attention``: two GEMMs and a softmax per 128
queries). Calls are interleaved (kernel, SDPA, GEMMs, per repetition) and the median of
``--reps`` counts; GFLOP/s counts the causal half of the QK and PV products. The kernel's
outputs are compared with SDPA's (max abs difference).

    python -m bench.cpu_attention [--lengths 512,1024,2048] [--threads 1,2]
        [--shapes smollm2,llama3] [--reps 5] [--out FILE]

Prints JSON (machine, torch CPU capability, the kernel's vector width, one row per shape,
length and thread count) and a one-line summary: the kernel's time at each point and its ratio
to the faster of the two torch paths.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from bench.common import emit_report, machine_info

SHAPES = {"smollm2": (9, 3, 64), "llama3": (32, 8, 128)}


def _time(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(shape: str, length: int, threads: int, reps: int) -> dict[str, Any]:
    """One point: every path ``reps`` times, interleaved; medians in ms."""
    from engine.attention.torch_backend import causal_gemm_attention
    from engine.kernels import cpu_prefill

    heads, kv_heads, dim = SHAPES[shape]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(length, heads, dim, generator=gen)
    k = torch.randn(length, kv_heads, dim, generator=gen)
    v = torch.randn(length, kv_heads, dim, generator=gen)
    scale = dim**-0.5
    qt, kt, vt = (x.transpose(0, 1) for x in (q, k, v))

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(
            qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True
        )

    paths = {
        "kernel": lambda: cpu_prefill.prefill_attention(q, k, v, scale),
        "sdpa": sdpa,
        "gemm": lambda: causal_gemm_attention(q, k, v, scale),
    }
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for fn in paths.values():  # warm-up: build, allocate, first-touch
            fn()
        times: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(reps):
            for name, fn in paths.items():
                times[name].append(_time(fn))
        ref = sdpa().transpose(0, 1).reshape(length, -1)
        err = (paths["kernel"]() - ref).abs().max().item()
    finally:
        torch.set_num_threads(before)
    flops = 4.0 * heads * dim * length * (length + 1) / 2
    row: dict[str, Any] = {"shape": shape, "length": length, "threads": threads}
    for name, ts in times.items():
        med = statistics.median(ts)
        row[f"{name}_ms"] = round(med * 1e3, 3)
        row[f"{name}_gflops"] = round(flops / med / 1e9, 2)
    row["kernel_vs_best_torch"] = round(row["kernel_ms"] / min(row["sdpa_ms"], row["gemm_ms"]), 3)
    row["max_abs_diff_vs_sdpa"] = err
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="512,1024,2048")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--shapes", default="smollm2,llama3")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    from engine.kernels import cpu_prefill

    if not cpu_prefill.enabled():
        print("cpu_attention: the C kernel is not available here (no compiler?)", file=sys.stderr)
        return 1
    rows = [
        measure(shape, int(n), int(t), args.reps)
        for shape in args.shapes.split(",")
        for t in args.threads.split(",")
        for n in args.lengths.split(",")
    ]
    capability = torch.backends.cpu.get_cpu_capability()
    parts = [
        f"{r['shape']} T={r['length']} x{r['threads']}: {r['kernel_ms']:.1f} ms "
        f"({r['kernel_vs_best_torch']:.2f}x torch's best)"
        for r in rows
    ]
    report = {
        "machine": machine_info(),
        "cpu_capability": capability,
        "vector_floats": cpu_prefill.vector_floats(),
        "reps": args.reps,
        "rows": rows,
        "summary": f"cpu_attention ({capability}, median of {args.reps}): " + "; ".join(parts),
    }
    emit_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
