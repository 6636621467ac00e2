"""``LLMEngine``: tokenizer + scheduler + model runner, stepped by one caller thread.

Each ``step()`` schedules one batch, runs it, advances request state, detokenizes the new
tokens (stop strings included) and returns a ``RequestOutput`` for every request that produced
a token or finished. With ``detokenize=False`` (the engine-core process: the API process
detokenizes) outputs carry token ids only, empty text, and stop strings are the caller's job. Not thread-safe: one thread drives it (the server's engine thread, or
``LLM``).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from cachestore.hashing import Namespace
from engine.config import EngineConfig
from engine.core_types import SchedulerOutput
from engine.kv_stats import KVStats
from engine.outputs import RequestMetrics, RequestOutput, TokenLogprob
from engine.request import Request, RequestStatus
from engine.request_log import RequestLog, RequestLogEntry
from engine.sampling_params import SamplingParams
from engine.sched.block_pool import BlockPool
from engine.sched.kv_cache_manager import KVCacheManager
from engine.sched.scheduler import Scheduler
from engine.tokenizer import IncrementalDetokenizer, encode_prompt, load_tokenizer
from engine.ttft import LoadTiming, clean_api_times

if TYPE_CHECKING:
    from engine.kv_connector import KVConnector
    from engine.runner.model_runner import ModelRunner
    from engine.runner.tp_worker import TPDriver

logger = logging.getLogger(__name__)

# How long a step that scheduled nothing waits for the connector's off-step work (a prefetch).
_NOT_YET_WAIT_S = 0.005


@dataclass(slots=True)
class _RequestState:
    request: Request
    detokenizer: IncrementalDetokenizer | None  # None: token ids only (detokenize=False)
    metrics: RequestMetrics
    arrival_unix_s: float
    logprobs: list[TokenLogprob] | None = None  # one per output token, when asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token
    # cached_tokens_by_tier, kept while (num_cached_tokens, len(kv_hit_tiers)) stays the same
    by_tier: tuple[tuple[int, int], dict[str, int]] | None = None


def cached_tokens_by_tier(request: Request, block_size: int, offload: bool) -> dict[str, int]:
    """``request.num_cached_tokens`` split by the tier that served each leading block: the
    offload connector records one tier per block (``kv_hit_tiers``); without it every hit is
    a GPU prefix hit. Blocks are counted in order up to the cached total, so a load cut short
    (or the last prompt token, always recomputed) is not counted."""
    remaining = max(request.num_cached_tokens, 0)
    tiers = request.kv_hit_tiers if offload else ["gpu"] * -(-remaining // block_size)
    split: dict[str, int] = {}
    for tier in tiers:
        if remaining <= 0:
            break
        n = min(block_size, remaining)
        split[tier] = split.get(tier, 0) + n
        remaining -= n
    if remaining > 0:  # tiers not recorded (should not happen): still count the tokens
        split["gpu"] = split.get("gpu", 0) + remaining
    return split


class LLMEngine:
    """Raises ValueError at construction on an inconsistent config (e.g. chunked prefill off
    with a token budget below ``max_model_len``). ``detokenize=False``: no text, no stop
    strings (a caller that detokenizes itself, like the API process, handles them)."""

    def __init__(
        self, config: EngineConfig, *, debug: bool = False, detokenize: bool = True
    ) -> None:
        from engine.runner.model_runner import ModelRunner

        self.config = config
        self.detokenize = detokenize
        from engine.models.sources import resolve_model_dir

        # demo model, converted GGUF, hub snapshot or HF dir
        model_dir = resolve_model_dir(config.model, dtype=config.dtype, device=config.device)
        self.model_dir = model_dir
        self.model_name = config.model or "kvtier-demo"
        self.tp: TPDriver | None = None
        if config.tensor_parallel_size > 1:  # ranks 1..N-1 in processes of their own
            from engine.runner.tp_worker import TPDriver

            self.tp = TPDriver(config, model_dir, cuda_graphs=not config.enforce_eager)
            self.runner = cast("ModelRunner", self.tp)
        else:
            self.runner = ModelRunner(config, model_dir, cuda_graphs=not config.enforce_eager)
        self.tokenizer: Any = load_tokenizer(config.tokenizer or model_dir)
        cache_cfg, sched_cfg = config.cache, config.scheduler
        bs = cache_cfg.block_size
        self.max_model_len = check_max_model_len(
            config, self.runner.max_model_len, self.runner.num_gpu_blocks
        )
        if (
            not sched_cfg.enable_chunked_prefill
            and sched_cfg.max_num_batched_tokens < self.max_model_len
        ):
            raise ValueError(
                "without chunked prefill max_num_batched_tokens "
                f"({sched_cfg.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len})"
            )
        self.pool = BlockPool(self.runner.num_gpu_blocks, bs, cache_cfg.enable_prefix_caching)
        namespace = Namespace(
            model_fingerprint=self.runner.model_fingerprint,
            block_size=bs,
            cache_salt=cache_cfg.cache_salt,
            hash_name=cache_cfg.hash_name,
        )
        self.namespace = namespace
        kv_manager = KVCacheManager(self.pool, namespace, cache_cfg.enable_prefix_caching)
        self.offload: KVConnector | None = None
        if config.kv_offload:
            from engine.kv_connector import CalibrationTarget, create_kv_connector

            target = CalibrationTarget(
                self.runner.execute_model,
                self.max_model_len,
                sched_cfg.max_num_batched_tokens,
                self.runner.vocab_size,
            )
            self.offload = create_kv_connector(
                "offload",
                config.kv_offload_config,
                self.runner.kv_cache,
                namespace,
                calibration=target,
                tp=self.tp,
            )
            self.pool.set_listener(self.offload.scheduler)
            self.runner.set_kv_connector(self.offload.worker)
        self.scheduler = Scheduler(
            sched_cfg,
            kv_manager,
            self.max_model_len,
            connector=self.offload.scheduler if self.offload is not None else None,
            debug=debug,
        )
        self.request_log = RequestLog(config.request_log) if config.request_log else None
        self._closed = False
        eos = self.runner.eos_token_ids
        if not eos and self.tokenizer.eos_token_id is not None:
            eos = (int(self.tokenizer.eos_token_id),)
        self.eos_token_ids = frozenset(eos)
        self._vocab_size = self.runner.vocab_size
        self._states: dict[str, _RequestState] = {}
        self._aborted: list[RequestOutput] = []
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        from engine.startup_log import describe_engine

        logger.info("%s", describe_engine(self))  # model, KV budget, tier stack: one block
        # Everything built so far (torch, transformers, the model, graphs, tiers) lives as
        # long as the engine: move it out of the collector's generations. With ~350K tracked
        # objects a full collection walks them all (177 ms measured on the CI machine), a
        # stall that lands on whatever request is in flight. Objects freed by reference
        # count are still freed; ``close`` unfreezes (a closed engine's cycles can go).
        gc.collect()
        gc.freeze()

    def add_request(
        self,
        req_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        arrival_time: float | None = None,
        api_times: dict[str, float] | None = None,
    ) -> None:
        """Queue a request. Raises ValueError for a duplicate id, an empty prompt, token ids
        outside the vocabulary, or a prompt of max_model_len tokens or more. ``api_times``:
        the caller's own TTFT phases (``ttft.API_PHASES``), kept for the request log."""
        if req_id in self._states:
            raise ValueError(f"duplicate request id {req_id!r}")
        prompt_ids = encode_prompt(self.tokenizer, prompt)
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in prompt_ids if not 0 <= t < self._vocab_size]
        if bad:
            raise ValueError(
                f"prompt token ids {bad[:5]} outside the vocabulary [0, {self._vocab_size})"
            )
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens; it must be shorter than "
                f"max_model_len ({self.max_model_len}) to leave room for output"
            )
        now = time.monotonic()
        arrival = now if arrival_time is None else arrival_time
        request = Request(req_id, prompt_ids, params, self.eos_token_ids, arrival_time=arrival)
        request.times.added = now
        request.times.api = clean_api_times(api_times)
        detok = None
        if self.detokenize:
            detok = IncrementalDetokenizer(
                self.tokenizer, prompt_ids, params.stop, params.min_tokens
            )
        self.scheduler.add_request(request)
        self._states[req_id] = _RequestState(
            request,
            detok,
            RequestMetrics(arrival_time=arrival),
            time.time() - (now - arrival),
            logprobs=[] if params.logprobs is not None else None,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )

    def abort_request(self, req_id: str) -> None:
        """End a request now; its final output (finish_reason "abort") comes with the next
        ``step()``. Unknown or already finished ids are ignored."""
        state = self._states.pop(req_id, None)
        if state is None:
            return
        self.scheduler.finish_request(req_id, RequestStatus.FINISHED_ABORTED)
        state.metrics.finished_time = time.monotonic()
        self._log_request(state)
        self._aborted.append(self._output(state, [], "", finished=True))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._aborted)

    def step(self) -> list[RequestOutput]:
        """Run one engine step. Mutates everything; raises whatever the runner raises."""
        outputs, self._aborted = self._aborted, []
        sched_out = self.scheduler.schedule()
        if sched_out.is_empty and self.offload is not None:
            # Every waiting request is "not yet" (its prefetch runs): wait for one briefly
            # rather than spin; short, so a request arriving meanwhile is not held up.
            self.offload.scheduler.wait_pending(_NOT_YET_WAIT_S)
        t0 = time.perf_counter()
        step_start = time.monotonic()
        runner_out = self.runner.execute_model(sched_out)
        self._stamp_prefill(sched_out, step_start, time.monotonic())
        if self.offload is not None:
            self._stamp_loads(self.offload.after_step())
            self._observe_prefill(sched_out, time.perf_counter() - t0)
        now = time.monotonic()
        self._collect_prompt_logprobs(runner_out.prompt_logprobs)
        for request in self.scheduler.update_from_output(sched_out, runner_out):
            entry = runner_out.logprobs.get(request.req_id)
            outputs.append(self._process_token(request, now, entry))  # type: ignore[arg-type]
        return outputs

    def _collect_prompt_logprobs(self, chunks: dict[str, tuple[int, list[object]]]) -> None:
        """Places each chunk's prompt logprobs at its positions (a re-prefill after a
        preemption overwrites them with the same values)."""
        for req_id, (first, entries) in chunks.items():
            state = self._states.get(req_id)
            if state is None or state.prompt_logprobs is None:
                continue
            del state.prompt_logprobs[first:]
            state.prompt_logprobs.extend(entries)  # type: ignore[arg-type]

    def _stamp_prefill(self, out: SchedulerOutput, start: float, end: float) -> None:
        """Every request that computed a prompt chunk in this step, before its first token."""
        requests = self.scheduler.requests
        for sliced in out.requests:
            request = requests.get(sliced.req_id)
            if request is not None and not request.output_token_ids:
                request.times.on_step(start, end, out.num_batched_tokens)

    def _stamp_loads(self, timings: Sequence[LoadTiming] | None) -> None:
        """The connector's measured copy time of each load that finished in this step."""
        requests = self.scheduler.requests
        for timing in timings or ():
            request = requests.get(timing.req_id)
            if request is not None:
                request.times.on_load(timing)

    def _process_token(
        self, request: Request, now: float, logprob: TokenLogprob | None = None
    ) -> RequestOutput:
        state = self._states[request.req_id]
        new_logprobs = None
        if state.logprobs is not None:
            new_logprobs = [logprob] if logprob is not None else []
            state.logprobs.extend(new_logprobs)
        metrics = state.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
            metrics.ttft_breakdown = request.times.breakdown(metrics.arrival_time, now)
            self._prompt_tokens_total += request.num_prompt_tokens
        metrics.last_token_time = now
        self._generation_tokens_total += 1
        token_id = request.output_token_ids[-1]
        new_text = ""
        detok = state.detokenizer
        if detok is not None:
            # A stop token or EOS ends the request but is not part of the text.
            stopped_by_token = request.status is RequestStatus.FINISHED_STOPPED
            update = detok.update([token_id], decode=not stopped_by_token)
            new_text = update.new_text
            if update.stop_string is not None:
                if not request.is_finished:
                    self.scheduler.finish_request(request.req_id, RequestStatus.FINISHED_STOPPED)
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = update.stop_string
            elif request.is_finished:
                new_text += detok.flush()
        if request.is_finished:
            metrics.finished_time = now
            del self._states[request.req_id]
            self._log_request(state)
        return self._output(
            state, [token_id], new_text, finished=request.is_finished, new_logprobs=new_logprobs
        )

    def _output(
        self,
        state: _RequestState,
        new_ids: list[int],
        new_text: str,
        *,
        finished: bool,
        new_logprobs: list[TokenLogprob] | None = None,
    ) -> RequestOutput:
        request = state.request
        return RequestOutput(
            req_id=request.req_id,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=list(request.output_token_ids),
            text=state.detokenizer.text if state.detokenizer is not None else "",
            new_token_ids=new_ids,
            new_text=new_text,
            finished=finished,
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            num_cached_tokens_by_tier=self._by_tier(state),
            logprobs=None if state.logprobs is None else list(state.logprobs),
            new_logprobs=new_logprobs if state.logprobs is not None else None,
            prompt_logprobs=state.prompt_logprobs,
            metrics=dataclasses.replace(state.metrics),  # a snapshot, not a live view
        )

    def _by_tier(self, state: _RequestState) -> dict[str, int]:
        request = state.request
        key = (request.num_cached_tokens, len(request.kv_hit_tiers))
        if state.by_tier is None or state.by_tier[0] != key:
            split = cached_tokens_by_tier(
                request, self.config.cache.block_size, self.offload is not None
            )
            state.by_tier = (key, split)
        return state.by_tier[1]

    def _observe_prefill(self, out: SchedulerOutput, seconds: float) -> None:
        """Feed the cost model a step that was one prefill chunk alone (a clean sample)."""
        if getattr(out.kv_connector_metadata, "loads", ()):
            return  # an in-step load's copies ran inside this step: not a pure prefill
        if self.offload is not None and len(out.requests) == 1:
            r = out.requests[0]
            if len(r.token_ids) > 1:
                self.offload.cost_model.observe_prefill(
                    len(r.token_ids), r.num_computed_tokens, seconds
                )

    def _log_request(self, state: _RequestState) -> None:
        if self.request_log is None:
            return
        request, m = state.request, state.metrics
        bs = self.config.cache.block_size
        hit_tiers = request.kv_hit_tiers
        if self.offload is None:
            hit_tiers = ["gpu"] * (max(request.num_cached_tokens, 0) // bs)
        ttft = None if m.first_token_time is None else m.first_token_time - m.arrival_time
        self.request_log.write(
            RequestLogEntry(
                ts=state.arrival_unix_s,
                req_id=request.req_id,
                prompt_tokens=request.num_prompt_tokens,
                block_hashes=tuple(
                    h.hex() for h in request.block_hashes[: request.num_prompt_tokens // bs]
                ),
                hit_tiers=tuple(hit_tiers),
                decision=request.kv_decision,
                ttft_s=ttft,
                ttft_breakdown_s=m.ttft_breakdown,
                num_prefill_steps=request.times.num_prefill_steps,
                prefill_step_tokens=request.times.prefill_step_tokens,
                kv_plan=request.kv_plan,
                load_read_s=request.times.load_read_s,
                load_copy_s=request.times.load_copy_s,
            )
        )

    def kv_stats(self) -> KVStats:
        """KV reuse counters: ``gpu_hit_tokens``, ``loaded_tokens``, ``recomputed_tokens``,
        per-tier ``hit_blocks``, bytes saved/loaded, load time, decisions, failed loads, the
        store's per-tier stats and the cost model (empty counters without kv offload)."""
        if self.offload is not None:
            return cast(KVStats, self.offload.stats())
        return {
            "gpu_hit_tokens": self.scheduler.stats.prefix_cache_hit_tokens_total,
            "loaded_tokens": 0,
            "recomputed_tokens": 0,
            "tiers": {},
            "decisions": {},
            "failed_loads": 0,
        }

    def save_kv(self) -> None:
        """Save every freed block to the host tier now; the copies to the tiers below go on in
        the background (an engine going idle calls it, so that another engine or a restart
        finds the last requests' KV). Between steps; no-op without offload."""
        if self.offload is not None:
            self.offload.save_pending()

    def flush_kv(self) -> None:
        """Write every freed block to the tiers now (between steps; no-op without offload)."""
        if self.offload is not None:
            self.offload.flush()

    def close(self) -> None:
        """Flush and close the offload connector (its store and tiers) and the request log.
        Idempotent; the engine must not be stepped afterwards."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.offload is not None:
                self.offload.close()
        finally:
            if self.request_log is not None:
                self.request_log.close()
            if self.tp is not None:
                self.tp.close()
            gc.unfreeze()  # process-wide: other live engines just lose the optimization

    def stats(self) -> dict[str, Any]:
        """Counters (``*_total``, monotonic) and gauges for metrics, flat numbers only (with
        offload on, ``kv_*_total`` counters too; ``kv_stats`` has the details). No side
        effect."""
        s = self.scheduler.stats
        return {
            "num_requests_running": self.scheduler.num_running,
            "num_requests_waiting": self.scheduler.num_waiting,
            "prompt_tokens_total": self._prompt_tokens_total,
            "generation_tokens_total": self._generation_tokens_total,
            "prefix_cache_hit_tokens_total": s.prefix_cache_hit_tokens_total,
            "prefix_cache_queried_tokens_total": s.prefix_cache_queried_tokens_total,
            "num_preemptions_total": s.num_preemptions_total,
            "num_schedule_steps": s.num_schedule_steps,
            "schedule_seconds_total": s.schedule_seconds_total,
            "num_blocked_skips": s.num_blocked_skips,
            "num_first_token_deferred_tokens": s.num_first_token_deferred_tokens,
            "gpu_blocks_total": self.pool.num_blocks,
            "gpu_blocks_free": self.pool.num_free_blocks,
            "gpu_cache_usage": self.pool.usage(),
            **self._kv_counters(),
        }

    def _kv_counters(self) -> dict[str, int | float]:
        if self.offload is None:
            return {}
        kv = self.offload.counters.snapshot()
        return {
            "kv_gpu_hit_tokens_total": kv["gpu_hit_tokens"],
            "kv_loaded_tokens_total": kv["loaded_tokens"],
            "kv_recomputed_tokens_total": kv["recomputed_tokens"],
            "kv_saved_bytes_total": kv["saved_bytes"],
            "kv_loaded_bytes_total": kv["loaded_bytes"],
            "kv_failed_loads_total": kv["failed_loads"],
            "kv_load_seconds_total": kv["load_seconds"],
        }


def check_max_model_len(config: EngineConfig, max_model_len: int, num_blocks: int) -> int:
    """The engine's ``max_model_len``: ``max_model_len`` (explicit, or the model's context
    length) when the pool of ``num_blocks`` holds one sequence that long. A sequence needing
    more blocks than the whole pool could never run, so a longer one is a ValueError saying
    what to change (as vLLM's start-up check), except for a pool fixed by ``num_gpu_blocks``
    under a derived length: tests and benchmarks size tiny pools on purpose, and there the
    length is cut to the pool with a warning. Never cut silently."""
    bs = config.cache.block_size
    pool_tokens = num_blocks * bs
    if max_model_len <= pool_tokens:
        return max_model_len
    explicit = config.scheduler.max_model_len is not None
    if not explicit and config.cache.num_gpu_blocks is not None:
        logger.warning(
            "max_model_len cut from %d (the model's context length) to %d: "
            "--num-gpu-blocks %d holds no longer sequence; pass --max-model-len to "
            "choose",
            max_model_len,
            pool_tokens,
            num_blocks,
        )
        return pool_tokens
    source = "--max-model-len" if explicit else "the model's context length (config.json)"
    more = (
        "--num-gpu-blocks"
        if config.cache.num_gpu_blocks is not None
        else "--gpu-memory-utilization (GPU) or --cpu-kv-cache-bytes (CPU)"
    )
    raise ValueError(
        f"max_model_len {max_model_len} ({source}) needs {-(-max_model_len // bs)} KV blocks, "
        f"but the KV cache holds {num_blocks} blocks ({pool_tokens} tokens): pass "
        f"--max-model-len {pool_tokens} or less, or give the KV cache more memory ({more})"
    )
