"""Decode attention for a batch on the CPU in float32, straight from the paged KV cache.

A decode step's attention in torch gathers every request's blocks into one padded tensor per
layer (two ``index_select`` copies of K and V), then runs SDPA over it: about ten dispatches
and a second copy of every key and value a layer. On SmolLM2-135M, one thread, a batch of 8
at ~64 tokens of context, that was ~0.38 ms a layer inside the engine (11 ms of a ~65 ms
step), where vLLM's CPU kernel reads the paged cache in place (~0.06 ms a layer on two
threads). This is that kernel in C: one call a layer writes the step's keys and values into
their slots, then for each request every query head scores the cached keys of the request's
blocks where they lie (a token's whole row, every KV head, at once), and the values are
summed with the softmax weights (the scores in a scratch row a head): no copies.

The C source is compiled on first use (``engine/kernels/cpu_build.py``); where no compiler
runs, ``available()`` is False and the torch path stays.

Float32 sums in another order than SDPA's: within ~1e-6 relative of it (tested against it).
"""

from __future__ import annotations

import ctypes

import torch

from engine.kernels.cpu_build import CKernel

_SOURCE = r"""
#include <math.h>
#include <stdint.h>

/* q, out: [B, H, D] with H = Hkv * G (query head h reads KV head h / G);
   kv: one layer of the cache, [num_blocks, 2, BS, Hkv, D], contiguous within a block, blocks
   block_stride floats apart (the engine's cache keeps a block's layers together);
   tables: [B, width] block ids; lens: [B] context lengths; scratch: >= H * max(lens) floats;
   k_new, v_new: [B, Hkv, D], written first at cache slot slots[b] (block * BS + offset), or
   NULL when the cache already holds them.
   Each pass walks a request's tokens in order and reads a token's whole row (every KV head):
   a block's keys (then values) stream through the cache once, as they lie in memory. */
void kvtier_decode_attention(
    const float *q, const float *kv, const int64_t *tables, const int64_t *lens, float *out,
    float *scratch, int64_t B, int64_t width, int64_t Hkv, int64_t G, int64_t D, int64_t BS,
    int64_t block_stride, float scale, const float *k_new, const float *v_new,
    const int64_t *slots)
{
    const int64_t H = Hkv * G;
    const int64_t row = Hkv * D;            /* one token's K (or V) of every KV head */
    const int64_t half = BS * row;          /* a block's K (or V) */
    if (k_new != 0) {
        float *cache = (float *)kv;
        for (int64_t b = 0; b < B; b++) {
            float *at = cache + (slots[b] / BS) * block_stride + (slots[b] % BS) * row;
            for (int64_t i = 0; i < row; i++) at[i] = k_new[b * row + i];
            for (int64_t i = 0; i < row; i++) at[half + i] = v_new[b * row + i];
        }
    }
    for (int64_t b = 0; b < B; b++) {
        const int64_t L = lens[b];
        const int64_t *table = tables + b * width;
        const float *qb = q + b * H * D;
        float *ob = out + b * H * D;
        for (int64_t t = 0; t < L; t++) {
            const float *k = kv + table[t / BS] * block_stride + (t % BS) * row;
            for (int64_t h = 0; h < H; h++) {
                const float *qh = qb + h * D, *kh = k + (h / G) * D;
                float s = 0.f;
                for (int64_t d = 0; d < D; d++) s += qh[d] * kh[d];
                scratch[h * L + t] = s * scale;
            }
        }
        for (int64_t h = 0; h < H; h++) {
            float *sh = scratch + h * L;
            float m = sh[0];
            for (int64_t t = 1; t < L; t++) m = sh[t] > m ? sh[t] : m;
            float sum = 0.f;
            for (int64_t t = 0; t < L; t++) { sh[t] = expf(sh[t] - m); sum += sh[t]; }
            const float inv = 1.f / sum;
            for (int64_t t = 0; t < L; t++) sh[t] *= inv;
            for (int64_t d = 0; d < D; d++) ob[h * D + d] = 0.f;
        }
        for (int64_t t = 0; t < L; t++) {
            const float *v = kv + table[t / BS] * block_stride + half + (t % BS) * row;
            for (int64_t h = 0; h < H; h++) {
                const float p = scratch[h * L + t], *vh = v + (h / G) * D;
                float *oh = ob + h * D;
                for (int64_t d = 0; d < D; d++) oh[d] += p * vh[d];
            }
        }
    }
}
"""

