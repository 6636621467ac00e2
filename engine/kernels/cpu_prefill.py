"""Causal prefill attention on the CPU in float32, in C: one pass over the keys a tile.

The torch path of a CPU prompt chunk runs two GEMMs and a softmax pass per chunk of queries
(``causal_gemm_attention``) or torch's flash kernel: on SmolLM2-135M, one thread, a
1,024-token layer took 21-24 ms (~50 GFLOP/s), where vLLM's CPU kernel takes ~19. This kernel
is flash attention written for the vector unit: per KV head its keys are packed once,
transposed in blocks of 64 and scaled into log2 units, its values copied row by row; a tile of
~32 query rows (positions x the query heads that share the KV head) walks the key blocks up to
its last position, scoring a block with register tiles of a few rows x 64 keys (AVX-512) or 32
(AVX2), folding it into a running max and sum (``exp2`` as a degree-7 polynomial on the vector),
and adding the weighted values with register tiles of the same shape; the causal mask only
touches the blocks a tile's diagonal crosses. Same layer: ~16 ms (~74 GFLOP/s) on AVX-512.
GCC's vector extensions, no intrinsics, the vector as wide as the ISA torch finds
(``engine/kernels/cpu_build.py``): a 16-float vector built for AVX2 went through the stack
element by element, and a 1,024-token layer (SmolLM2's heads, one thread, a 2-core AMD EPYC
VM without AVX-512) took 628 ms against 48 ms with 8-float vectors and 3 x 4 register tiles
(``python -m bench.cpu_attention``).

Several threads (``torch.get_num_threads()``) split a call into (KV head, query range) parts
of equal causal work, each a ctypes call on a pool thread (ctypes lets the GIL go).
``KVTIER_CPU_PREFILL_KERNEL=0`` keeps the torch path. Within ~2e-6 of float64 SDPA (tested).
"""

from __future__ import annotations

import ctypes
import math
from concurrent.futures import ThreadPoolExecutor

import torch

from engine.kernels.cpu_build import CKernel

_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>

/* The vector width follows the ISA it is built for: a tile's accumulators must fit its
   registers (AVX-512: 32 x 16 floats; AVX2: 16 x 8; SSE: 16 x 4). GCC lowers a vector wider
   than the ISA's through the stack (an AVX2 build of 16-float vectors ran ~13x slower). */
#if defined(__AVX512F__)
#define VW 16
#define QR 4             /* query rows a register tile */
#elif defined(__AVX2__)
#define VW 8
#define QR 3
#else
#define VW 4
#define QR 2
#endif
typedef float v16 __attribute__((vector_size(VW * 4), aligned(4)));
typedef int32_t i16 __attribute__((vector_size(VW * 4), aligned(4)));
#define KB 64            /* keys a block */
#define KV (KB / VW)     /* vectors a block row */
#define CG 4             /* vectors a register tile's row: CG * VW keys (or value columns) */
#define NEG (-1e30f)
#define RT 32           /* query rows (positions x heads) a tile */

/* 2^x for x <= 0, 0 below -126 (masked scores sit at NEG) */
static inline v16 sel(i16 m, v16 a, v16 b) {
    return (v16)(((i16)a & m) | ((i16)b & ~m));
}

static inline v16 exp2v(v16 x) {
    const i16 lo = x < -126.f;
    x = sel(lo, (v16){} - 126.f, x);
    const i16 n = __builtin_convertvector(x - 0.5f, i16);  /* x < 0: rounds to nearest */
    const v16 f = x - __builtin_convertvector(n, v16);     /* in [-0.5, 0.5] */
    v16 p = (v16){} + 1.5252733e-5f;
    p = p * f + 1.5403530e-4f;
    p = p * f + 1.3333558e-3f;
    p = p * f + 9.6181291e-3f;
    p = p * f + 5.5504109e-2f;
    p = p * f + 2.4022651e-1f;
    p = p * f + 6.9314718e-1f;
    p = p * f + 1.f;
    const i16 bits = (n + 127) << 23;
    v16 r = p * (v16)bits;
    return (v16)((i16)r & ~lo);
}

