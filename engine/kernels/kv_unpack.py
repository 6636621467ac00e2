"""Triton decode of ``connectors.device.kv_compress.Hi4Codec`` payloads into KV cache rows.

Two kernels on the current stream: ``_values`` writes every 2-byte value of the segments
asked for (codebook[code] << 8 | low, two values to a 32-bit word), then ``_escapes``
rewrites the escaped ones (their high byte from the escape list). Stream order puts the
second after the first. Each block's metadata, codes and low bytes are read from a device
buffer (the loader's staging) at their own 16-byte aligned offsets, so a whole payload and a
layer's parts gathered from many blocks decode alike; each block lands in the cache row its
id names. Raises ImportError without Triton.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import triton
import triton.language as tl

_BLOCK = 2048  # value pairs (32-bit words) per program of the value kernel

# Triton compiles a kernel again for every new pattern of its integer arguments (== 1, a
# multiple of 16) and pointer alignments (16 bytes). A layer-wise load passes a column slice
# of its decode index (any stride, any 8-byte alignment) and a group's first segment, so the
# loads of one run met new patterns one after another: on an H200, 363 ms and 490 ms of
# compilation inside two of the QA client's reloads, after ``Hi4Codec.warm`` had compiled the
# whole-payload pattern. Those arguments only index a few int64 words a program: one kernel
# for all of them, which ``warm`` compiles before the first load.
_ONE_VARIANT: dict[str, Any] = {"do_not_specialize": ["idx_ptr", "idx_stride", "S0"]}
if "do_not_specialize_on_alignment" in inspect.signature(triton.JITFunction.__init__).parameters:
    _ONE_VARIANT["do_not_specialize_on_alignment"] = ["idx_ptr"]


@triton.jit(**_ONE_VARIANT)
def _values_kernel(
    src_ptr, idx_ptr, idx_stride, dst_ptr, row_words, M: tl.constexpr, BOOK, S0, BLOCK: tl.constexpr
):
    """One program: BLOCK pairs of values of segment ``S0 + program_id(1)`` of block
    ``program_id(0)``. A pair is one packed code byte and two low bytes (one u16 load),
    written as one 32-bit word. ``idx``: rows meta, codes, low (byte offsets), block id."""
    i = tl.program_id(0)
    local = tl.program_id(1)
    t = tl.program_id(2)
    seg = S0 + local
    meta = src_ptr + tl.load(idx_ptr + i)
    codes = src_ptr + tl.load(idx_ptr + idx_stride + i)
    low = src_ptr + tl.load(idx_ptr + 2 * idx_stride + i)
    row = tl.load(idx_ptr + 3 * idx_stride + i)
    pair = t * BLOCK + tl.arange(0, BLOCK)
    mask = pair < M // 2
    packed = tl.load(codes + local * (M // 2) + pair, mask=mask, other=0).to(tl.int32)
    lows = tl.load(
        low.to(tl.pointer_type(tl.uint16)) + local * (M // 2) + pair, mask=mask, other=0
    ).to(tl.int32)
    book = meta + BOOK + seg * 16
    hi0 = tl.load(book + (packed & 15), mask=mask, other=0).to(tl.int32)
    hi1 = tl.load(book + (packed >> 4), mask=mask, other=0).to(tl.int32)
    word = (lows & 0xFF) | (hi0 << 8) | ((lows >> 8) << 16) | (hi1 << 24)
    tl.store(dst_ptr + row.to(tl.int64) * row_words + seg * (M // 2) + pair, word, mask=mask)


@triton.jit(**_ONE_VARIANT)
def _escapes_kernel(
    src_ptr,
    idx_ptr,
    idx_stride,
    dst_ptr,
    row_values,
    M: tl.constexpr,
    E: tl.constexpr,
    E_POW2: tl.constexpr,
    IDX,
    ESC,
    S0,
):
    i = tl.program_id(0)
    local = tl.program_id(1)
    seg = S0 + local
    meta = src_ptr + tl.load(idx_ptr + i)
    low = src_ptr + tl.load(idx_ptr + 2 * idx_stride + i)
    row = tl.load(idx_ptr + 3 * idx_stride + i)
    count = tl.load(meta + seg * 2).to(tl.int32) | (tl.load(meta + seg * 2 + 1).to(tl.int32) << 8)
    j = tl.arange(0, E_POW2)
    mask = (j < count) & (j < E)
    at = meta + IDX + (seg * E + j) * 2
    idx = tl.load(at, mask=mask, other=0).to(tl.int32) | (
        tl.load(at + 1, mask=mask, other=0).to(tl.int32) << 8
    )
    mask = mask & (idx < M)  # a damaged index never writes outside its segment
    high = tl.load(meta + ESC + seg * E + j, mask=mask, other=0).to(tl.int32)
    lo = tl.load(low + local * M + idx, mask=mask, other=0).to(tl.int32)
    value = ((high << 8) | lo).to(tl.int16)
    tl.store(dst_ptr + row.to(tl.int64) * row_values + seg * M + idx, value, mask=mask)


def decode_hi4(
    codec: Any,
    src: torch.Tensor,
    index: torch.Tensor,
    cache_rows: torch.Tensor,
    first: int,
    count: int,
) -> None:
    """See ``Hi4Codec.decode_segments`` (which validates the arguments and builds
    ``index``: ``[4, n]`` int64, rows meta / codes / low byte offsets and block ids; a column
    slice of a wider one is fine)."""
    n = index.shape[1]
    m, e, off = codec.segment_values, codec.escapes_per_segment, codec.offsets
    row_values = cache_rows.shape[1] // 2
    stride = index.stride(0)
    _values_kernel[(n, count, triton.cdiv(m // 2, _BLOCK))](
        src,
        index,
        stride,
        cache_rows.view(torch.int32),
        row_values // 2,
        m,
        off["book"],
        first,
        BLOCK=_BLOCK,
        num_warps=8,
    )
    _escapes_kernel[(n, count)](
        src,
        index,
        stride,
        cache_rows.view(torch.int16),
        row_values,
        m,
        e,
        triton.next_power_of_2(e),
        off["idx"],
        off["esc"],
        first,
        num_warps=4,
    )
