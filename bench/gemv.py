"""Batch-1 matrix-vector products: the Triton ``gemv`` (engine/kernels/gemv.py) in a few
tile configurations against cuBLAS (``F.linear``), side by side in one run, for the
Llama-3-8B projection shapes in bf16.

Each case cycles through ``--layers`` distinct weight copies inside one CUDA graph (as a
decode step reads 32 layers' weights, so nothing is served from L2), and reports GPU time per
product and TB/s of weight read. Prints JSON and a one-line summary; needs CUDA and Triton.

    python -m bench.gemv [--layers 32] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch
import torch.nn.functional as F

from bench.common import cuda_graph_us, emit_report, machine_info

SHAPES = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
CONFIGS = [  # (block_n, block_k, num_warps, num_stages)
    (4, 512, 4, 3),
    (8, 512, 4, 3),
    (8, 256, 4, 4),
    (16, 256, 4, 3),
    (8, 1024, 8, 2),
    (16, 512, 8, 3),
    (4, 1024, 4, 2),
    (2, 1024, 4, 3),
]


def measure(name: str, layers: int, reps: int) -> dict[str, Any]:
    from engine.kernels.gemv import gemv

    n, k = SHAPES[name]
    count = 2 if name == "lm_head" else layers
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(count)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    nbytes = n * k * 2
    t_ref = cuda_graph_us(lambda: [F.linear(x, w) for w in ws], reps) / count
    ref = F.linear(x, ws[0]).float()
    row: dict[str, Any] = {
        "shape": [n, k],
        "cublas_us": round(t_ref, 2),
        "cublas_tb_s": round(nbytes / t_ref / 1e6, 2),
        "configs": [],
    }
    best = None
    for cfg in CONFIGS:
        bn, bk, nw, ns = cfg
        try:
            out = gemv(x, ws[0], bn, bk, nw, ns).float()
            err = float((out - ref).abs().max() / ref.abs().max())
            t = cuda_graph_us(lambda c=cfg: [gemv(x, w, *c) for w in ws], reps) / count
        except Exception as exc:  # a config that does not compile is reported, not fatal
            row["configs"].append({"config": cfg, "error": f"{type(exc).__name__}: {exc}"[:200]})
            continue
        row["configs"].append(
            {"config": cfg, "us": round(t, 2), "tb_s": round(nbytes / t / 1e6, 2), "rel_err": err}
        )
        if best is None or t < best[1]:
            best = (cfg, t)
    if best is not None:
        row["best_config"], row["best_us"] = best[0], round(best[1], 2)
        row["speedup"] = round(t_ref / best[1], 3)
    ws.clear()
    torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "needs CUDA", "machine": machine_info()}))
        return 0
    rows = {}
    for name in SHAPES:
        rows[name] = measure(name, args.layers, args.reps)
        print(json.dumps({name: rows[name]}), flush=True)
    summary = "gemv M=1 triton best vs cublas: " + ", ".join(
        f"{k} {r.get('best_us')}/{r['cublas_us']} us ({r.get('speedup')}x)" for k, r in rows.items()
    )
    emit_report(
        {"benchmark": "gemv", "machine": machine_info(), "rows": rows, "summary": summary}, args.out
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
