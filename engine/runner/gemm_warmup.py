"""Load every GEMM kernel a prefill step can pick, at start-up, not inside a request's step.

CUDA loads a kernel on its first launch (lazy module loading, the default since CUDA 12.2), and
loading one can synchronize the context: the launching thread waits for everything already
queued on the device, in-step KV copies included, before it can queue the rest of the step.
cuBLAS picks its GEMM kernel by the row count, so a step whose token count the process has not
run before may launch a kernel no step has loaded yet. The twenty-fifth session's QA run
(docs/scheduling.md) had 15 of 34 reused steps stall 10-28 ms that way, every one of them at
a token count new to the process; ``python -m bench.new_shapes`` measures it.

``warm_gemm_shapes`` runs each distinct linear of the first decoder layer (every layer has the
same shapes) at every row count up to 2048 (every 64th beyond, up to ``max_num_batched_tokens``),
and the output head at every count of sampled rows, on zero inputs. On one H100 (Llama-3-8B
shape, rows 2-2048, 8,203 launches) it took 2.0 s, and ``bench.new_shapes`` saw 0 of 24
prefill steps of new counts stall after it against 18 of 24 without (docs/scheduling.md).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch import nn

from engine.kernels import linear

logger = logging.getLogger(__name__)

DENSE_ROWS = 2048  # every row count up to here; beyond, every ``SPARSE_STEP``-th
SPARSE_STEP = 64  # a stall is ~10-20 ms: under 15% of a step of more than 2048 tokens


def row_counts(max_rows: int) -> list[int]:
    """The row counts to warm: 2..min(max_rows, DENSE_ROWS), then every SPARSE_STEP-th up to
    max_rows, max_rows included (one row goes through the gemv, not cuBLAS)."""
    rows = list(range(2, min(max_rows, DENSE_ROWS) + 1))
    if max_rows > DENSE_ROWS:
        rows += list(range(DENSE_ROWS + SPARSE_STEP, max_rows, SPARSE_STEP)) + [max_rows]
    return rows


def _distinct_linears(layer: nn.Module) -> list[nn.Linear]:
    seen: set[tuple[Any, ...]] = set()
    out = []
    for mod in layer.modules():
        if isinstance(mod, nn.Linear):
            key = (tuple(mod.weight.shape), mod.weight.dtype, mod.bias is None)
            if key not in seen:
                seen.add(key)
                out.append(mod)
    return out


@torch.inference_mode()
def warm_gemm_shapes(model: nn.Module, max_rows: int, max_head_rows: int) -> dict[str, Any]:
    """Run the first decoder layer's distinct linears at every count in ``row_counts(max_rows)``
    and ``model.compute_logits`` at 2..``max_head_rows`` rows. CUDA models only; returns what
    ran (counts, seconds). Synchronizes the device."""
    t0 = time.perf_counter()
    layers = getattr(getattr(model, "model", None), "layers", None)
    linears = _distinct_linears(layers[0]) if layers is not None and len(layers) else []
    rows = row_counts(max_rows)
    launches = 0
    for mod in linears if rows else ():  # max_rows 1: a step's one row goes through the gemv
        x = torch.zeros(rows[-1], mod.in_features, dtype=mod.weight.dtype, device=mod.weight.device)
        for m in rows:
            linear(x[:m], mod)
            launches += 1
        del x
    head = getattr(model, "compute_logits", None)
    hidden = getattr(getattr(model, "arch", None), "hidden_size", None)
    head_rows = list(range(2, max_head_rows + 1))
    if head is not None and hidden is not None and linears and head_rows:
        dtype, device = linears[0].weight.dtype, linears[0].weight.device
        h = torch.zeros(head_rows[-1], hidden, dtype=dtype, device=device)
        for m in head_rows:
            head(h[:m])
            launches += 1
        del h
    if linears and linears[0].weight.is_cuda:
        torch.cuda.synchronize(linears[0].weight.device)
    out = {
        "linears": [tuple(m.weight.shape) for m in linears],
        "rows": [rows[0], rows[-1], len(rows)] if rows else [],
        "head_rows": len(head_rows),
        "launches": launches,
        "s": round(time.perf_counter() - t0, 2),
    }
    logger.info(
        "GEMM warm-up: %d launches (%d linears x %d row counts, head x %d) in %.1f s",
        launches,
        len(linears),
        len(rows),
        len(head_rows),
        out["s"],
    )
    return out
