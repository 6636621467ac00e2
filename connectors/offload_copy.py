"""Whole-block copies between the KV cache and a flat uint8 host buffer (the host tier's slab).

A block of the block-major cache is one contiguous run of ``bytes_per_block`` bytes, and a host
slot holds one encoded block whose payload is one contiguous run too, so every transfer is one
``copy_`` of ``bytes_per_block`` bytes (2 MiB for Llama-3-8B: link speed, DESIGN.md "Physics").
No staging tensor and no allocation per call: the copies read and write the slab in place.

With a CUDA cache the copies are ``non_blocking`` and go to the current stream (the caller puts
them on its side stream and records an event); the host buffer must stay untouched (pinned
entries) until that event completed. With a CPU cache they are plain synchronous memcpys.
Not thread-safe: one caller (the engine thread) at a time.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.kv_cache import KVCache


class SlabCopier:
    def __init__(self, kv_cache: KVCache, host: torch.Tensor, *, layered: bool = False) -> None:
        """``host``: a 1-D uint8 tensor (the slab). ``layered``: enable ``to_device_layers``
        where it can run. Raises ValueError for anything else."""
        if host.dtype != torch.uint8 or host.dim() != 1:
            raise ValueError("host buffer must be a 1-D uint8 tensor")
        self.nbytes = kv_cache.bytes_per_block
        # [num_blocks, bytes_per_block] uint8 view of the cache: row b IS block b (no copy).
        self._rows = kv_cache.tensor.reshape(kv_cache.num_blocks, -1).view(torch.uint8)
        self._host = host
        self._non_blocking = kv_cache.device.type == "cuda"
        spec = kv_cache.spec
        self._num_layers = spec.num_layers
        self._words = None  # [num_blocks, words_per_block] int32 view: the layer kernel's target
        if layered and self._non_blocking and self.nbytes % (4 * spec.num_layers) == 0 \
                and host.is_pinned() and host.data_ptr() % 16 == 0:
            from engine.kernels import fused_kernels_available

            if fused_kernels_available(kv_cache.device):
                self._words = kv_cache.tensor.reshape(kv_cache.num_blocks, -1).view(torch.int32)

    @property
    def layered(self) -> bool:
        """Whether ``to_device_layers`` can run (CUDA, Triton, a pinned 16-byte aligned slab)."""
        return self._words is not None

    def to_device_layers(self, block_ids: Sequence[int], offsets: Sequence[int]) -> list[object]:
        """Like ``to_device``, as one kernel per layer on the current stream (see
        ``engine.kernels.copy_layer_from_host``); returns one CUDA event per layer, recorded
        after that layer's copy (the last one with timing). Offsets must be multiples of 16.
        Raises ValueError otherwise or when not ``layered``."""
        from engine.kernels import copy_layer_from_host

        if self._words is None:
            raise ValueError("layer-wise copies need CUDA, Triton and a pinned aligned slab")
        if any(o % 16 for o in offsets):
            raise ValueError("layer-wise copies need 16-byte aligned payload offsets")
        index = torch.tensor([list(block_ids), [o // 4 for o in offsets]], dtype=torch.int64)
        index = index.pin_memory().to(self._words.device, non_blocking=True)
        chunk = self._words.shape[1] // self._num_layers
        events: list[object] = []
        last = self._num_layers - 1
        for layer in range(self._num_layers):
            copy_layer_from_host(self._host, index[1], self._words, index[0], layer * chunk, chunk)
            event = torch.cuda.Event(enable_timing=layer == last)  # the last one times the load
            event.record()
            events.append(event)
        return events

    def to_device(self, block_ids: Sequence[int], offsets: Sequence[int]) -> None:
        """Copy the payload at host byte ``offsets[i]`` into cache block ``block_ids[i]``."""
        rows, host, n, nb = self._rows, self._host, self.nbytes, self._non_blocking
        for block_id, offset in zip(block_ids, offsets, strict=True):
            rows[block_id].copy_(host[offset:offset + n], non_blocking=nb)

    def to_host(self, block_ids: Sequence[int], offsets: Sequence[int]) -> None:
        """Copy cache block ``block_ids[i]`` to host byte ``offsets[i]`` (reads the cache
        itself: on CUDA, call ``gather`` first when the blocks may be rewritten meanwhile)."""
        self.rows_to_host(self._rows, block_ids, offsets)

    def gather(self, block_ids: Sequence[int]) -> torch.Tensor:
        """A ``[n, bytes_per_block]`` uint8 copy of the blocks on the cache's device (one
        ``index_select``: device-speed, so the blocks may be reused once it ran)."""
        ids = torch.as_tensor(list(block_ids), dtype=torch.long, device=self._rows.device)
        return self._rows.index_select(0, ids)

    def rows_to_host(self, src: torch.Tensor, rows: Sequence[int], offsets: Sequence[int]) -> None:
        """Copy ``src[rows[i]]`` (uint8 rows of ``bytes_per_block``) to host byte ``offsets[i]``."""
        host, n, nb = self._host, self.nbytes, self._non_blocking
        for row, offset in zip(rows, offsets, strict=True):
            host[offset:offset + n].copy_(src[row], non_blocking=nb)
