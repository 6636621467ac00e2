"""The model runner: everything that touches tensors in one engine step.

``execute_model(SchedulerOutput)`` flattens every scheduled request's tokens (prefill chunks
and decodes mixed) into one batch, builds the attention metadata (positions, slot mapping,
block tables), runs one forward pass, computes logits only for rows that sample, and samples.
The scheduler decides; this class never allocates blocks: it trusts the block tables it is
given after checking they cover the positions and lie inside the cache.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.attention import AttentionMetadata, create_attention_backend, resolve_backend_name
from engine.config import EngineConfig
from engine.core_types import ModelRunnerOutput, SchedulerOutput
from engine.kv_cache import KVCache, KVCacheSpec
from engine.model_loader import load_model, model_fingerprint
from engine.sampler import Sampler, SampleRequest


class KVConnectorWorker(Protocol):
    """The worker side of a KV connector as the runner calls it (implemented in connectors/).

    Called from the engine thread only, once per step, in this order: ``start_load_kv``
    before the forward pass, ``wait_for_save`` and ``after_step`` after it."""

    def start_load_kv(self, metadata: object | None) -> None: ...

    def wait_for_save(self) -> None: ...

    def after_step(self, metadata: object | None) -> None: ...

_CUDA_MARGIN_BYTES = 1 << 30  # activations, logits and allocator slack outside the KV cache


@dataclass(frozen=True, slots=True)
class BatchInputs:
    """One step's flat batch on the device, plus which rows produce logits."""

    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # int64 [S], the last row of each sampling request
    sample_req_ids: list[str]