/* Sc[r][0:CG*VW] = Q[r] . Kt[:, 0:CG*VW] for a tile of nr <= QR rows; Kt rows KB apart */
static inline __attribute__((always_inline)) void qk_rows(
    const int nr, const float *Q, int64_t D, const float *Kt, float *Sc)
{
    v16 acc[QR][CG];
    for (int i = 0; i < nr; i++) for (int j = 0; j < CG; j++) acc[i][j] = (v16){};
    for (int64_t d = 0; d < D; d++) {
        v16 kv[CG];
        for (int j = 0; j < CG; j++) kv[j] = *(const v16 *)(Kt + d * KB + VW * j);
        for (int i = 0; i < nr; i++) {
            const v16 qb = (v16){} + Q[i * D + d];
            for (int j = 0; j < CG; j++) acc[i][j] += qb * kv[j];
        }
    }
    for (int i = 0; i < nr; i++) for (int j = 0; j < CG; j++) *(v16 *)(Sc + i * KB + VW * j) = acc[i][j];
}

/* O[r][d0:d0+CG*VW] += P[r][:nk] @ V[:nk][d0:d0+CG*VW] */
static inline __attribute__((always_inline)) void pv_rows(
    const int nr, const float *P, const float *V, int64_t D, int64_t nk, float *O)
{
    v16 acc[QR][CG];
    for (int i = 0; i < nr; i++) for (int j = 0; j < CG; j++) acc[i][j] = *(const v16 *)(O + i * D + VW * j);
    for (int64_t k = 0; k < nk; k++) {
        v16 vv[CG];
        for (int j = 0; j < CG; j++) vv[j] = *(const v16 *)(V + k * D + VW * j);
        for (int i = 0; i < nr; i++) {
            const v16 pb = (v16){} + P[i * KB + k];
            for (int j = 0; j < CG; j++) acc[i][j] += pb * vv[j];
        }
    }
    for (int i = 0; i < nr; i++) for (int j = 0; j < CG; j++) *(v16 *)(O + i * D + VW * j) = acc[i][j];
}

/* the tile functions for a row count known at compile time: nr is 1..QR */
#define ROWS(F, nr, ...) do { switch (nr) { \
    case 1: F(1, __VA_ARGS__); break; \
    case 2: F(2, __VA_ARGS__); break; \
    case 3: if (QR >= 3) F(3, __VA_ARGS__); break; \
    case 4: if (QR >= 4) F(4, __VA_ARGS__); break; \
    default: break; } } while (0)

/* a block's scores, CG * VW keys at a time */
static void qk(int nr, const float *Q, int64_t D, const float *Kt, float *Sc) {
    for (int c = 0; c < KB; c += CG * VW) ROWS(qk_rows, nr, Q, D, Kt + c, Sc + c);
}

static void pv(int nr, const float *P, const float *V, int64_t D, int64_t nk, float *O) {
    ROWS(pv_rows, nr, P, V, D, nk, O);
}

int64_t kvtier_prefill_vector_floats(void) { return VW; }

int64_t kvtier_prefill_scratch(int64_t S, int64_t D, int64_t G) {
    const int64_t nb = (S + KB - 1) / KB, R = RT + G;
    return nb * KB * D * 2 + R * KB + R * D * 2 + R * 2 + 64;
}

/* q: [T, H, D] rows q_row floats apart (H = Hkv * G, query head h reads KV head h / G);
   k, v: [S, Hkv, D] rows k_row and v_row floats apart; out: [T, H, D] contiguous. Query t sits at
   position S - T + t and sees keys 0..S - T + t. Heads [h0, h1), query rows [t0, t1). */
