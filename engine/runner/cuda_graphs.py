"""CUDA graphs for decode-only steps: one captured forward pass per padded batch size.

A decode step of ``n`` requests runs the graph of the smallest captured size ``P >= n``. The
graph reads fixed device buffers: ``io[P]`` (int64 ``[3, P]``: token ids, positions, KV slots)
and the FlashInfer graph-mode decode wrapper's page-table buffers, which
``AttentionBackend.plan_cuda_graph`` refills before each replay. Rows ``n..P-1`` are padding:
token 0 at position 0, writing and reading only the cache's scratch block. The output is the
final hidden state ``[P, hidden]`` in the graph's memory pool; rows past ``n`` are garbage and
everything is overwritten by the next replay of that size.

Graphs are captured largest first into one shared pool (smaller graphs reuse its memory).
Prefill and mixed steps stay eager. Not thread-safe.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.attention.staging import StagingFence
from engine.kv_cache import KVCache

logger = logging.getLogger(__name__)

_BASE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, 16, 24, ..., 64, then steps of 32, up to the first
    size covering ``max_num_seqs``."""
    sizes: list[int] = []
    size_iter = list(_BASE_SIZES)
    while True:
        if not size_iter:
            size_iter.append(sizes[-1] + 32)
        size = size_iter.pop(0)
        sizes.append(size)
        if size >= max_num_seqs:
            return sizes


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    io: torch.Tensor  # int64 [3, P]: ids, positions, slots
    io_host: torch.Tensor  # pinned twin of ``io``, refilled each step (see ``host_io``)
    hidden: torch.Tensor  # [P, hidden], the graph's output
    placeholders: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # metadata fields unused here
    fence: StagingFence  # io_host's last copy into io (engine/attention/staging.py)


class DecodeGraphs:
    """Captures and replays decode forward passes. ``model(input_ids, positions, attn,
    kv_cache)`` must be capturable for a graph-capable backend (no host syncs)."""

    def __init__(
        self,
        model: torch.nn.Module,
        attn: AttentionBackend,
        kv_cache: KVCache,
        sizes: list[int],
        max_blocks_per_seq: int,
    ) -> None:
        if not attn.graph_capable:
            raise ValueError(f"{type(attn).__name__} cannot run CUDA graphs")
        self.model = model
        self.attn = attn
        self.kv_cache = kv_cache
        self.sizes = sorted(sizes)
        self.max_blocks_per_seq = max_blocks_per_seq
        self._graphs: dict[int, _Graph] = {}
        self.pool_bytes = 0

    def padded_size(self, num_reqs: int) -> int | None:
        """The captured size for ``num_reqs`` rows, or None if larger than every size."""
        for size in self.sizes:
            if size >= num_reqs:
                return size
        return None

    def max_pages(self, size: int) -> int:
        return size * self.max_blocks_per_seq

    def capture(self) -> None:
        """Capture every size (largest first). Synchronizes; call once at start-up after the
        KV cache exists (graphs bake in its address)."""
        device = self.kv_cache.device
        start = time.perf_counter()
        before = torch.cuda.memory_reserved(device)
        pool = torch.cuda.graph_pool_handle()
        for size in sorted(self.sizes, reverse=True):
            io = torch.zeros(3, size, dtype=torch.int64, device=device)
            io[2].fill_(self.kv_cache.scratch_block_id * self.kv_cache.block_size)
            placeholders = (
                torch.arange(size + 1, dtype=torch.int32, device=device),
                torch.ones(size, dtype=torch.int32, device=device),
                torch.zeros(size, 1, dtype=torch.int32, device=device),
            )
            meta = self.padded_metadata(io, placeholders, [], [], size)
            with torch.inference_mode():
                self.attn.plan_cuda_graph(meta, size, self.max_pages(size))
                # Warm-up outside the graph: kernel loading, cuBLAS handles, rotary tables.
                self.model(io[0], io[1], self.attn, self.kv_cache)
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    hidden = self.model(io[0], io[1], self.attn, self.kv_cache)
            io_host = torch.empty(3, size, dtype=torch.int64, pin_memory=True)
            self._graphs[size] = _Graph(graph, io, io_host, hidden, placeholders, StagingFence())
        torch.cuda.synchronize(device)
        self.pool_bytes = torch.cuda.memory_reserved(device) - before
        logger.info(
            "captured %d decode CUDA graphs (sizes %s) in %.1f s, pool %.1f MiB",
            len(self.sizes),
            self.sizes,
            time.perf_counter() - start,
            self.pool_bytes / 2**20,
        )

    def padded_metadata(
        self,
        io: torch.Tensor,
        placeholders: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        seq_lens: list[int],
        block_tables: list[list[int]],
        size: int,
    ) -> AttentionMetadata:
        """Metadata of ``len(seq_lens)`` real decode rows padded to ``size``. Only
        ``slot_mapping`` (the static buffer) and the host lists drive the graph backend; the
        other tensors are fixed placeholders of the right shape."""
        pad = size - len(seq_lens)
        scratch = self.kv_cache.scratch_block_id
        return AttentionMetadata(
            cu_seqlens_q=placeholders[0],
            seq_lens=placeholders[1],
            block_tables=placeholders[2],
            slot_mapping=io[2],
            query_lens_cpu=[1] * size,
            seq_lens_cpu=list(seq_lens) + [1] * pad,
            block_size=self.kv_cache.block_size,
            block_tables_cpu=list(block_tables) + [[scratch]] * pad,
        )

    def host_io(self, size: int) -> torch.Tensor:
        """The pinned int64 ``[3, size]`` input buffer of the graph of ``size``: fill it (ids,
        positions, slots, padded as the module docstring says), then ``run``. One buffer per
        size, reused every step: this waits until the copy the last ``run`` of this size
        enqueued has read it (a step need not synchronize before the next one)."""
        g = self._graphs[size]
        g.fence.wait()
        return g.io_host

    def run(
        self, io_host: torch.Tensor, seq_lens: list[int], block_tables: list[list[int]]
    ) -> torch.Tensor:
        """Replay for ``len(seq_lens)`` decode rows. ``io_host`` is pinned int64 ``[3, P]``
        (``host_io(P)``, or any pinned buffer of that shape) with
        ``P = padded_size(len(seq_lens))``. Returns hidden states ``[n, hidden]`` (a view into
        the graph's output)."""
        n = len(seq_lens)
        size = io_host.shape[1]
        g = self._graphs[size]
        g.io.copy_(io_host, non_blocking=True)
        if io_host is g.io_host:
            g.fence.record()
        meta = self.padded_metadata(g.io, g.placeholders, seq_lens, block_tables, size)
        self.attn.plan_cuda_graph(meta, size, self.max_pages(size))
        g.graph.replay()
        return g.hidden[:n]
