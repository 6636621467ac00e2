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

CUDA graphs: ``plan_cuda_graph(metadata, batch_size)`` refills per-batch-size page-table
buffers (``indptr``, ``indices``, ``last_page_len``) that a graph captured once keeps reading.
The caller pads the batch to ``batch_size`` rows whose page is the cache's scratch block. The
kernel a graph runs is ``graph_decode``:

- ``"triton"``: ``engine.kernels.decode_attention`` (split-KV over those buffers, no plan: the
  graph's host work is one copy of them), any GQA group up to 16;
- ``"flashinfer"``: a decode wrapper built in ``use_cuda_graph`` mode over those buffers and
  planned each step (group sizes 1, 2, 3, 4, 8).

``"auto"`` (the default) takes triton when the fused kernels passed their self-check on the
device (``engine.kernels.fused_kernels_available``), else flashinfer. bench/engine.py measures
both (variants ``fused`` and ``fused-fi``), bench/attention.py the kernels alone.

Eager steps of few new tokens: with ``small_query="triton"`` an eager step whose every
request brings at most ``max_query_len(group)`` tokens (short appends over cached context;
decode steps outside the graphs) runs the same Triton kernel with causal rows per query token,
instead of a FlashInfer wrapper whose prefill kernel does not split the KV. ``"auto"`` (the
default) does so only when the step's longest context is at least
``SMALL_QUERY_AUTO_MIN_CONTEXT`` tokens: on the H200 16 tokens over 16K took 59.5 us a layer
against FlashInfer's 223.9 (3.76x), over 4K 63.2 against 61.2 (bench/attention.py --appends).

Not thread-safe: ``plan`` stores per-step state used by the following ``forward`` calls.
"""

from __future__ import annotations

import flashinfer  # noqa: F401  (ImportError here makes resolve_backend_name fall back to torch)
import torch
from flashinfer import BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.attention.page_tables import csr_offsets, graph_table, page_table, pinned
from engine.attention.staging import StagingFence
from engine.config import GRAPH_DECODE_CHOICES, SMALL_QUERY_CHOICES

_WORKSPACE_BYTES = (
    256 << 20
)  # FlashInfer's split-k scratch; 128 MiB recommended, long prefills use more
_DECODE_KERNEL_GROUP_SIZES = (1, 2, 3, 4, 8)  # DISPATCH_GQA_GROUP_SIZE of the CUDA-core decode
SMALL_QUERY_AUTO_MIN_CONTEXT = 8192  # small_query="auto": the Triton kernel from this context on


class FlashInferAttentionBackend(AttentionBackend):
    name = "flashinfer"

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        graph_decode: str = "auto",
        small_query: str = "auto",
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        if graph_decode not in GRAPH_DECODE_CHOICES:
            raise ValueError(
                f"graph_decode must be one of {GRAPH_DECODE_CHOICES}, got {graph_decode!r}"
            )
        if small_query not in SMALL_QUERY_CHOICES:
            raise ValueError(
                f"small_query must be one of {SMALL_QUERY_CHOICES}, got {small_query!r}"
            )
        self._wanted = {"graph_decode": graph_decode, "small_query": small_query}
        self.graph_decode = self.small_query = "flashinfer"  # resolved in bind()
        # The planned step's Triton call, graph or eager: ((indptr, indices, last_page_len)
        # device views, decode_config, keyword arguments); None when it runs a FlashInfer
        # wrapper.
        self._triton_call: tuple[tuple[torch.Tensor, ...], tuple[int, ...], dict] | None = None
        self._graph_dev: dict[int, torch.Tensor] = {}  # per size: the device twin of _graph_host
        self._num_sms = 0
        self._triton_decode = None  # engine.kernels.decode_attention once chosen
        self._dtype: torch.dtype | None = None
        self._device: torch.device | None = None
        self._workspace: torch.Tensor | None = None
        self._prefill: BatchPrefillWithPagedKVCacheWrapper | None = None
        self._decode: BatchDecodeWithPagedKVCacheWrapper | None = None
        self._graph_decode: dict[int, BatchDecodeWithPagedKVCacheWrapper] = {}
        # Per captured size: pinned int32 [indptr | last_page_len | indices] (plan_cuda_graph).
        self._graph_host: dict[int, torch.Tensor] = {}
        # Per wrapper (by id) and per graph size: the pinned plan buffers' fences (see
        # engine/attention/staging.py: plan() reuses page-locked memory the GPU reads later).
        self._fences: dict[object, StagingFence] = {}
        self._active: (
            BatchPrefillWithPagedKVCacheWrapper | BatchDecodeWithPagedKVCacheWrapper | None
        ) = None
        self._slot_mapping: torch.Tensor | None = None
        self._slot_blocks: torch.Tensor | None = None
        self._slot_offsets: torch.Tensor | None = None
        self.decode_kernel = (num_heads // num_kv_heads) in _DECODE_KERNEL_GROUP_SIZES
        self.last_wrapper = ""  # "decode" | "prefill" | "graph_decode", for tests and logs

    @property
    def graph_capable(self) -> bool:
        """CUDA-graph decode needs a graph decode kernel (see the module docstring)."""
        return self.graph_decode == "triton" or self.decode_kernel

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
        self._num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        for option, wanted in self._wanted.items():
            if wanted != "flashinfer" and self._triton_fits(device, option, wanted):
                # graph_decode "auto" is triton from here on; small_query "auto" stays a rule
                setattr(self, option, "triton" if option == "graph_decode" else wanted)

    def _triton_fits(self, device: torch.device, option: str, wanted: str) -> bool:
        """Whether the Triton kernel can serve ``option`` here (and load it); False when not
        and ``wanted`` is "auto". Raises ValueError when not and ``wanted`` is "triton"."""
        from engine.kernels import fused_kernels_available

        fits = fused_kernels_available(device)
        if fits:
            from engine.kernels import decode_attention  # imports triton: only when it is there

            fits = decode_attention.supports(self.num_heads, self.num_kv_heads, self.head_dim)
            if fits:
                self._triton_decode = decode_attention
        if not fits and wanted == "triton":
            raise ValueError(
                f"{option}='triton' needs triton, a passing kernel self-check, "
                "a GQA group <= 16 and a power-of-two head_dim"
            )
        return fits

    @property
    def slot_mapping(self) -> torch.Tensor | None:
        return self._slot_mapping

    def plan(self, metadata: AttentionMetadata) -> None:
        """Eager step: decode wrapper for decode-only batches (if the kernel fits), else the
        causal prefill wrapper. Copies the page table host->device without blocking."""
        self._check_bound()
        self._triton_call = None
        indptr, indices, last_page_len = page_table(metadata, metadata.block_size)
        if (
            self.small_query != "flashinfer"
            and metadata.max_query_len
            <= self._triton_decode.max_query_len(self.num_heads // self.num_kv_heads)
            and (
                self.small_query == "triton"
                or max(metadata.seq_lens_cpu) >= SMALL_QUERY_AUTO_MIN_CONTEXT
            )
        ):
            self._plan_small_query(metadata, indptr, indices, last_page_len)
            return
        indices_gpu = pinned(indices).to(self._device, non_blocking=True)
        if self._decode is not None and metadata.max_query_len == 1:
            self._plan_decode(self._decode, indptr, indices_gpu, last_page_len, metadata.block_size)
            self.last_wrapper = "decode"
        else:
            assert self._prefill is not None
            fence = self._fence(self._prefill)
            fence.wait()
            self._prefill.plan(
                pinned(csr_offsets(metadata.query_lens_cpu)),
                pinned(indptr),
                indices_gpu,
                pinned(last_page_len),
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                metadata.block_size,
                causal=True,
                sm_scale=self.scale,
                q_data_type=self._dtype,
                kv_data_type=self._dtype,
                non_blocking=True,
            )
            fence.record()
            self._active = self._prefill
            self.last_wrapper = "prefill"
        self._slot_mapping = metadata.slot_mapping

    def _plan_small_query(
        self,
        metadata: AttentionMetadata,
        indptr: list[int],
        indices: list[int],
        last_page_len: list[int],
    ) -> None:
        """An eager step for the Triton kernel: one pinned copy of [indptr | last_page_len |
        qo_indptr | indices]."""
        n = metadata.num_reqs
        qo_indptr = csr_offsets(metadata.query_lens_cpu)
        table = pinned(indptr + last_page_len + qo_indptr + indices).to(
            self._device, non_blocking=True
        )
        self._triton_call = (
            (table[: n + 1], table[3 * n + 2 :], table[n + 1 : 2 * n + 1]),
            self._triton_decode.decode_config(n, self.num_kv_heads, self._num_sms),
            {
                "qo_indptr": table[2 * n + 1 : 3 * n + 2],
                "num_reqs": n,
                "max_q_len": metadata.max_query_len,
            },
        )
        self._active = None
        self._slot_mapping = metadata.slot_mapping
        self.last_wrapper = "triton"

    def plan_cuda_graph(self, metadata: AttentionMetadata, batch_size: int, max_pages: int) -> None:
        """Refill the page-table buffers of ``batch_size`` (created on first use with room for
        ``max_pages``) for the graph's kernel, and plan FlashInfer's graph-mode wrapper when
        that is the kernel. ``metadata`` must be decode-only with exactly ``batch_size`` rows
        and its ``slot_mapping`` the graph's static buffer. Raises ValueError otherwise or
        when no graph decode kernel fits the group size."""
        self._check_bound()
        if not self.graph_capable:
            raise ValueError(
                "CUDA-graph decode needs the triton kernel (GQA group <= 16) or "
                "a FlashInfer decode kernel's group size (1, 2, 3, 4, 8)"
            )
        if metadata.num_reqs != batch_size or metadata.max_query_len != 1:
            raise ValueError(f"graph decode plan needs {batch_size} one-token rows")
        indptr, indices, last_page_len = page_table(metadata, metadata.block_size)
        if len(indices) > max_pages:
            raise ValueError(f"{len(indices)} pages exceed the graph buffer of {max_pages}")
        # One pinned buffer per size (``graph_table``), refilled in place once its fence says
        # the copies of the last refill have run.
        host_fence = self._fence(("graph", batch_size))
        host_fence.wait()  # the last replay's copies of this buffer have run
        host = graph_table(self._graph_host, batch_size, max_pages, indptr, last_page_len, indices)
        head = 2 * batch_size + 1
        self._slot_mapping = metadata.slot_mapping
        self._triton_call = None
        self.last_wrapper = "graph_decode"
        if self.graph_decode == "triton":
            table = self._graph_dev.get(batch_size)
            if table is None:
                table = torch.zeros_like(host, device=self._device)
                self._graph_dev[batch_size] = table
            table[: head + len(indices)].copy_(host[: head + len(indices)], non_blocking=True)
            host_fence.record()
            self._triton_call = (
                (table[: batch_size + 1], table[head:], table[batch_size + 1 : head]),
                self._triton_decode.decode_config(batch_size, self.num_kv_heads, self._num_sms),
                {},
            )
            self._active = None
            return
        wrapper = self._graph_decode.get(batch_size)
        if wrapper is None:
            assert self._workspace is not None and self._device is not None
            wrapper = BatchDecodeWithPagedKVCacheWrapper(
                self._workspace,
                "NHD",
                use_cuda_graph=True,
                paged_kv_indptr_buffer=torch.zeros(
                    batch_size + 1, dtype=torch.int32, device=self._device
                ),
                paged_kv_indices_buffer=torch.zeros(
                    max_pages, dtype=torch.int32, device=self._device
                ),
                paged_kv_last_page_len_buffer=torch.ones(
                    batch_size, dtype=torch.int32, device=self._device
                ),
            )
            self._graph_decode[batch_size] = wrapper
        indices_gpu = host[head : head + len(indices)].to(self._device, non_blocking=True)
        self._plan_decode(
            wrapper,
            host[: batch_size + 1],
            indices_gpu,
            host[batch_size + 1 : head],
            metadata.block_size,
        )
        host_fence.record()

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
            indptr = pinned(indptr)
        if isinstance(last_page_len, list):
            last_page_len = pinned(last_page_len)
        fence = self._fence(wrapper)
        fence.wait()
        wrapper.plan(
            indptr,
            indices_gpu,
            last_page_len,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            page_size,
            sm_scale=self.scale,
            q_data_type=self._dtype,
            kv_data_type=self._dtype,
            non_blocking=True,
        )
        fence.record()
        self._active = wrapper

    def _fence(self, owner: object) -> StagingFence:
        """The fence of a pinned buffer ``owner`` refills each plan (a wrapper: its
        page-locked plan buffer; ``("graph", size)``: that size's page-table buffer)."""
        key = owner if isinstance(owner, tuple) else id(owner)
        fence = self._fences.get(key)
        if fence is None:
            fence = self._fences[key] = StagingFence()
        return fence

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: torch.Tensor,
        kv_written: bool = False,
    ) -> torch.Tensor:
        wrapper, slots, triton = self._active, self._slot_mapping, self._triton_call
        if (wrapper is None and triton is None) or slots is None:
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
        if triton is not None:
            tables, cfg, extra = triton
            out = self._triton_decode.paged_decode_attention(
                q, kv_layer, *tables, self.scale, *cfg, **extra
            )
            return out.view(num_tokens, self.num_heads * self.head_dim)
        assert wrapper is not None
        out = torch.empty(num_tokens, self.num_heads, self.head_dim, dtype=q.dtype, device=q.device)
        if wrapper is self._prefill:
            q = q.contiguous()  # the sm90 prefill kernel loads q tiles by TMA
        wrapper.run(q, kv_layer, out=out)
        return out.view(num_tokens, self.num_heads * self.head_dim)

    def _check_bound(self) -> None:
        if self._device is None:
            raise RuntimeError("FlashInferAttentionBackend.bind() must be called before plan()")