void kvtier_prefill_attention(
    const float *q, int64_t q_row, const float *k, int64_t k_row, const float *v, int64_t v_row,
    float *out,
    int64_t T, int64_t S, int64_t Hkv, int64_t G, int64_t D, float scale, float *scratch,
    int64_t h0, int64_t h1, int64_t t0, int64_t t1)
{
    const int64_t H = Hkv * G, nb = (S - T + t1 + KB - 1) / KB;
    int64_t TQ = RT / G; if (TQ < 1) TQ = 1;
    const int64_t RM = TQ * G;
    float *Kt = scratch, *Vs = Kt + nb * KB * D, *Sc = Vs + nb * KB * D;
    float *Qt = Sc + RM * KB, *O = Qt + RM * D, *m = O + RM * D, *l = m + RM;
    const float c = scale * 1.44269504088896341f;
    for (int64_t hk = h0; hk < h1; hk++) {
        /* keys scaled into log2 units, transposed a block at a time ([nb][D][KB]); values [S][D] */
        const int64_t ns = S - T + t1;
        for (int64_t b = 0; b < nb; b++) {
            float *kt = Kt + b * KB * D;
            for (int64_t j = 0; j < KB; j++) {
                const int64_t s = b * KB + j;
                float *vr = Vs + s * D;
                if (s < ns) {
                    const float *kr = k + s * k_row + hk * D, *vsrc = v + s * v_row + hk * D;
                    for (int64_t d = 0; d < D; d++) kt[d * KB + j] = kr[d] * c;
                    memcpy(vr, vsrc, D * sizeof(float));
                } else {
                    for (int64_t d = 0; d < D; d++) kt[d * KB + j] = 0.f;
                    memset(vr, 0, D * sizeof(float));
                }
            }
        }
        for (int64_t ta = t0; ta < t1; ta += TQ) {
            const int64_t tb = ta + TQ < t1 ? ta + TQ : t1, R = (tb - ta) * G;
            for (int64_t r = 0; r < R; r++) {
                const int64_t t = ta + r / G, h = hk * G + r % G;
                memcpy(Qt + r * D, q + t * q_row + h * D, D * sizeof(float));
                memset(O + r * D, 0, D * sizeof(float));
                m[r] = NEG; l[r] = 0.f;
            }
            const int64_t first = S - T + ta, last = S - T + tb - 1;  /* positions */
            for (int64_t kb = 0; kb <= last; kb += KB) {
                const float *kt = Kt + (kb / KB) * KB * D, *vb = Vs + kb * D;
                const int64_t nk = last + 1 - kb < KB ? last + 1 - kb : KB;
                for (int64_t r = 0; r < R; r += QR) {
                    const int nr = R - r < QR ? (int)(R - r) : QR;
                    qk(nr, Qt + r * D, D, kt, Sc + r * KB);
                }
                const int masked = kb + KB - 1 > first;
                for (int64_t r = 0; r < R; r++) {
                    float *sr = Sc + r * KB;
                    if (masked) {
                        const int64_t pos = first + r / G;
                        for (int64_t j = 0; j < KB; j++) if (kb + j > pos) sr[j] = NEG;
                    }
                    v16 mx = *(v16 *)sr;
                    for (int j = 1; j < KV; j++) { v16 x = *(v16 *)(sr + VW * j); mx = sel(x > mx, x, mx); }
                    float mnew = m[r];
                    for (int j = 0; j < VW; j++) mnew = mx[j] > mnew ? mx[j] : mnew;
                    const float alpha = exp2f(m[r] - mnew);
                    v16 sum = (v16){};
                    for (int j = 0; j < KV; j++) {
                        v16 p = exp2v(*(v16 *)(sr + VW * j) - mnew);
                        *(v16 *)(sr + VW * j) = p; sum += p;
                    }
                    float ssum = 0.f;
                    for (int j = 0; j < VW; j++) ssum += sum[j];
                    l[r] = l[r] * alpha + ssum;
                    m[r] = mnew;
                    if (alpha != 1.f) for (int64_t d = 0; d < D; d++) O[r * D + d] *= alpha;
                }
                for (int64_t r = 0; r < R; r += QR) {
                    const int nr = R - r < QR ? (int)(R - r) : QR;
                    for (int64_t d0 = 0; d0 < D; d0 += CG * VW)
                        pv(nr, Sc + r * KB, vb + d0, D, nk, O + r * D + d0);
                }
            }
            for (int64_t r = 0; r < R; r++) {
                const int64_t t = ta + r / G, h = hk * G + r % G;
                const float inv = 1.f / l[r];
                float *dst = out + t * H * D + h * D;
                for (int64_t d = 0; d < D; d++) dst[d] = O[r * D + d] * inv;
            }
        }
    }
}
"""

_p, _i64 = ctypes.c_void_p, ctypes.c_int64
_KERNEL = CKernel(
    "prefill_attention",
    _SOURCE,
    "kvtier_prefill_attention",
    [_p, _i64, _p, _i64, _p, _i64, _p, _i64, _i64, _i64, _i64, _i64, ctypes.c_float, _p]
    + [_i64] * 4,
    "KVTIER_CPU_PREFILL_KERNEL",
)
_pool: ThreadPoolExecutor | None = None
MIN_PART_QUERIES = 32


def enabled() -> bool:
    """Built here and not turned off with ``KVTIER_CPU_PREFILL_KERNEL=0``."""
    return _KERNEL.enabled()


def vector_floats() -> int:
    """Floats in one vector of the built kernel (16 AVX-512, 8 AVX2, 4 otherwise)."""
    if not _KERNEL.function():
        raise RuntimeError("CPU prefill attention is not available here")
    width = _KERNEL.symbol_of("kvtier_prefill_vector_floats", [], _i64)
    return int(width())  # type: ignore[operator]


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether ``prefill_attention`` takes these tensors as they are (float32 on the CPU,
    head dim a multiple of 64, each row's heads contiguous; rows any distance apart)."""
    dim = q.shape[-1]
    return (
        q.dtype == k.dtype == v.dtype == torch.float32
        and q.device.type == k.device.type == v.device.type == "cpu"
        and dim % 64 == 0
        and k.shape == v.shape
        and k.shape[-1] == dim
        and q.shape[1] % k.shape[1] == 0
        and q.shape[0] <= k.shape[0]
        and q.stride(2) == k.stride(2) == v.stride(2) == 1
        and q.stride(1) == k.stride(1) == v.stride(1) == dim
    )


