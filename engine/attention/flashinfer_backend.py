"""FlashInfer paged attention on the block-major KV cache (CUDA only).

Per step, ``plan`` turns the batch geometry into FlashInfer's page table (``indptr`` /
``indices`` / ``last_page_len``, page size 16) and plans ONE wrapper for all layers:

- decode-only steps (every query is one token): ``BatchDecodeWithPagedKVCacheWrapper``, when
  its CUDA-core kernel supports the GQA group size (1, 2, 3, 4, 8); other group sizes (e.g.
  Qwen2.5-7B's 7) fall back to the prefill wrapper;
- prefill and mixed steps: ``BatchPrefillWithPagedKVCacheWrapper`` with a causal mask
  (FlashInfer aligns the mask to the end of each request's KV, which is what a chunk after
  cached context needs).

``forward`` writes the new K/V with one ``index_put`` per tensor on the layer's strided view
``[num_blocks + 1, 2, 16, kv_heads, head_dim]`` (NHD; FlashInfer reads pages through their
stride, see DESIGN.md "Physics") and runs the planned wrapper.

CUDA graphs: ``plan_cuda_graph(metadata, batch_size)`` plans a per-batch-size decode wrapper
built in ``use_cuda_graph`` mode over fixed-size index buffers, so a graph captured once keeps
reading the same buffers and ``plan`` only refills them. The caller pads the batch to
``batch_size`` rows whose page is the cache's scratch block.

Not thread-safe: ``plan`` stores per-step state used by the following ``forward`` calls.
"""

from __future__ import annotations

import flashinfer  # noqa: F401  (ImportError here makes resolve_backend_name fall back to torch)
import torch
from flashinfer import BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper

from engine.attention.base import AttentionBackend, AttentionMetadata

_WORKSPACE_BYTES = 256 << 20  # FlashInfer's split-k scratch; 128 MiB recommended, long prefills use more
_DECODE_KERNEL_GROUP_SIZES = (1, 2, 3, 4, 8)  # DISPATCH_GQA_GROUP_SIZE of the CUDA-core decode


