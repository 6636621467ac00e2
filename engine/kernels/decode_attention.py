"""Split-KV paged decode attention in Triton, for CUDA-graph decode steps.

One query token per request attends over its paged KV (the block-major cache's layer view
``[blocks, 2, page, kv_heads, head_dim]``) through FlashInfer's CSR page table (``indptr``,
``indices``, ``last_page_len``), the buffers the graph already refills each step: no plan, no
host work beyond those copies.

Why not FlashInfer's decode kernel there: in CUDA-graph mode it always splits the KV and its
CUDA-core kernel walks 2 tokens per iteration for a GQA group of 4, so a batch-1 step over a
512-token context spends ~16 us per layer in latency (docs/gpu.md, run 5 profile). Here one
program takes one (request, kv head, split): the group's query heads (up to 16, padded to 16
rows) against ``BLOCK_N`` tokens per iteration as two tensor-core dots, online softmax in
float32 (base 2). The split count is fixed per launch (the graph's grid is fixed) and each
split's span follows the request's length at run time, so a graph captured once serves any
context; splits past the end write an empty partial. A second kernel merges the splits (none
when there is one split). Any GQA group size up to 16 works (Qwen2.5-7B's 7 included).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
# Triton's CPU interpreter (the CPU tests) computes 16-bit float dots wrongly: upcast there.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
MAX_GROUP = 16  # query heads per kv head one program holds (the dot's row tile)


@triton.jit
def _decode_split_kernel(
    q_ptr,
    kv_ptr,
    indptr_ptr,
    indices_ptr,
    last_ptr,
    qo_ptr,
    out_ptr,
    acc_ptr,
    m_ptr,
    l_ptr,
    q_stride_t,
    q_stride_h,
    kv_stride_blk,
    kv_stride_kv,
    kv_stride_tok,
    kv_stride_h,
    out_stride_t,
    out_stride_h,
    scale_log2,
    NUM_SPLITS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr,
    ROWS: tl.constexpr,
    MULTI_Q: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    num_q_heads = tl.num_programs(1) * GROUP
    page_lo = tl.load(indptr_ptr + b)
    page_hi = tl.load(indptr_ptr + b + 1)
    seq_len = (page_hi - page_lo - 1) * PAGE + tl.load(last_ptr + b)
    span = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = s * span
    end = tl.minimum(start + span, seq_len)

    rows = tl.arange(0, ROWS)
    dims = tl.arange(0, HEAD_DIM)
    if MULTI_Q:  # row = (query token i, head g of the group); token i sees keys <= its position
        q_lo = tl.load(qo_ptr + b)
        q_len = tl.load(qo_ptr + b + 1) - q_lo
        qi = rows // GROUP
        row_ok = qi < q_len
        q_heads = h * GROUP + rows % GROUP
        tok = q_lo + qi
        limit = seq_len - q_len + qi
        q = tl.load(
            q_ptr
            + tok.to(tl.int64)[:, None] * q_stride_t
            + q_heads[:, None] * q_stride_h
            + dims[None, :],
            mask=row_ok[:, None],
            other=0.0,
        )
    else:  # one query token: row = head g of the group
        tok = b
        row_ok = rows < GROUP
        q_heads = h * GROUP + rows
        q = tl.load(
            q_ptr + b.to(tl.int64) * q_stride_t + q_heads[:, None] * q_stride_h + dims[None, :],
            mask=row_ok[:, None],
            other=0.0,
        )
    if DOT_F32:
        q = q.to(tl.float32)
    m = tl.full([ROWS], float("-inf"), tl.float32)
    lsum = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    for t0 in range(start, end, BLOCK_N):
        toks = t0 + tl.arange(0, BLOCK_N)
        ok = toks < end
        page = tl.load(indices_ptr + page_lo + toks // PAGE, mask=ok, other=0).to(tl.int64)
        base = page * kv_stride_blk + (toks % PAGE) * kv_stride_tok + h * kv_stride_h
        k = tl.load(kv_ptr + base[:, None] + dims[None, :], mask=ok[:, None], other=0.0)
        v = tl.load(
            kv_ptr + kv_stride_kv + base[:, None] + dims[None, :], mask=ok[:, None], other=0.0
        )
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k)) * scale_log2
        if MULTI_Q:
            scores = tl.where(
                ok[None, :] & (toks[None, :] <= limit[:, None]), scores, float("-inf")
            )
            m_new = tl.maximum(m, tl.max(scores, 1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
        else:
            scores = tl.where(ok[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            m_ref = m_new
        alpha = tl.exp2(m - m_ref)
        p = tl.exp2(scores - m_ref[:, None])
        lsum = lsum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    if NUM_SPLITS == 1:
        o = acc / lsum[:, None]
        if MULTI_Q:
            out_rows = tok.to(tl.int64)[:, None] * out_stride_t
        else:
            out_rows = b.to(tl.int64) * out_stride_t
        tl.store(
            out_ptr + out_rows + q_heads[:, None] * out_stride_h + dims[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None],
        )
    else:
        part = (tok * num_q_heads + q_heads) * NUM_SPLITS + s  # [ROWS] partial rows
        tl.store(m_ptr + part, m, mask=row_ok)
        tl.store(l_ptr + part, lsum, mask=row_ok)
        tl.store(
            acc_ptr + part.to(tl.int64)[:, None] * HEAD_DIM + dims[None, :],
            acc,
            mask=row_ok[:, None],
        )


@triton.jit
def _decode_merge_kernel(
    acc_ptr,
    m_ptr,
    l_ptr,
    out_ptr,
    out_stride_t,
    out_stride_h,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    b = tl.program_id(0)
    qh = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, HEAD_DIM)
    part = (b * tl.num_programs(1) + qh) * NUM_SPLITS + splits
    m = tl.load(m_ptr + part)
    lsum = tl.load(l_ptr + part)
    acc = tl.load(acc_ptr + part.to(tl.int64)[:, None] * HEAD_DIM + dims[None, :])
    m_max = tl.max(m, 0)  # split 0 always holds a token, so this is finite
    w = tl.exp2(m - m_max)  # empty splits: exp2(-inf) = 0
    o = tl.sum(acc * w[:, None], 0) / tl.sum(lsum * w, 0)
    tl.store(
        out_ptr + b.to(tl.int64) * out_stride_t + qh * out_stride_h + dims,
        o.to(out_ptr.dtype.element_ty),
    )


class DecodeConfig(NamedTuple):
    """One launch configuration of ``paged_decode_attention`` (fixed per captured graph)."""

    num_splits: int
    block_n: int
    num_warps: int
    num_stages: int


def decode_config(batch_size: int, num_kv_heads: int, num_sms: int) -> DecodeConfig:
    """The configuration for a graph of ``batch_size`` rows, from bench/attention.py --sweep on
    an H200 (docs/gpu.md, run 15): 128-token tiles from batch 4 up (10-20% faster than 64 at
    every context measured); 64-token tiles below, where a short context fills one tile per
    split (batch 1, 512 tokens: 6.3 against 7.7 us a layer)."""
    block_n = 128 if batch_size >= 4 else 64
    return DecodeConfig(num_splits_for(batch_size, num_kv_heads, num_sms), block_n, 4, 2)


def num_splits_for(
    batch_size: int, num_kv_heads: int, num_sms: int, programs_per_sm: int = 2
) -> int:
    """Splits per (request, kv head): the power of two that brings the grid nearest to
    ``programs_per_sm`` programs per SM without passing it (at least 1, at most 32)."""
    splits = 1
    while splits < 32 and batch_size * num_kv_heads * splits * 2 <= programs_per_sm * num_sms:
        splits *= 2
    return splits


def paged_decode_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    indptr: torch.Tensor,
    indices: torch.Tensor,
    last_page_len: torch.Tensor,
    scale: float,
    num_splits: int,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    qo_indptr: torch.Tensor | None = None,
    num_reqs: int = 0,
    max_q_len: int = 1,
) -> torch.Tensor:
    """``q [T, Hq, D]`` (unit last stride) over ``kv_layer [blocks, 2, page, Hkv, D]`` with
    request ``b`` owning pages ``indices[indptr[b]:indptr[b+1]]``, the last one holding
    ``last_page_len[b]`` tokens (int32 device tensors). Returns ``[T, Hq, D]`` in q's dtype.

    Without ``qo_indptr``: one query token per request (row ``b`` of q is request ``b``), as
    a decode step. With it (int32, ``num_reqs + 1`` entries): request ``b`` owns query rows
    ``qo_indptr[b]:qo_indptr[b+1]``, its newest tokens, each attending causally (keys up to
    its own position); ``max_q_len`` bounds those lengths, and ``max_q_len`` times the GQA
    group must be at most 64 (``max_query_len``). ``num_splits`` must be a power of two.
    Asynchronous, no host sync: graph-capturable."""
    tokens, num_heads, head_dim = q.shape
    num_kv_heads = kv_layer.shape[3]
    group = num_heads // num_kv_heads
    if not supports(num_heads, num_kv_heads, 16):
        raise ValueError(
            f"GQA group {num_heads}/{num_kv_heads} not supported (at most {MAX_GROUP})"
        )
    if (
        q.stride(2) != 1
        or kv_layer.stride(4) != 1
        or not supports(num_heads, num_kv_heads, head_dim)
    ):
        raise ValueError(
            "decode attention needs unit last strides and a power-of-two head_dim >= 16"
        )
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    multi = qo_indptr is not None
    rows = 16
    if multi:
        if max_q_len > max_query_len(group) or num_reqs < 1:
            raise ValueError(
                f"{max_q_len} query tokens x group {group} exceed 64 rows "
                f"(or num_reqs {num_reqs} < 1)"
            )
        while rows < group * max_q_len:
            rows *= 2
    requests = num_reqs if multi else tokens
    out = torch.empty(tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_splits > 1:
        acc = torch.empty(
            tokens * num_heads * num_splits, head_dim, dtype=torch.float32, device=q.device
        )
        m = torch.empty(tokens * num_heads * num_splits, dtype=torch.float32, device=q.device)
        lsum = torch.empty_like(m)
    else:
        acc = m = lsum = out  # unused
    _decode_split_kernel[(requests, num_kv_heads, num_splits)](
        q,
        kv_layer,
        indptr,
        indices,
        last_page_len,
        qo_indptr if multi else indptr,
        out,
        acc,
        m,
        lsum,
        q.stride(0),
        q.stride(1),
        kv_layer.stride(0),
        kv_layer.stride(1),
        kv_layer.stride(2),
        kv_layer.stride(3),
        out.stride(0),
        out.stride(1),
        scale * _LOG2E,
        NUM_SPLITS=num_splits,
        GROUP=group,
        HEAD_DIM=head_dim,
        PAGE=kv_layer.shape[2],
        BLOCK_N=block_n,
        DOT_F32=_INTERPRETED,
        ROWS=rows,
        MULTI_Q=multi,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if num_splits > 1:
        _decode_merge_kernel[(tokens, num_heads)](
            acc,
            m,
            lsum,
            out,
            out.stride(0),
            out.stride(1),
            NUM_SPLITS=num_splits,
            HEAD_DIM=head_dim,
            num_warps=4,
        )
    return out


def supports(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether ``paged_decode_attention`` takes this attention shape: a GQA group of at most
    ``MAX_GROUP`` query heads per kv head and a power-of-two head_dim of at least 16."""
    return (
        num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= MAX_GROUP
        and head_dim >= 16
        and not head_dim & (head_dim - 1)
    )


def max_query_len(group: int) -> int:
    """The most query tokens per request ``paged_decode_attention`` takes for a GQA group
    (the group's heads times the tokens fill at most a 64-row tile)."""
    return max(1, 64 // group)