def _parts(
    num_kv_heads: int, num_q: int, num_keys: int, threads: int
) -> list[tuple[int, int, int]]:
    """(KV head, first query, end query) parts for ``threads`` workers: each head's queries
    cut into ranges of equal causal work (query ``t`` reads ``num_keys - num_q + t + 1`` keys)."""
    # two parts a worker (a pool thread takes the next as it finishes: 3 heads on 2 threads)
    per_head = max(1, math.ceil(2 * threads / num_kv_heads)) if threads > 1 else 1
    # each part packs its head's keys again: a short chunk over a long context is split by
    # heads only (at least MIN_PART_QUERIES queries a part)
    per_head = max(1, min(per_head, num_q // MIN_PART_QUERIES))
    offset = num_keys - num_q
    total = num_q * (offset + 1) + num_q * (num_q - 1) / 2
    cuts = [0]
    for i in range(1, per_head):
        # the t at which the work before it is i / per_head of the total: a quadratic in t
        want = total * i / per_head
        b = offset + 0.5
        t = int(-b + math.sqrt(b * b + 2 * want))
        cuts.append(min(max(t, cuts[-1] + 1), num_q))
    cuts.append(num_q)
    return [
        (h, a, b)
        for h in range(num_kv_heads)
        for a, b in zip(cuts, cuts[1:], strict=False)
        if b > a
    ]


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    threads: int | None = None,
) -> torch.Tensor:
    """Causal attention of ``q [T, H, D]`` over ``k, v [S, Hkv, D]`` (``S >= T``: query ``t``
    sits at ``S - T + t`` and sees keys up to it; query head ``h`` reads KV head ``h // (H //
    Hkv)``), returned as ``[T, H * D]``. ``out``: a contiguous ``[T, H, D]`` or ``[T, H * D]``
    float32 tensor to write into. ``threads``: workers (None: ``torch.get_num_threads()``).
    Call only when ``enabled()`` and ``supports(q, k, v)`` (ValueError otherwise)."""
    fn = _KERNEL.function()
    if not fn:
        raise RuntimeError("CPU prefill attention is not available here")
    if not supports(q, k, v):
        raise ValueError(
            "prefill_attention: float32 CPU q [T, H, D], k, v [S, Hkv, D], D % 64 == 0"
        )
    num_q, num_heads, dim = q.shape
    num_keys, num_kv_heads = k.shape[0], k.shape[1]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty(num_q, num_heads * dim, dtype=torch.float32)
    if not out.is_contiguous() or out.numel() != num_q * num_heads * dim:
        raise ValueError("prefill_attention: out must be a contiguous [T, H * D] float32 tensor")
    scratch_size = _KERNEL.symbol_of("kvtier_prefill_scratch", [_i64, _i64, _i64], _i64)
    floats = scratch_size(num_keys, dim, group)  # type: ignore[operator]
    workers = torch.get_num_threads() if threads is None else threads
    parts = _parts(num_kv_heads, num_q, num_keys, workers)

    def run(part: tuple[int, int, int], scratch: torch.Tensor | None = None) -> None:
        head, first, end = part
        if scratch is None:
            scratch = torch.empty(floats, dtype=torch.float32)
        fn(  # type: ignore[operator]
            q.data_ptr(),
            q.stride(0),
            k.data_ptr(),
            k.stride(0),
            v.data_ptr(),
            v.stride(0),
            out.data_ptr(),
            num_q,
            num_keys,
            num_kv_heads,
            group,
            dim,
            scale,
            scratch.data_ptr(),
            head,
            head + 1,
            first,
            end,
        )

    if workers <= 1 or len(parts) == 1:
        scratch = torch.empty(floats, dtype=torch.float32)  # one for the parts in turn
        for part in parts:
            run(part, scratch)
    else:
        global _pool
        if _pool is None or _pool._max_workers < workers:  # noqa: SLF001
            _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvtier-attn")
        for f in [_pool.submit(run, part) for part in parts]:
            f.result()
    return out.view(num_q, num_heads * dim)
