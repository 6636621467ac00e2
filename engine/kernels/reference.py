"""Torch definitions of what two fused kernels compute, kept below the kernels' users.

``rotary`` is the torch path's rotary embedding (``RotaryEmbedding.apply`` in
engine/models/layers.py runs it); ``write_kv`` stores k/v at flat slots as ``rotary_and_cache``
does. The kernels' start-up self-check (``engine.kernels.fused_kernels_available``) compares
``rotary`` and ``rotary_and_cache`` with them, so it reaches no module above ``engine.kernels``.
Plain torch, any device.
"""

from __future__ import annotations

import torch


def rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` for ``x [T, H, D]``; returns a new tensor."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, swapped, sin_signed)


def write_kv(
    kv_layer: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Store new tokens' k/v ``[T, Hkv, D]`` into a layer view at flat slots (in place)."""
    block_size = kv_layer.shape[2]
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping % block_size
    # Advanced indexing on the strided view writes through to the block-major tensor.
    kv_layer[blocks, 0, offsets] = k.to(kv_layer.dtype)
    kv_layer[blocks, 1, offsets] = v.to(kv_layer.dtype)