_p, _i64 = ctypes.c_void_p, ctypes.c_int64
_KERNEL = CKernel(
    "decode_attention",
    _SOURCE,
    "kvtier_decode_attention",
    [_p, _p, _p, _p, _p, _p, _i64, _i64, _i64, _i64, _i64, _i64, _i64, ctypes.c_float, _p, _p, _p],
    "KVTIER_CPU_DECODE_KERNEL",
)


def _function() -> object:
    return _KERNEL.function()


def enabled() -> bool:
    """Whether the engine uses the kernel: built here, and not turned off with
    ``KVTIER_CPU_DECODE_KERNEL=0`` (the torch path, for comparison)."""
    return _KERNEL.enabled()


def available() -> bool:
    """Whether the kernel is built (or can be) here; builds it on the first call."""
    return _KERNEL.available()


def decode_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    scratch: torch.Tensor,
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``q [B, H, D]`` float32 against the cached keys and values of each request's first
    ``lens[b]`` positions in the blocks ``tables[b]`` of ``kv_layer [blocks, 2, BS, Hkv, D]``
    (float32, each block contiguous; any stride between blocks); query head ``h`` reads KV
    head ``h // (H // Hkv)``. Returns ``[B, H * D]``. ``scratch``: float32 with at least
    ``H * max(lens)`` elements. Call only when ``available()``; raises ValueError on a tensor
    it cannot read in place.
    ``new_kv``: ``(k [B, Hkv, D], v [B, Hkv, D], slots [B])``, this step's keys and values,
    written into the cache at ``slots`` (block * BS + offset) first (None: already there)."""
    fn = _function()
    if not fn:
        raise RuntimeError("CPU decode attention is not available here")
    num_reqs, num_heads, dim = q.shape
    _, two, block_size, num_kv_heads, kv_dim = kv_layer.shape
    ok = (
        q.dtype == kv_layer.dtype == scratch.dtype == torch.float32
        and tables.dtype == lens.dtype == torch.int64
        and two == 2
        and kv_dim == dim
        and num_heads % num_kv_heads == 0
        and q.is_contiguous()
        and kv_layer[0].is_contiguous()
        and tables.is_contiguous()
        and lens.is_contiguous()
        and tables.shape[0] == lens.shape[0] == num_reqs
    )
    if new_kv is not None:
        k_new, v_new, slots = new_kv
        want = (num_reqs, num_kv_heads, dim)
        ok = ok and all(
            t.dtype == torch.float32 and t.is_contiguous() and tuple(t.shape) == want
            for t in (k_new, v_new)
        )
        ok = ok and slots.dtype == torch.int64 and slots.is_contiguous()
        ok = ok and tuple(slots.shape) == (num_reqs,)
    if not ok:
        raise ValueError("decode_attention: float32 contiguous q and blocks, int64 tables, lens")
    news = (0, 0, 0) if new_kv is None else tuple(t.data_ptr() for t in new_kv)
    group = num_heads // num_kv_heads
    out = torch.empty(num_reqs, num_heads * dim, dtype=torch.float32)
    fn(  # type: ignore[operator]
        q.data_ptr(),
        kv_layer.data_ptr(),
        tables.data_ptr(),
        lens.data_ptr(),
        out.data_ptr(),
        scratch.data_ptr(),
        num_reqs,
        tables.shape[1],
        num_kv_heads,
        group,
        dim,
        block_size,
        kv_layer.stride(0),
        scale,
        *news,
    )
    return out
