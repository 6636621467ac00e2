"""Fused Triton kernels for the decoder's small elementwise steps (CUDA only).

A Llama decode step at batch 1 is launch-bound outside the matmuls: every layer runs a residual
add, an RMSNorm, a SiLU, a multiply, ... each a ~2 us kernel inside the CUDA graph. Two fused
kernels remove most of them:

- ``fused_add_rms_norm(x, residual, weight, eps)`` -> ``(normed, new_residual)``: one kernel
  for ``r = x + residual; normed = rms_norm(r) * weight``;
- ``silu_and_mul(gate_up)`` -> ``silu(gate) * up`` over the merged gate/up projection output;
- ``rotary(x, cos, sin_signed)``: the rotate-half rotary embedding of q and k (read in place
  from the fused qkv output) in one kernel instead of three.

Triton is imported lazily (only when ``fused_kernels_available`` or a kernel is called), so the
package itself imports on a machine without it. ``fused_kernels_available(device)`` is the one
switch the runner uses: True only on CUDA, with Triton importable, after a one-time self-check
of both kernels against the torch reference on that device (a kernel that fails to compile or
disagrees turns the fused path off with a warning instead of breaking the engine).
"""

from __future__ import annotations

import logging

import torch

from engine.kernels import reference

logger = logging.getLogger(__name__)

_CHECKED: dict[str, bool] = {}