def resolve_device(device: str) -> torch.device:
    """``auto`` -> cuda if available else cpu. Raises ValueError for cuda without CUDA."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return dev


def read_eos_token_ids(model_dir: str, hf_config: dict) -> tuple[int, ...]:
    """EOS ids from generation_config.json (preferred, may be a list) and config.json."""
    ids: list[int] = []
    sources = [hf_config]
    gen_path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path, encoding="utf-8") as f:
            sources.insert(0, json.load(f))
    for src in sources:
        eos = src.get("eos_token_id")
        for tok in eos if isinstance(eos, list) else [eos]:
            if tok is not None and int(tok) not in ids:
                ids.append(int(tok))
    return tuple(ids)


class ModelRunner:
    """Owns the model, the KV cache, the attention backend and the sampler. Not thread-safe:
    one engine loop calls ``execute_model`` at a time."""

    def __init__(self, config: EngineConfig, model_dir: str) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        loaded = load_model(model_dir, config.dtype, self.device, config.scheduler.max_model_len)
        self.model = loaded.model
        self.arch = loaded.arch
        self.dtype = loaded.dtype
        self._max_model_len = config.scheduler.max_model_len or loaded.arch.max_position_embeddings
        self._fingerprint = model_fingerprint(model_dir, loaded.dtype)
        self._eos_token_ids = read_eos_token_ids(model_dir, loaded.hf_config)
        spec = KVCacheSpec(
            num_layers=loaded.arch.num_layers,
            num_kv_heads=loaded.arch.num_kv_heads,
            head_dim=loaded.arch.head_dim,
            dtype=loaded.dtype,
            block_size=config.cache.block_size,
        )
        self.kv_cache = KVCache(spec, self._num_blocks_for(spec), self.device)
        self.attention_backend_name = resolve_backend_name(config.attention_backend, self.device.type)
        self.attn_backend = create_attention_backend(
            self.attention_backend_name,
            loaded.arch.num_heads,
            loaded.arch.num_kv_heads,
            loaded.arch.head_dim,
            loaded.arch.head_dim**-0.5,
        )
        self.sampler = Sampler(config.seed)
        # req_id -> tokens whose KV this runner has written; dropped on finished_req_ids.
        self._num_tokens_written: dict[str, int] = {}
        self._kv_connector: KVConnectorWorker | None = None

    def set_kv_connector(self, worker: KVConnectorWorker | None) -> None:
        """Attach (or detach with None) the worker side of a KV connector. Each step then calls
        ``worker.start_load_kv(meta)`` before the forward pass (loads into this step's blocks
        must be issued first) and ``worker.wait_for_save()`` then ``worker.after_step(meta)``
        after it, ``meta`` being ``SchedulerOutput.kv_connector_metadata``. Empty steps call
        them too, so a connector can make progress while nothing is scheduled."""
        self._kv_connector = worker

    def _num_blocks_for(self, spec: KVCacheSpec) -> int:
        cache_cfg = self.config.cache
        if cache_cfg.num_gpu_blocks is not None:
            return cache_cfg.num_gpu_blocks
        if self.device.type == "cuda":
            free_bytes, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free_bytes * cache_cfg.gpu_memory_utilization) - _CUDA_MARGIN_BYTES
        else:
            budget = cache_cfg.cpu_kv_cache_bytes
        num_blocks = budget // spec.bytes_per_block
        if num_blocks < 1:
            raise ValueError(
                f"KV cache budget {budget} bytes holds no block of {spec.bytes_per_block} bytes"
            )
        return num_blocks

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
        connector = self._kv_connector
        if out.is_empty:
            if connector is not None:
                connector.start_load_kv(out.kv_connector_metadata)
                connector.wait_for_save()
                connector.after_step(out.kv_connector_metadata)
            return ModelRunnerOutput(sampled_token_ids={}, logits={} if return_logits else None)
        batch = self.prepare_inputs(out)
        if connector is not None:
            connector.start_load_kv(out.kv_connector_metadata)
        with torch.inference_mode():
            self.attn_backend.plan(batch.metadata)
            hidden = self.model(batch.input_ids, batch.positions, self.attn_backend, self.kv_cache)
            sampled: dict[str, int] = {}
            logits_out: dict[str, object] | None = {} if return_logits else None
            if batch.sample_req_ids:
                logits = self.model.compute_logits(hidden.index_select(0, batch.logits_indices))
                by_id = {r.req_id: r for r in out.requests}
                requests = [
                    SampleRequest(by_id[rid].sampling, by_id[rid].num_output_tokens)
                    for rid in batch.sample_req_ids
                ]
                tokens = self.sampler(logits, requests)
                sampled = dict(zip(batch.sample_req_ids, tokens, strict=True))
                if logits_out is not None:
                    rows = logits.cpu()
                    logits_out = {rid: rows[i] for i, rid in enumerate(batch.sample_req_ids)}
        if connector is not None:
            connector.wait_for_save()
            connector.after_step(out.kv_connector_metadata)
        for r in out.requests:
            self._num_tokens_written[r.req_id] = r.num_computed_tokens + len(r.token_ids)
        return ModelRunnerOutput(sampled_token_ids=sampled, logits=logits_out)

    def prepare_inputs(self, out: SchedulerOutput) -> BatchInputs:
        """Flatten a step into device tensors (pure: no cache access). Raises ValueError."""
        bs = self.kv_cache.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        logits_rows: list[int] = []
        sample_ids: list[str] = []
        seen: set[str] = set()
        for r in out.requests:
            if r.req_id in seen:
                raise ValueError(f"request {r.req_id!r} scheduled twice in one step")
            seen.add(r.req_id)
            n = len(r.token_ids)
            start, end = r.num_computed_tokens, r.num_computed_tokens + len(r.token_ids)
            if n == 0 or start < 0:
                raise ValueError(f"request {r.req_id!r}: empty slice or negative num_computed_tokens")
            if end > self._max_model_len:
                raise ValueError(f"request {r.req_id!r}: {end} tokens exceed max_model_len {self._max_model_len}")
            if len(r.block_table) * bs < end:
                raise ValueError(f"request {r.req_id!r}: block table of {len(r.block_table)} blocks cannot hold {end} tokens")
            needed = r.block_table[: -(-end // bs)]
            if any(b < 0 or b >= self.kv_cache.num_blocks for b in needed):
                raise ValueError(f"request {r.req_id!r}: block id outside [0, {self.kv_cache.num_blocks})")
            input_ids.extend(r.token_ids)
            positions.extend(range(start, end))
            slots.extend(r.block_table[p // bs] * bs + p % bs for p in range(start, end))
            query_lens.append(n)
            seq_lens.append(end)
            if r.sample:
                logits_rows.append(len(input_ids) - 1)
                sample_ids.append(r.req_id)
        max_blocks = max(-(-s // bs) for s in seq_lens)
        tables = [list(r.block_table[:max_blocks]) for r in out.requests]
        tables = [t + [0] * (max_blocks - len(t)) for t in tables]
        cu = [0]
        for n in query_lens:
            cu.append(cu[-1] + n)
        metadata = AttentionMetadata(
            cu_seqlens_q=self._to_device(cu, torch.int32),
            seq_lens=self._to_device(seq_lens, torch.int32),
            block_tables=self._to_device(tables, torch.int32),
            slot_mapping=self._to_device(slots, torch.int64),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            block_size=bs,
        )
        return BatchInputs(
            input_ids=self._to_device(input_ids, torch.int64),
            positions=self._to_device(positions, torch.int64),
            metadata=metadata,
            logits_indices=self._to_device(logits_rows, torch.int64),
            sample_req_ids=sample_ids,
        )

    def _to_device(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        if self.device.type == "cpu":
            return torch.tensor(values, dtype=dtype)
        # Pinned staging lets the host->device copy overlap with queued GPU work.
        return torch.tensor(values, dtype=dtype).pin_memory().to(self.device, non_blocking=True)
