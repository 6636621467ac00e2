"""Namespace and block keys of vLLM's KV blocks. Torch-free, vLLM-free.

Keys are kvtier's chained block hashes (``cachestore.hashing``) of the token ids, never vLLM's
own block hashes (those are seeded per process unless PYTHONHASHSEED is set). The namespace
seeds every chain and covers what makes two caches incompatible:

- ``model_fingerprint``: ``engine.models.loader.model_fingerprint`` for a local model directory
  (config.json and safetensors headers, plus the dtype: equal to kvtier's own engine's for the
  same model), else the model name, revision and dtype;
- ``block_size``, ``tp_rank`` / ``tp_size``;
- ``kv_format``: ``vllm1:`` + the stored block layout (``layout_name``: KV dtype, layers, KV
  heads, head size, block size). kvtier's engine writes another layout under an empty
  ``kv_format``, so the two engines never read each other's blocks, even on one cache server.

A request's blocks also chain its LoRA adapter and ``cache_salt`` (extra keys of every block),
so tenants and adapters never share blocks. Pure functions and one small per-request cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from cachestore.hashing import BlockHash, BlockKey, Namespace, block_key, hash_request_tokens

LAYOUT_VERSION = 1  # bump when the stored vLLM block layout changes (worker.KvLayout)


def layout_name(
    kv_dtype: str, num_layers: int, num_kv_heads: int, head_size: int, block_size: int
) -> str:
    """The stored block layout: ``[layers, *one layer's block]`` of vLLM's per-layer view, named
    so both connector sides derive it from the KV cache spec alone."""
    dtype = kv_dtype.removeprefix("torch.")
    return f"vllm{LAYOUT_VERSION}:{dtype}:L{num_layers}:h{num_kv_heads}:d{head_size}:b{block_size}"


def make_namespace(
    model_fingerprint: str,
    layout: str,
    block_size: int,
    tp_rank: int = 0,
    tp_size: int = 1,
    hash_name: str = "sha256",
) -> Namespace:
    """The namespace of one vLLM instance's (one TP rank's) blocks. Raises ValueError."""
    return Namespace(
        model_fingerprint=model_fingerprint,
        block_size=block_size,
        tp_rank=tp_rank,
        tp_size=tp_size,
        hash_name=hash_name,
        kv_format=layout,
    )


def extra_keys_of(lora_name: str | None, cache_salt: str | None) -> tuple[str, ...]:
    """The extra keys chained into every block of a request (empty: none)."""
    out: list[str] = []
    if lora_name:
        out.append(f"lora={lora_name}")
    if cache_salt:
        out.append(f"salt={cache_salt}")
    return tuple(out)


@dataclass(slots=True)
class RequestKeys:
    """The block keys of one request's tokens, extended as its tokens grow (the chain is only
    hashed once per block). Not thread-safe (the scheduler thread owns it)."""

    namespace: Namespace
    extra: tuple[str, ...] = ()
    hashes: list[BlockHash] = field(default_factory=list)
    keys: list[BlockKey] = field(default_factory=list)

    def first(self, token_ids: Sequence[int], num_blocks: int) -> list[BlockKey]:
        """Keys of the first ``num_blocks`` full blocks of ``token_ids`` (fewer when
        ``token_ids`` holds fewer full blocks). ``token_ids`` must extend the ids seen before.
        Raises ValueError for ids outside int32."""
        bs = self.namespace.block_size
        num_blocks = min(num_blocks, len(token_ids) // bs)
        have = len(self.hashes)
        if num_blocks > have:
            parent = self.hashes[-1] if self.hashes else None
            extras = [self.extra] * (num_blocks - have) if self.extra else None
            new = hash_request_tokens(
                self.namespace,
                token_ids[have * bs : num_blocks * bs],
                extra_keys=extras,
                parent=parent,
            )
            self.hashes.extend(new)
            self.keys.extend(block_key(self.namespace, h) for h in new)
        return self.keys[:num_blocks]
