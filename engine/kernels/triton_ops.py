"""The Triton kernels behind ``engine.kernels`` (imported only through its lazy wrappers).

Numerics follow the torch path they replace, to within one rounding of the output dtype:
the residual sum is rounded to the activation dtype first (as a bf16 ``x + residual`` is), the
RMS statistics and the weight product run in float32 and are rounded once (``F.rms_norm``);
``silu(gate) * up`` runs in float32 and is rounded once (torch rounds after the SiLU too, so
the two may differ by one ulp).

Rows must have a unit stride in the last dim; the row stride is passed through, so a row slice
of a larger buffer works. One program per row for the norm (hidden sizes up to 16K fit one
block); a 2-D grid of (row, column block) for the activation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    new_res_ptr,
    n_cols,
    x_stride,
    res_stride,
    out_stride,
    new_res_stride,
    eps,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0).to(tl.float32)
    # Round the sum to the activation dtype before the statistics, as the unfused path does.
    s = (x + r).to(new_res_ptr.dtype.element_ty)
    tl.store(new_res_ptr + row * new_res_stride + cols, s, mask=mask)
    s32 = s.to(tl.float32)
    var = tl.sum(s32 * s32, axis=0) / n_cols
    rstd = 1.0 / tl.sqrt(var + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = s32 * rstd * w
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_kernel(
    in_ptr,
    out_ptr,
    n_cols,
    in_stride,
    out_stride,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(in_ptr + row * in_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(in_ptr + row * in_stride + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _check_rows(t: torch.Tensor, name: str) -> None:
    if t.dim() != 2 or t.stride(-1) != 1:
        raise ValueError(
            f"{name} must be 2-D [rows, cols] with unit column stride, got "
            f"shape {tuple(t.shape)} stride {t.stride()}"
        )


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """See ``engine.kernels.fused_add_rms_norm``. Raises ValueError on mismatched shapes."""
    _check_rows(x, "x")
    _check_rows(residual, "residual")
    if x.shape != residual.shape or weight.shape != (x.shape[1],):
        raise ValueError(
            f"shapes x {tuple(x.shape)}, residual {tuple(residual.shape)}, "
            f"weight {tuple(weight.shape)} do not match"
        )
    rows, cols = x.shape
    out = torch.empty_like(x)
    new_res = torch.empty_like(x)
    if rows == 0:
        return out, new_res
    block = triton.next_power_of_2(cols)
    warps = 4 if block <= 2048 else 8
    _add_rms_norm_kernel[(rows,)](
        x,
        residual,
        weight,
        out,
        new_res,
        cols,
        x.stride(0),
        residual.stride(0),
        out.stride(0),
        new_res.stride(0),
        eps,
        BLOCK=block,
        num_warps=warps,
    )
    return out, new_res


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """See ``engine.kernels.silu_and_mul``. Raises ValueError on an odd last dim."""
    _check_rows(gate_up, "gate_up")
    rows, two_i = gate_up.shape
    if two_i % 2:
        raise ValueError(f"gate_up's last dim must be even, got {two_i}")
    cols = two_i // 2
    out = torch.empty(rows, cols, dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0:
        return out
    block = 1024
    _silu_and_mul_kernel[(rows, triton.cdiv(cols, block))](
        gate_up,
        out,
        cols,
        gate_up.stride(0),
        out.stride(0),
        BLOCK=block,
        num_warps=4,
    )
    return out


@triton.jit
def _rotary_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    x_tok_stride,
    x_head_stride,
    cs_stride,
    num_heads,
    head_dim,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    tok = (pid // num_heads).to(tl.int64)
    head = (pid % num_heads).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < head_dim
    half = head_dim // 2
    partner = tl.where(offs < half, offs + half, offs - half)
    base = x_ptr + tok * x_tok_stride + head * x_head_stride
    x = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(base + partner, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + tok * cs_stride + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + tok * cs_stride + offs, mask=mask, other=0.0).to(tl.float32)
    out = out_ptr + (tok * num_heads + head) * head_dim
    tl.store(out + offs, (x * c + xp * s).to(out_ptr.dtype.element_ty), mask=mask)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """See ``engine.kernels.rotary``. Raises ValueError on mismatched shapes."""
    if x.dim() != 3 or x.stride(-1) != 1:
        raise ValueError(f"x must be [T, H, D] with unit last stride, got {tuple(x.shape)}")
    tokens, heads, dim = x.shape
    cos2, sin2 = cos.reshape(tokens, -1), sin_signed.reshape(tokens, -1)
    if dim % 2 or cos2.shape != (tokens, dim) or sin2.shape != (tokens, dim):
        raise ValueError(f"cos/sin {tuple(cos.shape)} do not match x {tuple(x.shape)}")
    if cos2.stride() != (dim, 1) or sin2.stride() != (dim, 1):
        cos2, sin2 = cos2.contiguous(), sin2.contiguous()
    out = torch.empty(tokens, heads, dim, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    _rotary_kernel[(tokens * heads,)](
        x,
        cos2,
        sin2,
        out,
        x.stride(0),
        x.stride(1),
        dim,
        heads,
        dim,
        BLOCK=triton.next_power_of_2(dim),
        num_warps=1 if dim <= 128 else 2,
    )
    return out


@triton.jit
def _rotary_cache_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    cache_ptr,
    slot_ptr,
    x_tok_stride,
    cs_stride,
    num_heads,
    num_kv_heads,
    head_dim,
    block_size,
    c_block_stride,
    c_kv_stride,
    c_off_stride,
    c_head_stride,
    BLOCK: tl.constexpr,
):
    # One program per (token, head) over [q heads | k heads | v heads] of the fused qkv row.
    pid = tl.program_id(0)
    heads = num_heads + 2 * num_kv_heads
    tok = (pid // heads).to(tl.int64)
    head = (pid % heads).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < head_dim
    base = x_ptr + tok * x_tok_stride + head * head_dim
    slot = tl.load(slot_ptr + tok)
    cache_row = (
        cache_ptr + (slot // block_size) * c_block_stride + (slot % block_size) * c_off_stride
    )
    if head < num_heads + num_kv_heads:
        half = head_dim // 2
        partner = tl.where(offs < half, offs + half, offs - half)
        x = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
        xp = tl.load(base + partner, mask=mask, other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + tok * cs_stride + offs, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + tok * cs_stride + offs, mask=mask, other=0.0).to(tl.float32)
        y = (x * c + xp * s).to(out_ptr.dtype.element_ty)
        tl.store(
            out_ptr + (tok * (num_heads + num_kv_heads) + head) * head_dim + offs, y, mask=mask
        )
        if head >= num_heads:  # a k head: into the cache's K half at its slot
            kv_head = head - num_heads
            tl.store(
                cache_row + kv_head * c_head_stride + offs,
                y.to(cache_ptr.dtype.element_ty),
                mask=mask,
            )
    else:  # a v head: copied into the cache's V half
        kv_head = head - num_heads - num_kv_heads
        v = tl.load(base + offs, mask=mask, other=0.0)
        tl.store(
            cache_row + c_kv_stride + kv_head * c_head_stride + offs,
            v.to(cache_ptr.dtype.element_ty),
            mask=mask,
        )


def rotary_and_cache(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin_signed: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    kv_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """See ``engine.kernels.rotary_and_cache``. Raises ValueError on mismatched shapes."""
    _check_rows(qkv, "qkv")
    tokens = qkv.shape[0]
    if kv_layer.dim() != 5 or kv_layer.shape[1] != 2 or kv_layer.shape[3] != num_kv_heads:
        raise ValueError(
            f"kv_layer must be [blocks, 2, block_size, {num_kv_heads}, D], got "
            f"{tuple(kv_layer.shape)}"
        )
    dim = kv_layer.shape[4]
    if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * dim or kv_layer.stride(4) != 1:
        raise ValueError(
            f"qkv {tuple(qkv.shape)} does not hold {num_heads} q and "
            f"{num_kv_heads} k/v heads of {dim}"
        )
    if slot_mapping.shape[0] < tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} slots for {tokens} tokens")
    cos2, sin2 = cos.reshape(tokens, -1), sin_signed.reshape(tokens, -1)
    if dim % 2 or cos2.shape != (tokens, dim) or sin2.shape != (tokens, dim):
        raise ValueError(f"cos/sin {tuple(cos.shape)} do not match {dim}-wide heads")
    if cos2.stride() != (dim, 1) or sin2.stride() != (dim, 1):
        cos2, sin2 = cos2.contiguous(), sin2.contiguous()
    out = torch.empty(tokens, num_heads + num_kv_heads, dim, dtype=qkv.dtype, device=qkv.device)
    if tokens == 0:
        return out
    s = kv_layer.stride()
    _rotary_cache_kernel[(tokens * (num_heads + 2 * num_kv_heads),)](
        qkv,
        cos2,
        sin2,
        out,
        kv_layer,
        slot_mapping,
        qkv.stride(0),
        dim,
        num_heads,
        num_kv_heads,
        dim,
        kv_layer.shape[2],
        s[0],
        s[1],
        s[2],
        s[3],
        BLOCK=triton.next_power_of_2(dim),
        num_warps=1 if dim <= 128 else 2,
    )
    return out


@triton.jit
def _copy_tile(
    src_base,
    src_offsets_ptr,
    dst_ptr,
    dst_rows_ptr,
    chunk_start,
    chunk_words,
    row_words,
    i,
    j,
    BLOCK: tl.constexpr,
):
    # Words [j * BLOCK, (j + 1) * BLOCK) of block i's layer chunk, read from host memory
    # through its device-mapped (UVA) address and written into cache row i.
    src_word = tl.load(src_offsets_ptr + i)  # int64: the block's payload, in 4-byte words
    row = tl.load(dst_rows_ptr + i)
    offs = j * BLOCK + tl.arange(0, BLOCK)
    mask = offs < chunk_words
    src = (src_base + (src_word + chunk_start) * 4).to(tl.pointer_type(tl.int32))
    src = tl.multiple_of(src, 16)
    vals = tl.load(src + offs, mask=mask)
    tl.store(dst_ptr + row * row_words + chunk_start + offs, vals, mask=mask)


@triton.jit
def _copy_layer_kernel(
    src_base,
    src_offsets_ptr,
    dst_ptr,
    dst_rows_ptr,
    chunk_start,
    chunk_words,
    row_words,
    BLOCK: tl.constexpr,
):
    # Program (i, j): tile j of block i.
    _copy_tile(
        src_base,
        src_offsets_ptr,
        dst_ptr,
        dst_rows_ptr,
        chunk_start,
        chunk_words,
        row_words,
        tl.program_id(0),
        tl.program_id(1),
        BLOCK,
    )


@triton.jit
def _copy_layer_kernel_looped(
    src_base,
    src_offsets_ptr,
    dst_ptr,
    dst_rows_ptr,
    chunk_start,
    chunk_words,
    row_words,
    num_tiles,
    tiles_per_row,
    BLOCK: tl.constexpr,
):
    # The same copy from a fixed number of programs, each looping over tiles (pid, pid + P,
    # ...): a load's copy then holds a few SMs for its whole length instead of thousands of
    # programs queued beside the forward's kernels on the compute stream.
    for t in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        _copy_tile(
            src_base,
            src_offsets_ptr,
            dst_ptr,
            dst_rows_ptr,
            chunk_start,
            chunk_words,
            row_words,
            t // tiles_per_row,
            t % tiles_per_row,
            BLOCK,
        )


def copy_layer_from_host(
    src: torch.Tensor,
    src_word_offsets: torch.Tensor,
    dst_words: torch.Tensor,
    dst_rows: torch.Tensor,
    chunk_start: int,
    chunk_words: int,
    programs: int = 0,
) -> None:
    """See ``engine.kernels.copy_layer_from_host``."""
    if src.device.type != "cpu" or (dst_words.is_cuda and not src.is_pinned()):
        raise ValueError("src must be host memory (pinned when the destination is on CUDA)")
    if dst_words.dtype != torch.int32 or dst_words.dim() != 2 or not dst_words.is_contiguous():
        raise ValueError("dst_words must be a contiguous 2-D int32 view of the cache rows")
    if src.data_ptr() % 16 or dst_words.data_ptr() % 16:
        raise ValueError("src and dst must be 16-byte aligned")
    n = dst_rows.shape[0]
    if n == 0 or chunk_words == 0:
        return
    if src_word_offsets.shape[0] != n:
        raise ValueError(f"{src_word_offsets.shape[0]} source offsets for {n} rows")
    block = 2048
    tiles_per_row = triton.cdiv(chunk_words, block)
    if 0 < programs < n * tiles_per_row:
        _copy_layer_kernel_looped[(programs,)](
            src.data_ptr(),
            src_word_offsets,
            dst_words,
            dst_rows,
            chunk_start,
            chunk_words,
            dst_words.shape[1],
            n * tiles_per_row,
            tiles_per_row,
            BLOCK=block,
            num_warps=4,
        )
        return
    _copy_layer_kernel[(n, tiles_per_row)](
        src.data_ptr(),
        src_word_offsets,
        dst_words,
        dst_rows,
        chunk_start,
        chunk_words,
        dst_words.shape[1],
        BLOCK=block,
        num_warps=4,
    )