def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual) * weight, x + residual)``, both new tensors in x's dtype.
    Does not mutate its inputs. Raises ImportError without Triton."""
    from engine.kernels.triton_ops import add_rms_norm

    return add_rms_norm(x, residual, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` of shape ``[T, 2I]`` -> ``[T, I]``,
    computed in float32, rounded once. Raises ImportError without Triton."""
    from engine.kernels.triton_ops import silu_and_mul as _silu_and_mul

    return _silu_and_mul(gate_up)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` for ``x [T, H, D]`` (any token/head strides, unit
    last stride) with ``cos``/``sin_signed`` ``[T, 1, D]`` as ``RotaryEmbedding.cos_sin``
    returns them (the sign of the first half lives in the table). Returns a new contiguous
    ``[T, H, D]`` tensor; computed in float32, rounded once. Raises ImportError without Triton."""
    from engine.kernels.triton_ops import rotary as _rotary

    return _rotary(x, cos, sin_signed)


def linear(x: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor:
    """``x @ layer.weight.T (+ layer.bias)`` for a linear layer, or for an embedding used as a
    tied output head (no bias); a single CUDA row (batch-1 decode) goes through the Triton
    ``gemv`` (engine/kernels/gemv.py: the small projections at HBM speed where cuBLAS's M=1
    kernels are not), anything else through ``F.linear``. For the fused path (CUDA + Triton)."""
    w = getattr(layer, "weight", None)
    if w is None:  # a packed CPU linear (engine/models/cpu_linear.py) has its own kernel
        return layer(x)
    bias = getattr(layer, "bias", None)
    if x.dim() == 2 and x.shape[0] == 1 and x.is_cuda and x.stride(1) == 1 and w.stride(1) == 1:
        from engine.kernels.gemv import gemv

        y = gemv(x, w)
        return y if bias is None else y + bias
    return torch.nn.functional.linear(x, w, bias)


def rotary_and_cache(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin_signed: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    kv_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Rotary on q and k of a fused ``qkv [T, (Hq + 2 Hkv) * D]`` row and the new K/V stored
    in the cache, in one kernel: returns the rotated ``[T, Hq + Hkv, D]`` (q heads, then k
    heads) and writes rotated k and v at ``slot_mapping[t]`` of ``kv_layer`` (a
    ``[blocks, 2, block_size, Hkv, D]`` layer view, mutated in place): what
    ``reference.rotary`` plus ``reference.write_kv`` compute. Raises ImportError without Triton."""
    from engine.kernels.triton_ops import rotary_and_cache as _rotary_and_cache

    return _rotary_and_cache(qkv, cos, sin_signed, num_heads, num_kv_heads, kv_layer, slot_mapping)


def copy_layer_from_host(
    src: torch.Tensor,
    src_word_offsets: torch.Tensor,
    dst_words: torch.Tensor,
    dst_rows: torch.Tensor,
    chunk_start: int,
    chunk_words: int,
    programs: int = 0,
) -> None:
    """Copy one layer's chunk of many blocks from host memory into the cache, as one kernel
    that reads the (pinned, device-mapped) host bytes directly: for each i, words
    ``[chunk_start, chunk_start + chunk_words)`` of the block whose payload starts at 4-byte
    word ``src_word_offsets[i]`` of ``src`` go to the same words of row ``dst_rows[i]`` of
    ``dst_words`` (the cache as ``[rows, words_per_block]`` int32). What lets a reload land
    layer by layer (a DMA copy per block and layer would be thousands of calls). Asynchronous
    on the current stream: ``src`` must stay untouched until it ran. Payloads must be 16-byte
    aligned (their offsets multiples of 4 words). ``programs`` > 0: at most that many
    programs, each looping over its share (a copy that leaves the SMs to the forward beside
    it); 0: one program per 8 KiB tile. Raises ValueError on a bad argument and ImportError
    without Triton."""
    from engine.kernels.triton_ops import copy_layer_from_host as _copy

    _copy(src, src_word_offsets, dst_words, dst_rows, chunk_start, chunk_words, programs)


def _self_check(device: torch.device) -> None:
    """Run each kernel once on small bf16 inputs and compare to torch (the torch path's own
    rotary and KV write, ``reference``); raises on mismatch."""
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(3, 256, device=device, generator=gen).to(torch.bfloat16)
    r = torch.randn(3, 256, device=device, generator=gen).to(torch.bfloat16)
    w = torch.rand(256, device=device, generator=gen).to(torch.bfloat16) + 0.5
    normed, new_r = fused_add_rms_norm(x, r, w, 1e-5)
    ref_r = x + r
    ref = torch.nn.functional.rms_norm(ref_r, (256,), w, 1e-5)
    torch.testing.assert_close(new_r, ref_r, rtol=0, atol=0)
    torch.testing.assert_close(normed.float(), ref.float(), rtol=2e-2, atol=2e-2)
    gu = torch.randn(3, 512, device=device, generator=gen).to(torch.bfloat16)
    ref_act = torch.nn.functional.silu(gu[:, :256].float()) * gu[:, 256:].float()
    torch.testing.assert_close(silu_and_mul(gu).float(), ref_act, rtol=2e-2, atol=2e-2)
    qk = torch.randn(3, 6, 64, device=device, generator=gen).to(torch.bfloat16)
    cos = torch.rand(3, 1, 64, device=device, generator=gen).to(torch.bfloat16)
    sin = torch.rand(3, 1, 64, device=device, generator=gen).to(torch.bfloat16)
    ref_rot = reference.rotary(qk.float(), cos.float(), sin.float())
    torch.testing.assert_close(rotary(qk, cos, sin).float(), ref_rot, rtol=2e-2, atol=2e-2)
    qkv = torch.randn(3, 8 * 64, device=device, generator=gen).to(torch.bfloat16)  # 4 q, 2 kv
    cache = torch.zeros(3, 2, 4, 2, 64, dtype=torch.bfloat16, device=device)
    ref_cache = cache.clone()
    slots = torch.tensor([1, 6, 11], device=device)
    out = rotary_and_cache(qkv, cos, sin, 4, 2, cache, slots)
    ref_qk = reference.rotary(qkv[:, : 6 * 64].view(3, 6, 64).float(), cos.float(), sin.float())
    reference.write_kv(
        ref_cache, slots, ref_qk[:, 4:].to(torch.bfloat16), qkv[:, 6 * 64 :].view(3, 2, 64)
    )
    torch.testing.assert_close(out.float(), ref_qk, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(cache.float(), ref_cache.float(), rtol=2e-2, atol=2e-2)
    from engine.kernels.gemv import gemv

    xs = torch.randn(1, 300, device=device, generator=gen).to(torch.bfloat16)
    ws = torch.randn(37, 300, device=device, generator=gen).to(torch.bfloat16)
    torch.testing.assert_close(
        gemv(xs, ws).float(), xs.float() @ ws.float().T, rtol=2e-2, atol=5e-2
    )
    from engine.kernels.decode_attention import paged_decode_attention

    # Decode attention, 2 requests (7 and 3 tokens) over pages [2, 0] and [1] of ``cache``.
    q = torch.randn(2, 4, 64, device=device, generator=gen).to(torch.bfloat16)
    table = torch.tensor([0, 2, 3, 3, 3, 2, 0, 1], dtype=torch.int32, device=device)
    got = paged_decode_attention(q, cache, table[:3], table[5:], table[3:5], 0.125, 2)
    for b, (pages, n) in enumerate((([2, 0], 7), ([1], 3))):
        kv = cache[pages].float()  # [pages, 2, 4, 2, 64]: page size 4, 2 kv heads
        k = kv[:, 0].reshape(-1, 2, 64)[:n].repeat_interleave(2, 1)
        v = kv[:, 1].reshape(-1, 2, 64)[:n].repeat_interleave(2, 1)
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[b].float(), k) * 0.125, dim=-1)
        torch.testing.assert_close(
            got[b].float(), torch.einsum("hn,nhd->hd", w, v), rtol=3e-2, atol=3e-2
        )


def fused_kernels_available(device: torch.device) -> bool:
    """True when the fused kernels can run on ``device``: CUDA, Triton importable, and the
    self-check passed (done once per device per process; logs why when False)."""
    if device.type != "cuda":
        return False
    key = str(device)
    if key not in _CHECKED:
        ok = triton_importable()
        if not ok:
            logger.info("fused kernels off: triton is not installed")
        else:
            try:
                _self_check(device)
            except Exception as exc:  # a broken kernel must not break the engine
                logger.warning(
                    "fused kernels off: self-check failed: %s: %s", type(exc).__name__, exc
                )
                ok = False
        _CHECKED[key] = ok
    return _CHECKED[key]


__all__ = [
    "copy_layer_from_host",
    "fused_add_rms_norm",
    "fused_kernels_available",
    "linear",
    "rotary",
    "rotary_and_cache",
    "silu_and_mul",
    "triton_importable",
]
