"""The paged KV cache: ONE block-major tensor ``[num_blocks, num_layers, 2, block_size,
num_kv_heads, head_dim]`` (DESIGN.md "Physics").

One block's KV for every layer is one contiguous run of ``bytes_per_block`` bytes, so the
offload connector moves a whole block with one copy (``gather_blocks``/``scatter_blocks``),
while attention reads the per-layer strided view ``layer_view(i)`` =
``[num_blocks, 2, block_size, num_kv_heads, head_dim]``.

One extra scratch block sits past the end (id ``num_blocks``, never handed to the scheduler):
CUDA-graph padding rows write their KV there and attend over it, so a padded decode batch never
touches a real block. ``attention_view(i)`` is the layer view including it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """The shape of one block; enough to size the cache before allocating it."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int = 16

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one block: ``[num_layers, 2, block_size, num_kv_heads, head_dim]``."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        n = 1
        for d in self.block_shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


class KVCache:
    """Owns the cache tensor. Not thread-safe; block ids are validated by the caller
    (the runner checks block tables against ``num_blocks``)."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device | str) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.spec = spec
        self.num_blocks = num_blocks
        # Zeroed so padding rows read by a kernel are finite; the cost is a one-time memset.
        self._storage = torch.zeros(
            (num_blocks + 1, *spec.block_shape), dtype=spec.dtype, device=device
        )
        # The blocks the scheduler manages: a contiguous prefix view of the storage.
        self.tensor = self._storage[:num_blocks]
        self._layer_ready: list[Any] | None = None  # see set_layer_ready
        self._ensure_layer: Callable[[int], None] | None = None

    @property
    def scratch_block_id(self) -> int:
        """The block past the end reserved for padding rows (never in a block table)."""
        return self.num_blocks

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def bytes_per_block(self) -> int:
        return self.spec.bytes_per_block

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    def byte_rows(self) -> torch.Tensor:
        """``[num_blocks, bytes_per_block]`` uint8 view: row ``b`` IS block ``b`` (no copy)."""
        return self.tensor.reshape(self.num_blocks, -1).view(torch.uint8)

    def layer_view(self, layer_idx: int) -> torch.Tensor:
        """Strided view ``[num_blocks, 2, block_size, kv_heads, head_dim]`` of one layer
        (no copy; writes go to the cache)."""
        return self.tensor[:, layer_idx]

    def attention_view(self, layer_idx: int) -> torch.Tensor:
        """Like ``layer_view`` but ``num_blocks + 1`` blocks long: the scratch block included,
        so attention may address ``scratch_block_id``. What the models hand to attention.
        With layer events set (``set_layer_ready``), the current stream first waits for this
        layer's event (its copies issued first where they are issued on demand)."""
        if self._layer_ready is not None:
            if self._ensure_layer is not None:
                self._ensure_layer(layer_idx)
            torch.cuda.current_stream(self.device).wait_event(self._layer_ready[layer_idx])
        return self._storage[:, layer_idx]

    def set_layer_ready(
        self, events: list[Any], ensure: Callable[[int], None] | None = None
    ) -> None:
        """CUDA events, one per layer, that reads of each layer wait for until
        ``clear_layer_ready``: blocks landing layer by layer from a side stream while the
        forward that reads them runs (the KV connector's in-step loads). ``ensure(layer)``:
        called before a read of ``layer`` waits, to issue the copies its event follows (an
        event waited for before it is recorded would not hold the read back); the last
        layer's at ``wait_all_layers`` and ``clear_layer_ready``. Raises ValueError unless one
        event per layer."""
        if len(events) != self.spec.num_layers:
            raise ValueError(f"{len(events)} layer events for {self.spec.num_layers} layers")
        self._layer_ready = events
        self._ensure_layer = ensure

    def wait_all_layers(self) -> None:
        """The current stream waits for every pending layer (a forward that cannot wait layer
        by layer, e.g. a CUDA-graph replay); then clears them."""
        if self._layer_ready is not None:
            if self._ensure_layer is not None:
                self._ensure_layer(self.spec.num_layers - 1)
            torch.cuda.current_stream(self.device).wait_event(self._layer_ready[-1])
        self._layer_ready = self._ensure_layer = None

    def clear_layer_ready(self) -> None:
        """After the forward that read the loaded blocks was enqueued (every copy left is
        issued now)."""
        if self._layer_ready is not None and self._ensure_layer is not None:
            self._ensure_layer(self.spec.num_layers - 1)
        self._layer_ready = self._ensure_layer = None

    def gather_blocks(self, block_ids: list[int] | torch.Tensor) -> torch.Tensor:
        """Copy whole blocks out: ``[n, num_layers, 2, block_size, kv_heads, head_dim]``, a new
        contiguous tensor on the cache's device (one ``index_select``)."""
        ids = self._ids(block_ids)
        out = torch.empty(
            (ids.numel(), *self.spec.block_shape), dtype=self.spec.dtype, device=self.device
        )
        torch.index_select(self._words(self.tensor), 0, ids, out=self._words(out))
        return out

    def scatter_blocks(self, block_ids: list[int] | torch.Tensor, data: torch.Tensor) -> None:
        """Overwrite whole blocks in place from ``data`` shaped like ``gather_blocks``' result
        (any device; copied to the cache's device and dtype). Raises ValueError on a bad shape."""
        ids = self._ids(block_ids)
        expected = (ids.numel(), *self.spec.block_shape)
        if tuple(data.shape) != expected:
            raise ValueError(f"scatter_blocks: data shape {tuple(data.shape)} != {expected}")
        data = data.to(device=self.tensor.device, dtype=self.tensor.dtype).contiguous()
        self._words(self.tensor).index_copy_(0, ids, self._words(data))

    @staticmethod
    def _words(blocks: torch.Tensor) -> torch.Tensor:
        """``[n, words]`` 8-byte view of contiguous whole blocks: index kernels move a block
        as 8-byte words instead of 2-byte elements (4x fewer, measured in bench/offload/main.py
        "transfer"). Block bytes are a multiple of 8 (2 x block_size x ... elements)."""
        return blocks.view(blocks.shape[0], -1).view(torch.int64)

    def _ids(self, block_ids: list[int] | torch.Tensor) -> torch.Tensor:
        """Validated on the host (no device sync), then moved to the cache's device."""
        ids = torch.as_tensor(block_ids, dtype=torch.long)
        if ids.device.type != "cpu":
            ids = ids.cpu()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_blocks):
            raise ValueError(f"block id out of range [0, {self.num_blocks})")
        return ids.to(self.tensor.device)
