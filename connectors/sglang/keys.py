"""Namespace and page keys of SGLang's HiCache pages. Torch-free, SGLang-free.

SGLang names each page by a chained hash it computes itself (``mem_cache.utils
.get_hash_str``: sha256 over the parent page's digest and the page's token ids, the chain
seeded by the request's ``extra_key`` and ``cache_salt`` when it has them), as a 64-digit hex
string. Those hashes already chain the whole prefix, so the backend does not hash tokens
again: a page's kvtier key is ``namespace.key_prefix() + "/" + SGLang's hash``. A key that is
not plain hex (another scheme) is hashed (sha256) first, so keys stay short and ``/``-free.

The namespace (``cachestore.hashing.Namespace``) seeds the prefix and covers what makes two
caches incompatible: the model (``model_fingerprint``: SGLang's model name unless the config
says otherwise), the page size, the TP rank and size, and ``kv_format``: ``sglang1:`` + the
stored page layout (``layout_name``: MHA or MLA, KV dtype, layers, heads, head dims, SGLang's
host layout, and the pipeline and context-parallel shard). MLA pages are the same on every
TP rank (SGLang replicates them), so an MLA namespace has ``tp_rank 0 / tp_size 1``: every
rank reads the one copy SGLang's writer rank stored. MHA pages hold a rank's heads only, so
each rank has its own namespace and never sees another rank's pages.

kvtier's engine and its vLLM connector write blocks under other ``kv_format`` values (and
key them by kvtier's own token hash), so the three never read each other's blocks even on
one cache server; they share the tiers, the block codec and the servers.
"""

from __future__ import annotations

import hashlib
import string

from cachestore.hashing import BlockKey, Namespace, key_of_digest

LAYOUT_VERSION = 1  # bump when the stored page payload changes (pages.PageLayout)
_HEX = frozenset(string.hexdigits.lower())


def layout_name(
    kind: str,
    dtype: str,
    num_layers: int,
    num_heads: int,
    head_dim: int,
    v_head_dim: int,
    page_size: int,
    host_layout: str,
    shard: str = "",
) -> str:
    """The stored page layout, e.g. ``sglang1:mha:bfloat16:L32:h8:d128/128:p64:page_first``.
    ``kind`` is ``mha`` or ``mla``; ``shard`` names pipeline / context-parallel shards."""
    dtype = dtype.removeprefix("torch.")
    name = (
        f"sglang{LAYOUT_VERSION}:{kind}:{dtype}:L{num_layers}:h{num_heads}:"
        f"d{head_dim}/{v_head_dim}:p{page_size}:{host_layout}"
    )
    return f"{name}:{shard}" if shard else name


def shard_name(
    pp_rank: int = 0,
    pp_size: int = 1,
    cp_rank: int = 0,
    cp_size: int = 1,
    dcp_rank: int = 0,
    dcp_size: int = 1,
) -> str:
    """The parallel shard a rank's pages belong to, beside TP ('' when not sharded)."""
    parts = []
    if pp_size > 1:
        parts.append(f"pp{pp_rank}/{pp_size}")
    if cp_size > 1:
        parts.append(f"cp{cp_rank}/{cp_size}")
    if dcp_size > 1:
        parts.append(f"dcp{dcp_rank}/{dcp_size}")
    return ",".join(parts)


def make_namespace(
    model_fingerprint: str, layout: str, page_size: int, tp_rank: int, tp_size: int, is_mla: bool
) -> Namespace:
    """The namespace of one SGLang rank's pages (MLA: shared by all TP ranks).
    Raises ValueError for a bad rank or page size."""
    if is_mla:
        tp_rank, tp_size = 0, 1
    return Namespace(
        model_fingerprint=model_fingerprint,
        block_size=page_size,
        tp_rank=tp_rank,
        tp_size=tp_size,
        kv_format=layout,
    )


def page_key(prefix: str, sglang_key: str) -> BlockKey:
    """The kvtier key of the page SGLang names ``sglang_key``. Pure."""
    if 0 < len(sglang_key) <= 128 and set(sglang_key) <= _HEX:
        return key_of_digest(prefix, sglang_key)
    return key_of_digest(prefix, hashlib.sha256(sglang_key.encode()).hexdigest())
