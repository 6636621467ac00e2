"""Builds kvtier's backend the way SGLang's cache controller does: a real
``HiCacheStorageConfig``, SGLang's ``StorageBackendFactory`` with backend ``dynamic``, then
``register_mem_pool_host``; page keys from SGLang's own chained page hash (``get_hash_str``)."""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.storage import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_hash_str

from tests.sglang.host_pool import HostPoolStandIn

EXTRA = {
    "backend_name": "kvtier",
    "module_path": "connectors.sglang",
    "class_name": "KvtierHiCacheStorage",
    "interface_v1": 1,
}


def storage_config(
    tiers: list[dict[str, Any]],
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    mla: bool = False,
    layout: str = "page_first",
    model: str = "test/tiny-llama",
    **extra: Any,
) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=True,
        is_page_first_layout=layout == "page_first",
        model_name=model,
        extra_config={**EXTRA, "tiers": tiers, **extra},
    )


def make_backend(tiers: list[dict[str, Any]], pool: HostPoolStandIn, **kw: Any) -> HiCacheStorage:
    cfg = storage_config(tiers, mla=pool.mla, layout=pool.layout, **kw)
    backend = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    backend.register_mem_pool_host(pool)
    return backend


def page_keys(num_pages: int, page_size: int = 4, seed: int = 0) -> list[str]:
    """SGLang's own page hashes of a prompt of ``num_pages`` pages (chained sha256)."""
    tokens = [(seed * 7919 + 31 * i) % 32000 for i in range(num_pages * page_size)]
    keys = get_hash_str(tokens, None, page_size=page_size)
    assert isinstance(keys, list) and len(keys) == num_pages
    return keys


def indices(first_page: int, num_pages: int, page_size: int = 4) -> torch.Tensor:
    """Host indices of ``num_pages`` pages from page ``first_page`` (what SGLang passes)."""
    start = first_page * page_size
    return torch.arange(start, start + num_pages * page_size, dtype=torch.int64)


def page_bytes(pool: HostPoolStandIn, page: int) -> bytes:
    return (
        pool.get_data_page(page * pool.page_size).contiguous().view(torch.uint8).numpy().tobytes()
    )
