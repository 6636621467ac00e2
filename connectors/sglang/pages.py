"""SGLang's host KV pool seen page by page: the bytes of one stored page, zero copy.

SGLang's host pool (``HostKVCache``: ``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost``)
hands out a page's memory as raw pointers and sizes (``get_page_buffer_meta(host_indices)``,
what its Mooncake, 3FS and NIXL backends read and write in place) and as one flat tensor
(``get_data_page`` / ``set_from_flat_data_page``, the generic path). ``HostPages`` turns the
pointers into writable memoryviews over the pool (bounds-checked against the pool's own
buffers: a pointer outside them is a RuntimeError, never a stray write), in the order of
SGLang's flat page, so both paths store the same bytes:

- MHA: SGLang lists ``K, V`` pointers per page (per layer too in ``layer_first``); the stored
  payload is every K segment, then every V segment (``[2, ...]`` as the flat page);
- MLA: one latent buffer; the segments as listed (one a page in ``page_first``, one a layer
  in ``layer_first``).

A page's payload is ``page_bytes`` long; the layout's name (``keys.layout_name``) goes into
the namespace, so pages of two layouts never share a key. Torch is used only to read the
pool's tensors and indices. Not thread-safe state: none (views are built per call).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import torch

from connectors.sglang.keys import layout_name


class HostPages:
    def __init__(self, pool: Any, is_mla: bool, shard: str = "") -> None:
        """Raises ValueError when the pool's page pointers and its flat page disagree."""
        self.pool = pool
        self.is_mla = is_mla
        self.page_size = int(pool.page_size)
        self.dtype = str(pool.dtype).removeprefix("torch.")
        self.host_layout = str(pool.layout)
        self._ranges = _buffer_ranges(pool)
        flat = pool.get_dummy_flat_data_page()
        self.page_bytes = flat.numel() * flat.element_size()
        _, sizes = pool.get_page_buffer_meta(torch.arange(self.page_size, dtype=torch.int64))
        self.zero_copy = sum(sizes) == self.page_bytes
        heads, head_dim, v_dim = _geometry(pool, is_mla)
        self.layout = layout_name(
            "mla" if is_mla else "mha",
            self.dtype,
            int(pool.layer_num),
            heads,
            head_dim,
            v_dim,
            self.page_size,
            self.host_layout,
            shard,
        )

    def views(self, host_indices: torch.Tensor) -> list[list[memoryview]]:
        """Per page of ``host_indices`` (``page_size`` slots a page, as SGLang passes them),
        the page's segments as writable memoryviews over the pool, in payload order.
        Raises RuntimeError for a pointer outside the pool, ValueError for a bad length."""
        if not self.zero_copy:
            raise RuntimeError(
                f"kvtier: host layout {self.host_layout} has no zero-copy "
                "page view; leave 'interface_v1' out of the extra config"
            )
        if host_indices.numel() % self.page_size:
            raise ValueError(
                f"kvtier: {host_indices.numel()} host indices is not a whole "
                f"number of {self.page_size}-token pages"
            )
        num_pages = host_indices.numel() // self.page_size
        if num_pages == 0:
            return []
        ptrs, sizes = self.pool.get_page_buffer_meta(host_indices)
        per = len(ptrs) // num_pages
        out = []
        for p in range(num_pages):
            segs = [self._view(ptrs[i], sizes[i]) for i in range(p * per, (p + 1) * per)]
            if not self.is_mla:  # K, V, K, V, ... -> K..., V... (the flat page's order)
                segs = segs[0::2] + segs[1::2]
            out.append(segs)
        return out

    def _view(self, ptr: int, size: int) -> memoryview:
        ptr, size = int(ptr), int(size)
        if not any(lo <= ptr and ptr + size <= hi for lo, hi in self._ranges):
            raise RuntimeError(
                f"kvtier: SGLang handed a page segment at {ptr:#x}+{size} "
                "outside its host pool's buffers"
            )
        return memoryview((ctypes.c_ubyte * size).from_address(ptr)).cast("B")


def _buffer_ranges(pool: Any) -> list[tuple[int, int]]:
    ranges = []
    for name in ("kv_buffer", "k_buffer", "v_buffer", "index_k_buffer"):
        try:
            t = getattr(pool, name, None)
        except Exception:  # a property some layouts do not have
            t = None
        if isinstance(t, torch.Tensor) and t.numel():
            ranges.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
    return ranges


def _geometry(pool: Any, is_mla: bool) -> tuple[int, int, int]:
    """(heads, K head dim, V head dim) of a page, for the layout name."""
    if is_mla:
        dim = int(getattr(pool, "kv_lora_rank", 0)) + int(getattr(pool, "qk_rope_head_dim", 0))
        return 1, dim, dim
    head_dim = int(pool.head_dim)
    return int(pool.head_num), head_dim, int(getattr(pool, "v_head_dim", head_dim))


def copy_in(segments: Sequence[memoryview], payload: memoryview) -> None:
    """Scatter ``payload`` over ``segments`` (mutates them). ValueError on a size mismatch."""
    if sum(s.nbytes for s in segments) != payload.nbytes:
        raise ValueError("kvtier: payload and page sizes differ")
    pos = 0
    for seg in segments:
        seg[:] = payload[pos : pos + seg.nbytes]
        pos += seg.nbytes


def copy_out(segments: Sequence[memoryview], out: memoryview) -> None:
    """Gather ``segments`` into ``out`` (mutates it)."""
    pos = 0
    for seg in segments:
        out[pos : pos + seg.nbytes] = seg
        pos += seg.nbytes
