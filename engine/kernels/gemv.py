"""Matrix-vector products for batch-1 decode (``y = x @ W.T`` with ``x [1, K]``, ``W [N, K]``).

At batch 1 a decode step is a read of every weight once, so each linear layer should run at
HBM speed. cuBLAS's kernels for M=1 do on the big projections (gate/up ~4.0 TB/s on an H200)
but not on the smaller ones: in the batch-1 graph the attention output projection (4096 x
4096) ran at 2.7 TB/s and qkv (6144 x 4096) at 3.2 TB/s, with split-K reductions besides
(docs/gpu.md). Here each program owns ``BLOCK_N`` output rows and walks the whole K, reading
its rows as contiguous 16-byte vectors and accumulating in float32: no split-K, one kernel.

``gemv(x, weight)`` takes ``x [1, K]`` (unit last stride) and a contiguous ``weight [N, K]``
and returns ``[1, N]`` in x's dtype. Graph-capturable (no host sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    N,
    K,
    stride_wn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + cols
        if EVEN_K:
            x = tl.load(x_ptr + ks)
            w = tl.load(w_rows + ks[None, :], mask=row_ok[:, None], other=0.0)
        else:
            k_ok = ks < K
            x = tl.load(x_ptr + ks, mask=k_ok, other=0.0)
            w = tl.load(w_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


def tile_config(n: int, k: int) -> tuple[int, int, int, int]:
    """``(block_n, block_k, num_warps, num_stages)`` for ``weight [n, k]``: the fastest of
    bench/gemv.py's configurations on an H200 for the Llama-3-8B shapes (docs/gpu.md, run 12),
    by shape class: long rows (down), many rows (gate/up, lm_head), the rest (qkv, o)."""
    if k >= 8192:
        return 4, 512, 4, 3
    if n >= 16384:
        return 16, 256, 4, 3
    return 8, 512, 4, 3


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    block_n: int | None = None,
    block_k: int = 512,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """``x [1, K] @ weight[N, K].T`` -> ``[1, N]``; the tiles from ``tile_config`` unless
    ``block_n`` is given (then the other three arguments too). Raises ValueError on other
    shapes."""
    if x.dim() != 2 or x.shape[0] != 1 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"gemv needs x [1, K] and weight [N, K], got {tuple(x.shape)}, {tuple(weight.shape)}"
        )
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("gemv needs unit last strides")
    n, k = weight.shape
    if block_n is None:
        block_n, block_k, num_warps, num_stages = tile_config(n, k)
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        weight,
        y,
        n,
        k,
        weight.stride(0),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN_K=k % block_k == 0,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return y
