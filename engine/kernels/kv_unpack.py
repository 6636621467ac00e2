"""Triton decode of ``connectors.kv_compress.Hi4Codec`` payloads into KV cache rows.

Two kernels on the current stream: ``_values`` writes every 2-byte value of every segment
(codebook[code] << 8 | low), two values to a 32-bit word, then ``_escapes`` rewrites the escaped ones (their high byte from
the escape list). Stream order puts the second after the first. The payloads are read from a
device buffer (the loader's staging) at 16-byte aligned offsets (the low bytes are read two
at a time); each lands in the
cache row its block id names. Raises ImportError without Triton.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import triton
import triton.language as tl

_BLOCK = 2048  # value pairs (32-bit words) per program of the value kernel


@triton.jit
def _values_kernel(src_ptr, src_off_ptr, dst_ptr, dst_row_ptr, row_words, M: tl.constexpr,
                   BOOK, CODES, LOW, BLOCK: tl.constexpr):
    """One program: BLOCK pairs of values of one segment. A pair is one packed code byte and
    two low bytes (one u16 load), written as one 32-bit word."""
    i = tl.program_id(0)
    seg = tl.program_id(1)
    t = tl.program_id(2)
    base = src_ptr + tl.load(src_off_ptr + i)
    row = tl.load(dst_row_ptr + i)
    pair = t * BLOCK + tl.arange(0, BLOCK)
    mask = pair < M // 2
    packed = tl.load(base + CODES + seg * (M // 2) + pair, mask=mask, other=0).to(tl.int32)
    lows = tl.load((base + LOW).to(tl.pointer_type(tl.uint16)) + seg * (M // 2) + pair,
                   mask=mask, other=0).to(tl.int32)
    book = base + BOOK + seg * 16
    hi0 = tl.load(book + (packed & 15), mask=mask, other=0).to(tl.int32)
    hi1 = tl.load(book + (packed >> 4), mask=mask, other=0).to(tl.int32)
    word = (lows & 0xFF) | (hi0 << 8) | ((lows >> 8) << 16) | (hi1 << 24)
    tl.store(dst_ptr + row.to(tl.int64) * row_words + seg * (M // 2) + pair, word, mask=mask)


@triton.jit
def _escapes_kernel(src_ptr, src_off_ptr, dst_ptr, dst_row_ptr, row_values, M: tl.constexpr,
                    E: tl.constexpr, E_POW2: tl.constexpr, IDX, ESC, LOW):
    i = tl.program_id(0)
    seg = tl.program_id(1)
    base = src_ptr + tl.load(src_off_ptr + i)
    row = tl.load(dst_row_ptr + i)
    count = (tl.load(base + seg * 2).to(tl.int32)
             | (tl.load(base + seg * 2 + 1).to(tl.int32) << 8))
    j = tl.arange(0, E_POW2)
    mask = (j < count) & (j < E)
    at = base + IDX + (seg * E + j) * 2
    idx = (tl.load(at, mask=mask, other=0).to(tl.int32)
           | (tl.load(at + 1, mask=mask, other=0).to(tl.int32) << 8))
    mask = mask & (idx < M)  # a damaged index never writes outside its segment
    high = tl.load(base + ESC + seg * E + j, mask=mask, other=0).to(tl.int32)
    low = tl.load(base + LOW + seg * M + idx, mask=mask, other=0).to(tl.int32)
    value = ((high << 8) | low).to(tl.int16)
    tl.store(dst_ptr + row.to(tl.int64) * row_values + seg * M + idx, value, mask=mask)


def decode_hi4(codec: Any, src: torch.Tensor, src_offsets: Sequence[int],
               cache_rows: torch.Tensor, block_ids: Sequence[int],
               index: torch.Tensor | None = None) -> None:
    """See ``Hi4Codec.decode_into`` (which validates the arguments)."""
    n = len(block_ids)
    if index is None:
        index = torch.tensor([list(src_offsets), list(block_ids)], dtype=torch.int64)
        if cache_rows.is_cuda:
            index = index.pin_memory().to(cache_rows.device, non_blocking=True)
    dst = cache_rows.view(torch.int16)
    s, m, e, off = codec.num_segments, codec.segment_values, codec.escapes_per_segment, codec.offsets
    row_values = dst.shape[1]
    _values_kernel[(n, s, triton.cdiv(m // 2, _BLOCK))](
        src, index[0], cache_rows.view(torch.int32), index[1], row_values // 2, m, off["book"],
        off["codes"], off["low"], BLOCK=_BLOCK, num_warps=8,
    )
    _escapes_kernel[(n, s)](
        src, index[0], dst, index[1], row_values, m, e, triton.next_power_of_2(e),
        off["idx"], off["esc"], off["low"], num_warps=4,
    )
