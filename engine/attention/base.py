"""The attention backend interface and the per-step metadata the runner builds for it.

Per step: the runner builds one ``AttentionMetadata`` for the whole flat batch, calls
``backend.plan(metadata)`` once, then the model calls ``backend.forward(layer_idx, q, k, v,
kv_layer)`` for every layer. ``forward`` writes the new tokens' k/v into the paged cache at
``slot_mapping`` and attends each query over its request's context plus the new tokens,
causal within the chunk. A FlashInfer backend fits the same shape: ``plan`` derives its
``indptr``/``indices``/``last_page_len`` from ``block_tables`` and ``seq_lens`` and runs the
wrapper's plan; ``forward`` runs the planned wrapper on the layer's view.

Layout of ``kv_layer`` (a strided view of the block-major cache, see engine/kv_cache.py):
``[num_blocks, 2, block_size, num_kv_heads, head_dim]``, index 0 = key, 1 = value.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """One step's batch geometry; tensors live on the model's device.

    Requests are laid out back to back in the flat token batch: request ``i`` owns rows
    ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` and, after this step, has ``seq_lens[i]`` tokens of
    KV (context ``seq_lens[i] - query_len`` already cached plus its new tokens).
    ``block_tables[i, :ceil(seq_lens[i] / block_size)]`` are its blocks; the rest of the row
    is padding (0). ``slot_mapping[t] = block * block_size + offset`` for every new token.
    The ``*_cpu`` lists mirror the tensors on the host so backends can loop or plan without a
    device sync.
    """

    cu_seqlens_q: torch.Tensor  # int32 [B + 1]
    seq_lens: torch.Tensor  # int32 [B]
    block_tables: torch.Tensor  # int32 [B, max_blocks_per_req]
    slot_mapping: torch.Tensor  # int64 [T]
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    block_size: int
    # Host copy of the block tables (rows may be longer than needed; same ids as the tensor).
    block_tables_cpu: list[list[int]] | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens_cpu)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_cpu, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)


class AttentionBackend(ABC):
    """Paged attention over the block-major KV cache. One instance per model runner.

    Not thread-safe: ``plan`` stores per-step state used by the following ``forward`` calls.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def bind(self, kv_dtype: torch.dtype, device: torch.device) -> None:  # noqa: B027
        """Called once by the runner after the KV cache exists (its dtype and device), before
        any ``plan``. Backends that pre-allocate device workspaces do it here; default no-op."""

    @property
    def graph_capable(self) -> bool:
        """Whether ``plan_cuda_graph`` works (decode batches replayable as CUDA graphs)."""
        return False

    def plan_cuda_graph(self, metadata: AttentionMetadata, batch_size: int, max_pages: int) -> None:
        """Plan a decode-only batch padded to ``batch_size`` rows for a CUDA-graph replay whose
        static buffers are ``metadata``'s tensors. Raises NotImplementedError unless
        ``graph_capable``."""
        raise NotImplementedError(f"{type(self).__name__} cannot run CUDA graphs")

    @abstractmethod
    def plan(self, metadata: AttentionMetadata) -> None:
        """Prepare for one step's batch; called once per step before any ``forward``."""

    @property
    def slot_mapping(self) -> torch.Tensor | None:
        """The planned step's ``slot_mapping`` (None before the first ``plan``): a model that
        writes the new K/V itself (a fused kernel) writes them there and passes
        ``kv_written=True`` to ``forward``."""
        return None

    @abstractmethod
    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: torch.Tensor,
        kv_written: bool = False,
    ) -> torch.Tensor:
        """``q [T, Hq, D]``, ``k``/``v [T, Hkv, D]`` -> ``[T, Hq * D]``.

        Mutates ``kv_layer``: stores k/v at the planned ``slot_mapping``, unless
        ``kv_written`` (the caller already stored them there)."""
