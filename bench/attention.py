"""Decode attention in CUDA graphs: the Triton split-KV kernel vs FlashInfer's graph-mode decode
wrapper, side by side in one run (Llama-3-8B attention shape: 32 q heads, 8 kv heads, 128 dims,
bf16, page 16, the engine's block-major cache of 32 layers).

For each batch size and context length: one CUDA graph of 32 attention calls (one per layer,
as a decode step runs them), replayed back to back; GPU time per layer, and the host time of
``plan_cuda_graph`` (what each step spends before its replay). The two kernels' outputs are
compared on the same step (max abs difference, bf16).

    python -m bench.attention [--batches 1,8,32] [--contexts 512,4096,16384] [--out FILE]
        [--sweep] [--appends 16@4096,16@16384]

``--appends Q@CTX``: one request's Q newest tokens over CTX tokens of KV in an eager step (a
reload's first forward): FlashInfer's prefill wrapper vs the Triton kernel with causal rows.

Prints JSON and a one-line summary; needs CUDA and FlashInfer.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch

from bench.common import cuda_graph_us, emit_report, machine_info

LAYERS, HEADS, KV_HEADS, DIM, PAGE = 32, 32, 8, 128, 16
MAX_CACHE_BYTES = 24 << 30  # skip (batch, context) points whose cache would be larger


def _case(context: int, query_lens: list[int], seed: int) -> tuple[Any, Any, int]:
    """A 32-layer block-major cache of random bf16, one page table of ``context`` tokens per
    request with the pages scattered over the cache, and the step's metadata: request ``i``
    brings its ``query_lens[i]`` newest tokens. Returns (cache, metadata, pages a request)."""
    from engine.attention.base import AttentionMetadata
    from engine.kv_cache import KVCache, KVCacheSpec

    dev = torch.device("cuda")
    batch, pages = len(query_lens), -(-context // PAGE)
    spec = KVCacheSpec(num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=DIM, dtype=torch.bfloat16)
    kv = KVCache(spec, batch * pages + 1, dev)
    kv.tensor.normal_()
    perm = torch.randperm(batch * pages, generator=torch.Generator().manual_seed(seed)).tolist()
    tables = [perm[i * pages : (i + 1) * pages] for i in range(batch)]
    slots = [
        t[p // PAGE] * PAGE + p % PAGE
        for t, n in zip(tables, query_lens, strict=True)
        for p in range(context - n, context)
    ]
    cu = [0]
    for n in query_lens:
        cu.append(cu[-1] + n)
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=dev),
        block_tables=torch.zeros(batch, 1, dtype=torch.int32, device=dev),
        slot_mapping=torch.tensor(slots, device=dev),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=[context] * batch,
        block_size=PAGE,
        block_tables_cpu=tables,
    )
    return kv, meta, pages


def _bound(**kw: str) -> Any:
    """A FlashInfer backend of the bench's shape (``graph_decode``/``small_query`` from
    ``kw``), bound to bf16 on the GPU."""
    from engine.attention.flashinfer_backend import FlashInferAttentionBackend

    backend = FlashInferAttentionBackend(HEADS, KV_HEADS, DIM, DIM**-0.5, **kw)
    backend.bind(torch.bfloat16, torch.device("cuda"))
    return backend


def _layers(backend: Any, kv: Any, q: torch.Tensor, outs: list[torch.Tensor]) -> None:
    """One attention call per layer, as a decode step runs them; outputs into ``outs``."""
    outs.clear()
    for layer in range(LAYERS):
        outs.append(backend.forward(layer, q, q, q, kv.layer_view(layer), kv_written=True))


# (block_n, num_warps, num_stages, programs_per_sm) tried by --sweep (the engine's choice per
# batch size: engine.kernels.decode_attention.decode_config)
SWEEP = [
    (64, 4, 2, 2),
    (64, 4, 3, 2),
    (128, 4, 2, 2),
    (128, 8, 3, 2),
    (64, 4, 2, 8),
    (64, 4, 3, 8),
    (128, 4, 2, 8),
    (32, 4, 3, 8),
    (64, 4, 3, 4),
    (128, 8, 3, 8),
]


def sweep_configs(
    meta: Any, kv: Any, q: torch.Tensor, batch: int, pages: int, reps: int, ref: torch.Tensor
) -> list[dict[str, Any]]:
    """The Triton kernel alone under each SWEEP configuration (us per layer in a graph of 32
    layers, and the largest difference from the default's output)."""
    from engine.kernels import decode_attention as da

    backend = _bound(graph_decode="triton")
    backend.plan_cuda_graph(meta, batch, batch * pages)
    (indptr, indices, last), _, _ = backend._triton_call
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for block_n, warps, stages, per_sm in SWEEP:
        splits = da.num_splits_for(batch, KV_HEADS, sms, per_sm)

        def step(
            outs: list[torch.Tensor], cfg: tuple[int, ...] = (splits, block_n, warps, stages)
        ) -> None:
            outs.clear()
            for layer in range(LAYERS):
                outs.append(
                    da.paged_decode_attention(
                        q, kv.layer_view(layer), indptr, indices, last, DIM**-0.5, *cfg
                    )
                )

        outs: list[torch.Tensor] = []
        try:
            us = cuda_graph_us(lambda o=outs, f=step: f(o), reps) / LAYERS
            diff = float((outs[0].float() - ref.view_as(outs[0]).float()).abs().max())
            rows.append(
                {
                    "config": [block_n, warps, stages, per_sm],
                    "splits": splits,
                    "us_per_layer": round(us, 2),
                    "max_abs_diff": diff,
                }
            )
        except Exception as exc:  # a configuration that does not compile is reported
            rows.append({"config": [block_n, warps, stages, per_sm], "error": str(exc)[:200]})
    return rows


def measure(batch: int, context: int, reps: int, sweep: bool = False) -> dict[str, Any]:
    kv, meta, pages = _case(context, [1] * batch, batch * 7 + context)
    q = torch.randn(batch, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    row: dict[str, Any] = {"batch": batch, "context": context}
    outputs = {}
    for impl in ("triton", "flashinfer"):
        backend = _bound(graph_decode=impl)
        backend.plan_cuda_graph(meta, batch, batch * pages)
        host = []
        for _ in range(20):
            t0 = time.perf_counter()
            backend.plan_cuda_graph(meta, batch, batch * pages)
            host.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
        outs: list[torch.Tensor] = []
        us = cuda_graph_us(lambda o=outs, b=backend, c=kv: _layers(b, c, q, o), reps)
        row[f"{impl}_us_per_layer"] = round(us / LAYERS, 2)
        row[f"{impl}_plan_host_us"] = round(sorted(host)[len(host) // 2] * 1e6, 1)
        outputs[impl] = outs[0].clone()
        del outs, backend
    row["speedup"] = round(row["flashinfer_us_per_layer"] / row["triton_us_per_layer"], 2)
    if sweep:
        row["sweep"] = sweep_configs(meta, kv, q, batch, pages, reps, outputs["triton"])
    row["max_abs_diff"] = float(
        (outputs["triton"].float() - outputs["flashinfer"].float()).abs().max()
    )
    del kv
    torch.cuda.empty_cache()
    return row


def measure_append(context: int, q_len: int, reps: int) -> dict[str, Any]:
    """One request's ``q_len`` newest tokens over ``context`` tokens of KV, an eager step (as
    a reload's first forward runs): FlashInfer's prefill wrapper against the Triton kernel
    (``small_query="triton"``), 32 layers' calls timed back to back with CUDA events."""
    kv, meta, _ = _case(context, [q_len], context)
    q = torch.randn(q_len, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    row: dict[str, Any] = {"context": context, "query_tokens": q_len}
    outs = {}
    for impl in ("triton", "flashinfer"):
        backend = _bound(small_query=impl)
        backend.plan(meta)
        got: list[torch.Tensor] = []
        _layers(backend, kv, q, got)  # warm-up (compile)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            _layers(backend, kv, q, got)
        end.record()
        torch.cuda.synchronize()
        row[f"{impl}_us_per_layer"] = round(start.elapsed_time(end) * 1e3 / reps / LAYERS, 2)
        row[f"{impl}_wrapper"] = backend.last_wrapper
        outs[impl] = got[0].clone()
    row["speedup"] = round(row["flashinfer_us_per_layer"] / row["triton_us_per_layer"], 2)
    row["max_abs_diff"] = float((outs["triton"].float() - outs["flashinfer"].float()).abs().max())
    del kv
    torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--contexts", default="512,4096,16384")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument(
        "--sweep", action="store_true", help="also time the Triton kernel's tile configurations"
    )
    ap.add_argument(
        "--appends",
        default="",
        metavar="Q@CTX,...",
        help="also time eager short appends, e.g. 16@4096,16@16384 (Triton vs FlashInfer prefill)",
    )
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "needs CUDA", "machine": machine_info()}))
        return 0
    rows = []
    bytes_per_page = LAYERS * 2 * PAGE * KV_HEADS * DIM * 2
    for batch in (int(b) for b in args.batches.split(",")):
        for context in (int(c) for c in args.contexts.split(",")):
            if batch * -(-context // PAGE) * bytes_per_page > MAX_CACHE_BYTES:
                continue
            rows.append(measure(batch, context, args.reps, args.sweep))
            print(json.dumps(rows[-1]), flush=True)
    appends = []
    for item in filter(None, args.appends.split(",")):
        q_len, context = (int(x) for x in item.split("@"))
        appends.append(measure_append(context, q_len, args.reps))
        print(json.dumps(appends[-1]), flush=True)
    summary = (
        "decode attention triton vs flashinfer (us/layer): "
        + ", ".join(
            f"b{r['batch']}/{r['context']} {r['triton_us_per_layer']}/{r['flashinfer_us_per_layer']} "
            f"({r['speedup']}x)"
            for r in rows
        )
        + "".join(
            f", append {r['query_tokens']}@{r['context']} {r['triton_us_per_layer']}/"
            f"{r['flashinfer_us_per_layer']} ({r['speedup']}x)"
            for r in appends
        )
    )
    emit_report(
        {
            "benchmark": "attention",
            "machine": machine_info(),
            "argv": sys.argv[1:],
            "rows": rows,
            "appends": appends,
            "summary": summary,
        },
        args.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
