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
    x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr,
    n_cols, x_stride, res_stride, out_stride, new_res_stride, eps,
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
    in_ptr, out_ptr, n_cols, in_stride, out_stride, BLOCK: tl.constexpr,
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
        raise ValueError(f"{name} must be 2-D [rows, cols] with unit column stride, got "
                         f"shape {tuple(t.shape)} stride {t.stride()}")


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """See ``engine.kernels.fused_add_rms_norm``. Raises ValueError on mismatched shapes."""
    _check_rows(x, "x")
    _check_rows(residual, "residual")
    if x.shape != residual.shape or weight.shape != (x.shape[1],):
        raise ValueError(f"shapes x {tuple(x.shape)}, residual {tuple(residual.shape)}, "
                         f"weight {tuple(weight.shape)} do not match")
    rows, cols = x.shape
    out = torch.empty_like(x)
    new_res = torch.empty_like(x)
    if rows == 0:
        return out, new_res
    block = triton.next_power_of_2(cols)
    warps = 4 if block <= 2048 else 8
    _add_rms_norm_kernel[(rows,)](
        x, residual, weight, out, new_res, cols, x.stride(0), residual.stride(0),
        out.stride(0), new_res.stride(0), eps, BLOCK=block, num_warps=warps,
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
        gate_up, out, cols, gate_up.stride(0), out.stride(0), BLOCK=block, num_warps=4,
    )
    return out


@triton.jit
def _rotary_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr, x_tok_stride, x_head_stride, cs_stride, num_heads,
    head_dim, BLOCK: tl.constexpr,
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
        x, cos2, sin2, out, x.stride(0), x.stride(1), dim, heads, dim,
        BLOCK=triton.next_power_of_2(dim), num_warps=1 if dim <= 128 else 2,
    )
    return out
