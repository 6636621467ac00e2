"""A CPU stand-in for SGLang's host KV pools, for the tests only.

SGLang's own host pools (``sglang.srt.mem_cache.pool_host.mha.MHATokenToKVPoolHost``,
``...mla.MLATokenToKVPoolHost``) cannot be imported without a CUDA stack: their module
imports ``memory_pool``, whose model-config imports need torchvision, and torchvision's wheel
is built for SGLang's CUDA torch. This class has the attributes and the four methods a storage
backend uses (``get_page_buffer_meta``, ``get_data_page``, ``get_dummy_flat_data_page``,
``set_from_flat_data_page``) over SGLang's documented buffer shapes:

- MHA ``page_first``: ``[2, tokens, layers, heads, dim]``; ``layer_first``:
  ``[2, layers, tokens, heads, dim]``; pointers K, V per page (per layer in layer_first);
- MLA ``page_first``: ``[tokens, layers, 1, dim]``; one pointer a page.
"""

from __future__ import annotations

import torch


class HostPoolStandIn:
    def __init__(
        self,
        layout: str = "page_first",
        *,
        mla: bool = False,
        tokens: int = 64,
        page_size: int = 4,
        layers: int = 2,
        heads: int = 2,
        head_dim: int = 16,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        self.layout, self.mla, self.size, self.page_size = layout, mla, tokens, page_size
        self.layer_num, self.dtype = layers, dtype
        self.head_num, self.head_dim, self.v_head_dim = (1 if mla else heads), head_dim, head_dim
        if mla:
            self.kv_lora_rank, self.qk_rope_head_dim = head_dim - 4, 4
            assert layout == "page_first"
            dims: tuple[int, ...] = (tokens, layers, 1, head_dim)
        elif layout == "page_first":
            dims = (2, tokens, layers, heads, head_dim)
        elif layout == "layer_first":
            dims = (2, layers, tokens, heads, head_dim)
        else:
            raise ValueError(layout)
        self.kv_buffer = torch.zeros(dims, dtype=dtype)

    def fill_random(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.kv_buffer.copy_(torch.randn(self.kv_buffer.shape, generator=g).to(self.dtype))

    def _rows(self, index: int) -> slice:
        return slice(index, index + self.page_size)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        if self.mla:
            page = self.kv_buffer[self._rows(index)]
        elif self.layout == "page_first":
            page = self.kv_buffer[:, self._rows(index)]
        else:
            page = self.kv_buffer[:, :, self._rows(index)]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros_like(self.get_data_page(0).contiguous())

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        page = self.get_data_page(index, flat=False)
        page.copy_(data_page.reshape(page.shape))

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        item = self.dtype.itemsize
        base = self.kv_buffer.data_ptr()
        ptrs: list[int] = []
        idx = indices.tolist()
        if self.mla:
            row = self.layer_num * self.head_dim * item
            for i in range(0, len(idx), self.page_size):
                ptrs.append(base + idx[i] * row)
            return ptrs, [row * self.page_size] * len(ptrs)
        token = self.head_num * self.head_dim * item
        v_offset = self.kv_buffer[0].numel() * item
        if self.layout == "page_first":
            for i in range(0, len(idx), self.page_size):
                k = base + idx[i] * self.layer_num * token
                ptrs += [k, k + v_offset]
            return ptrs, [self.page_size * self.layer_num * token] * len(ptrs)
        for i in range(0, len(idx), self.page_size):
            for layer in range(self.layer_num):
                k = base + (layer * self.size + idx[i]) * token
                ptrs += [k, k + v_offset]
        return ptrs, [self.page_size * token] * len(ptrs)