def page_table(
    metadata: AttentionMetadata, page_size: int
) -> tuple[list[int], list[int], list[int]]:
    """``(indptr, indices, last_page_len)`` of FlashInfer's CSR page table, on the host.

    Request ``i`` owns pages ``indices[indptr[i]:indptr[i+1]]`` = the first
    ``ceil(seq_lens[i] / page_size)`` entries of its block table; its last page holds
    ``last_page_len[i]`` (1..page_size) tokens. Raises ValueError without host block tables."""
    tables = metadata.block_tables_cpu
    if tables is None:
        raise ValueError("FlashInfer planning needs AttentionMetadata.block_tables_cpu")
    indptr = [0]
    indices: list[int] = []
    last_page_len: list[int] = []
    for row, seq_len in zip(tables, metadata.seq_lens_cpu, strict=True):
        num_pages = -(-seq_len // page_size)
        indices.extend(row[:num_pages])
        indptr.append(len(indices))
        last_page_len.append(seq_len - (num_pages - 1) * page_size)
    return indptr, indices, last_page_len


def _pinned(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32).pin_memory()


class FlashInferAttentionBackend(AttentionBackend):
    name = "flashinfer"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self._dtype: torch.dtype | None = None
        self._device: torch.device | None = None
        self._workspace: torch.Tensor | None = None
        self._prefill: BatchPrefillWithPagedKVCacheWrapper | None = None
        self._decode: BatchDecodeWithPagedKVCacheWrapper | None = None
        self._graph_decode: dict[int, BatchDecodeWithPagedKVCacheWrapper] = {}
        # Per captured size: pinned int32 (indptr, last_page_len, indices) plan inputs.
        self._graph_host: dict[int, tuple[torch.Tensor, ...]] = {}
        self._active: BatchPrefillWithPagedKVCacheWrapper | BatchDecodeWithPagedKVCacheWrapper | None = None
        self._slot_mapping: torch.Tensor | None = None
        self._slot_blocks: torch.Tensor | None = None
        self._slot_offsets: torch.Tensor | None = None
        self.decode_kernel = (num_heads // num_kv_heads) in _DECODE_KERNEL_GROUP_SIZES
        self.last_wrapper = ""  # "decode" | "prefill" | "graph_decode", for tests and logs

    @property
    def graph_capable(self) -> bool:
        """CUDA-graph decode needs the decode kernel (see the module docstring)."""
        return self.decode_kernel

    def bind(self, kv_dtype: torch.dtype, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"FlashInfer attention needs a CUDA device, got {device}")
        if kv_dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"FlashInfer attention supports float16/bfloat16, got {kv_dtype}")
        self._dtype, self._device = kv_dtype, device
        self._workspace = torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._prefill = BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        if self.decode_kernel:
            self._decode = BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD")

    @property
    def slot_mapping(self) -> torch.Tensor | None:
        return self._slot_mapping

    def plan(self, metadata: AttentionMetadata) -> None:
        """Eager step: decode wrapper for decode-only batches (if the kernel fits), else the
        causal prefill wrapper. Copies the page table host->device without blocking."""
        self._check_bound()
        indptr, indices, last_page_len = page_table(metadata, metadata.block_size)
        indices_gpu = _pinned(indices).to(self._device, non_blocking=True)
        if self._decode is not None and metadata.max_query_len == 1:
            self._plan_decode(self._decode, indptr, indices_gpu, last_page_len, metadata.block_size)
            self.last_wrapper = "decode"
        else:
            assert self._prefill is not None
            cu = metadata.query_lens_cpu
            qo_indptr = [0]
            for n in cu:
                qo_indptr.append(qo_indptr[-1] + n)
            self._prefill.plan(
                _pinned(qo_indptr), _pinned(indptr), indices_gpu, _pinned(last_page_len),
                self.num_heads, self.num_kv_heads, self.head_dim, metadata.block_size,
                causal=True, sm_scale=self.scale, q_data_type=self._dtype,
                kv_data_type=self._dtype, non_blocking=True,
            )
            self._active = self._prefill
            self.last_wrapper = "prefill"
        self._slot_mapping = metadata.slot_mapping

    def plan_cuda_graph(self, metadata: AttentionMetadata, batch_size: int, max_pages: int) -> None:
        """Plan the graph-mode decode wrapper of ``batch_size`` (created on first use with an
        index buffer of ``max_pages``). ``metadata`` must be decode-only with exactly
        ``batch_size`` rows and its ``slot_mapping`` the graph's static buffer. Raises
        ValueError otherwise or when the group size has no decode kernel."""
        self._check_bound()
        if not self.decode_kernel:
            raise ValueError("CUDA-graph decode needs a GQA group size in (1, 2, 3, 4, 8)")
        if metadata.num_reqs != batch_size or metadata.max_query_len != 1:
            raise ValueError(f"graph decode plan needs {batch_size} one-token rows")
        wrapper = self._graph_decode.get(batch_size)
        if wrapper is None:
            assert self._workspace is not None and self._device is not None
            wrapper = BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, "NHD", use_cuda_graph=True,
                paged_kv_indptr_buffer=torch.zeros(batch_size + 1, dtype=torch.int32, device=self._device),
                paged_kv_indices_buffer=torch.zeros(max_pages, dtype=torch.int32, device=self._device),
                paged_kv_last_page_len_buffer=torch.ones(batch_size, dtype=torch.int32, device=self._device),
            )
            self._graph_decode[batch_size] = wrapper
        indptr, indices, last_page_len = page_table(metadata, metadata.block_size)
        if len(indices) > max_pages:
            raise ValueError(f"{len(indices)} pages exceed the graph buffer of {max_pages}")
        # Pinned buffers of this size, refilled in place (no pinned allocation per step): safe
        # since every step synchronizes after the copies enqueued here.
        host = self._graph_host.get(batch_size)
        if host is None:
            host = tuple(torch.empty(n, dtype=torch.int32, pin_memory=True)
                         for n in (batch_size + 1, batch_size, max_pages))
            self._graph_host[batch_size] = host
        indptr_host, last_host, indices_host = host
        indptr_host.numpy()[:] = indptr
        last_host.numpy()[:] = last_page_len
        indices_host.numpy()[:len(indices)] = indices
        indices_gpu = indices_host[:len(indices)].to(self._device, non_blocking=True)
        self._plan_decode(wrapper, indptr_host, indices_gpu, last_host, metadata.block_size)
        self._slot_mapping = metadata.slot_mapping
        self.last_wrapper = "graph_decode"

    def _plan_decode(
        self,
        wrapper: BatchDecodeWithPagedKVCacheWrapper,
        indptr: list[int] | torch.Tensor,
        indices_gpu: torch.Tensor,
        last_page_len: list[int] | torch.Tensor,
        page_size: int,
    ) -> None:
        # indptr/last_page_len stay on the (pinned) host: plan reads them there without a
        # device sync and copies them into the wrapper's buffers asynchronously.
        if isinstance(indptr, list):
            indptr = _pinned(indptr)
        if isinstance(last_page_len, list):
            last_page_len = _pinned(last_page_len)
        wrapper.plan(
            indptr, indices_gpu, last_page_len,
            self.num_heads, self.num_kv_heads, self.head_dim, page_size,
            sm_scale=self.scale, q_data_type=self._dtype, kv_data_type=self._dtype,
            non_blocking=True,
        )
        self._active = wrapper

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: torch.Tensor,
        kv_written: bool = False,
    ) -> torch.Tensor:
        wrapper, slots = self._active, self._slot_mapping
        if wrapper is None or slots is None:
            raise RuntimeError("FlashInferAttentionBackend.forward called before plan()")
        if not kv_written:  # else the model's fused kernel stored them (rotary_and_cache)
            if layer_idx == 0 or self._slot_blocks is None:
                # Once per forward pass (layer 0 comes first), inside a captured graph too, so
                # a replay recomputes them from the static slot buffer.
                block_size = kv_layer.shape[2]
                self._slot_blocks = torch.div(slots, block_size, rounding_mode="floor")
                self._slot_offsets = slots - self._slot_blocks * block_size
            kv_layer[self._slot_blocks, 0, self._slot_offsets] = k
            kv_layer[self._slot_blocks, 1, self._slot_offsets] = v
        num_tokens = q.shape[0]
        out = torch.empty(num_tokens, self.num_heads, self.head_dim, dtype=q.dtype, device=q.device)
        if wrapper is self._prefill:
            q = q.contiguous()  # the sm90 prefill kernel loads q tiles by TMA
        wrapper.run(q, kv_layer, out=out)
        return out.view(num_tokens, self.num_heads * self.head_dim)

    def _check_bound(self) -> None:
        if self._device is None:
            raise RuntimeError("FlashInferAttentionBackend.bind() must be called before plan()")
