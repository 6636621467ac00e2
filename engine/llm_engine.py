"""``LLMEngine``: tokenizer + scheduler + model runner, stepped by one caller thread.

Each ``step()`` schedules one batch, runs it, advances request state, detokenizes the new
tokens (stop strings included) and returns a ``RequestOutput`` for every request that produced
a token or finished. With ``detokenize=False`` (the engine-core process: the API process
detokenizes) outputs carry token ids only, empty text, and stop strings are the caller's job. Not thread-safe: one thread drives it (the server's engine thread, or
``LLM``).
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from cachestore.hashing import Namespace
from engine.config import EngineConfig, check_max_model_len, check_token_budget
from engine.core_types import SchedulerOutput
from engine.kv_stats import KVStats
from engine.llm_requests import (
    RequestState,
    collect_prompt_logprobs,
    log_entry,
    request_output,
)
from engine.llm_stats import engine_stats, kv_stats
from engine.outputs import RequestMetrics, RequestOutput, TokenLogprob
from engine.request import Request, RequestStatus
from engine.request_log import RequestLog
from engine.sampling_params import SamplingParams
from engine.sched.block_pool import BlockPool
from engine.sched.kv_cache_manager import KVCacheManager
from engine.sched.scheduler import Scheduler
from engine.step_log import StepLog
from engine.tokenizer import (
    IncrementalDetokenizer,
    encode_prompt,
    load_tokenizer,
    textless_token_ids,
    textless_token_ids_from_file,
    tokenizer_dir_problem,
)
from engine.ttft import clean_api_times

if TYPE_CHECKING:
    from engine.kv_connector import KVConnector
    from engine.runner.model_runner import ModelRunner
    from engine.runner.tp_worker import TPDriver

logger = logging.getLogger(__name__)

# How long a step that scheduled nothing waits for the connector's off-step work (a prefetch):
# short, so that a request arriving meanwhile is not held up.
_NOT_YET_WAIT_S = 0.005


class LLMEngine:
    """Raises ValueError at construction on an inconsistent config (e.g. chunked prefill off
    with a token budget below ``max_model_len``). ``detokenize=False``: no text, no stop
    strings (a caller that detokenizes itself, like the API process, handles them)."""

    def __init__(
        self, config: EngineConfig, *, debug: bool = False, detokenize: bool = True
    ) -> None:
        self.config = config
        self.detokenize = detokenize
        from engine.models.sources import resolve_model_dir

        # demo model, converted GGUF, hub snapshot or HF dir
        model_dir = resolve_model_dir(config.model, dtype=config.dtype, device=config.device)
        self.model_dir = model_dir
        self.model_name = config.model or "kvtier-demo"
        self.tp: TPDriver | None = None
        self.runner = self._build_runner(model_dir)
        # The engine core (``detokenize=False``: the API process tokenizes and detokenizes)
        # loads the tokenizer only if something asks for it (``tokenizer``): transformers'
        # AutoTokenizer cost ~3.5 CPU s of its ~6 s start on the 2-core CPU, beside the API
        # process's own load. Its directory is checked here all the same.
        self._tokenizer_dir = config.tokenizer or model_dir
        self._tokenizer: Any = None
        self._tokenizer_lock = threading.Lock()
        if detokenize:
            self._tokenizer = load_tokenizer(self._tokenizer_dir)
        elif (problem := tokenizer_dir_problem(self._tokenizer_dir)) is not None:
            raise ValueError(f"cannot load a tokenizer from {self._tokenizer_dir!r}: {problem}")
        cache_cfg, sched_cfg = config.cache, config.scheduler
        bs = cache_cfg.block_size
        self.max_model_len = check_max_model_len(
            config, self.runner.max_model_len, self.runner.num_gpu_blocks
        )
        check_token_budget(sched_cfg, self.max_model_len)
        self.pool = BlockPool(self.runner.num_gpu_blocks, bs, cache_cfg.enable_prefix_caching)
        namespace = Namespace(
            model_fingerprint=self.runner.model_fingerprint,
            block_size=bs,
            cache_salt=cache_cfg.cache_salt,
            hash_name=cache_cfg.hash_name,
        )
        self.namespace = namespace
        kv_manager = KVCacheManager(self.pool, namespace, cache_cfg.enable_prefix_caching)
        self.kv_connector = self._build_kv_connector(namespace) if config.kv_offload else None
        if self.kv_connector is not None:
            self.pool.set_listener(self.kv_connector.scheduler)
            self.runner.set_kv_connector(self.kv_connector.worker)
        self.scheduler = Scheduler(
            sched_cfg,
            kv_manager,
            self.max_model_len,
            connector=self.kv_connector.scheduler if self.kv_connector is not None else None,
            debug=debug,
        )
        self.request_log = RequestLog(config.request_log) if config.request_log else None
        self.step_log = StepLog(config.step_log) if config.step_log else None
        self._closed = False
        # The model's (generation_config.json, config.json), else the tokenizer's.
        eos = self.runner.eos_token_ids or (self.tokenizer.eos_token_id,)
        self.eos_token_ids = frozenset(int(t) for t in eos if t is not None)
        self._vocab_size = self.runner.vocab_size
        # Outputs that show no text alone: a request of only those keeps its steps short
        # (engine/sched/first_tokens.py); without first-token steps nothing reads them.
        self.textless_token_ids = (
            self._textless_token_ids() if sched_cfg.first_token_step_tokens > 0 else frozenset()
        )
        self._states: dict[str, RequestState] = {}
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

    @property
    def tokenizer(self) -> Any:  # -> transformers.PreTrainedTokenizerBase
        """The model's tokenizer, loaded on first use where the constructor did not."""
        if self._tokenizer is None:
            with self._tokenizer_lock:
                if self._tokenizer is None:
                    self._tokenizer = load_tokenizer(self._tokenizer_dir)
        return self._tokenizer

    def _textless_token_ids(self) -> frozenset[int]:
        """``textless_token_ids`` through the tokenizer when it is loaded, else from its
        ``tokenizer.json`` alone (no transformers), else through the tokenizer after all."""
        if self._tokenizer is None:
            found = textless_token_ids_from_file(self._tokenizer_dir, self._vocab_size)
            if found is not None:
                return found
        return textless_token_ids(self.tokenizer, self._vocab_size)

    def _build_runner(self, model_dir: str) -> ModelRunner:
        """The model runner; under tensor parallelism rank 0's driver (``self.tp``), ranks
        1..N-1 in processes of their own."""
        from engine.runner.model_runner import ModelRunner

        graphs = not self.config.enforce_eager
        if self.config.tensor_parallel_size == 1:
            return ModelRunner(self.config, model_dir, cuda_graphs=graphs)
        from engine.runner.tp_worker import TPDriver

        self.tp = TPDriver(self.config, model_dir, cuda_graphs=graphs)
        return cast("ModelRunner", self.tp)

    def _build_kv_connector(self, namespace: Namespace) -> KVConnector:
        """The configured connector (``config.kv_connector``), calibrated on this runner."""
        from engine.kv_connector import CalibrationTarget, create_kv_connector

        target = CalibrationTarget(
            self.runner.execute_model,
            self.max_model_len,
            self.config.scheduler.max_num_batched_tokens,
            self.runner.vocab_size,
        )
        return create_kv_connector(
            self.config.kv_connector,
            self.config.kv_offload_config,
            self.runner.kv_cache,
            namespace,
            calibration=target,
            tp=self.tp,
        )

    @property
    def offload(self) -> KVConnector | None:
        """The KV connector ``--kv-offload`` built (``kv_connector``), None without one."""
        return self.kv_connector

    def _check_in_vocab(self, what: str, ids: Sequence[int]) -> None:
        """Raises ValueError naming ``what`` for ids outside the vocabulary."""
        bad = [t for t in ids if not 0 <= t < self._vocab_size]
        if bad:
            raise ValueError(f"{what} {bad[:5]} outside the vocabulary [0, {self._vocab_size})")

    def add_request(
        self,
        req_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        arrival_time: float | None = None,
        api_times: dict[str, float] | None = None,
    ) -> None:
        """Queue a request. Raises ValueError for a duplicate id, an empty prompt, prompt
        token ids or ``params.allowed_token_ids`` outside the vocabulary (the runner masks
        logits by them), or a prompt of max_model_len tokens or more. ``api_times``:
        the caller's own TTFT phases (``ttft.API_PHASES``), kept for the request log."""
        if req_id in self._states:
            raise ValueError(f"duplicate request id {req_id!r}")
        # token ids need no tokenizer (the engine core's only kind: it loads none unless asked)
        prompt_ids = (
            encode_prompt(self.tokenizer, prompt)
            if isinstance(prompt, str)
            else [int(t) for t in prompt]
        )
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        self._check_in_vocab("prompt token ids", prompt_ids)
        self._check_in_vocab("allowed_token_ids", params.allowed_token_ids or ())
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens; it must be shorter than "
                f"max_model_len ({self.max_model_len}) to leave room for output"
            )
        now = time.monotonic()
        arrival = now if arrival_time is None else arrival_time
        request = Request(
            req_id,
            prompt_ids,
            params,
            self.eos_token_ids,
            arrival_time=arrival,
            textless_token_ids=self.textless_token_ids,
        )
        request.times.added = now
        request.times.api = clean_api_times(api_times)
        detok = None
        if self.detokenize:
            detok = IncrementalDetokenizer.for_params(self.tokenizer, prompt_ids, params)
        self.scheduler.add_request(request)
        self._states[req_id] = RequestState(
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
        if sched_out.is_empty:  # every waiting request may be "not yet": wait, don't spin
            self.scheduler.wait_pending(_NOT_YET_WAIT_S)
        t0 = time.perf_counter()
        step_start = time.monotonic()
        wall_start = time.time()
        runner_out = self.runner.execute_model(sched_out)
        step_end = time.monotonic()
        self._stamp_prefill(sched_out, step_start, step_end, runner_out.step_parts)
        if self.step_log is not None:
            self.step_log.write(
                wall_start,
                step_end - step_start,
                sched_out,
                runner_out,
                self.scheduler.num_waiting,
                self.scheduler.num_running,
            )
        if self.kv_connector is not None:
            self.kv_connector.observe_step(sched_out, time.perf_counter() - t0)
        now = time.monotonic()
        collect_prompt_logprobs(self._states, runner_out.prompt_logprobs)
        # Hands the connector's report (runner_out.kv_connector_output) to its scheduler side.
        for request in self.scheduler.update_from_output(sched_out, runner_out):
            entry = runner_out.logprobs.get(request.req_id)
            outputs.append(self._process_token(request, now, entry))  # type: ignore[arg-type]
        return outputs

    def _stamp_prefill(
        self,
        out: SchedulerOutput,
        start: float,
        end: float,
        parts: Mapping[str, float] | None = None,
    ) -> None:
        """Every request that computed a prompt chunk in this step, before its first token."""
        requests = self.scheduler.requests
        for sliced in out.requests:
            request = requests.get(sliced.req_id)
            if request is not None and not request.output_token_ids:
                request.times.on_step(start, end, out.num_batched_tokens, parts)

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
            metrics.queued_time, metrics.scheduled_time = request.times.queued_scheduled(
                metrics.arrival_time
            )
            if self.kv_connector is not None:
                self.kv_connector.observe_first_token(request, metrics.ttft_breakdown)
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
        state: RequestState,
        new_ids: list[int],
        new_text: str,
        *,
        finished: bool,
        new_logprobs: list[TokenLogprob] | None = None,
    ) -> RequestOutput:
        return request_output(
            state,
            new_ids,
            new_text,
            finished=finished,
            block_size=self.config.cache.block_size,
            offload=self.kv_connector is not None,
            new_logprobs=new_logprobs,
        )

    def _log_request(self, state: RequestState) -> None:
        if self.request_log is not None:
            bs = self.config.cache.block_size
            self.request_log.write(log_entry(state, bs, self.kv_connector is not None))

    def kv_stats(self) -> KVStats:
        """KV reuse counters: ``gpu_hit_tokens``, ``loaded_tokens``, ``recomputed_tokens``,
        per-tier ``hit_blocks``, bytes saved/loaded, load time, decisions, failed loads, the
        store's per-tier stats and the cost model (empty counters without kv offload)."""
        return kv_stats(self.scheduler, self.kv_connector)

    def save_kv(self) -> None:
        """Save every freed block to the host tier now; the copies to the tiers below go on in
        the background (an engine going idle calls it, so that another engine or a restart
        finds the last requests' KV). Between steps; no-op without offload."""
        if self.kv_connector is not None:
            self.kv_connector.save_pending()

    def flush_kv(self) -> None:
        """Write every freed block to the tiers now (between steps; no-op without offload)."""
        if self.kv_connector is not None:
            self.kv_connector.flush()

    def close(self) -> None:
        """Flush and close the offload connector (its store and tiers) and the request log.
        Idempotent; the engine must not be stepped afterwards."""
        if self._closed:
            return
        self._closed = True
        busiest = self.runner.busiest_threads()
        if busiest:  # which threads competed with the steps for the GIL (``others_cpu``)
            logger.info("other threads' CPU seconds: %s", ", ".join(f"{n} {c}" for n, c in busiest))
        try:
            if self.kv_connector is not None:
                self.kv_connector.close()
        finally:
            if self.request_log is not None:
                self.request_log.close()
            if self.step_log is not None:
                self.step_log.close()
            if self.tp is not None:
                self.tp.close()
            gc.unfreeze()  # process-wide: other live engines just lose the optimization

    def stats(self) -> dict[str, Any]:
        """Counters (``*_total``, monotonic) and gauges for metrics, flat numbers only (with
        offload on, ``kv_*_total`` counters too; ``kv_stats`` has the details). No side
        effect."""
        return engine_stats(
            self.scheduler,
            self.pool,
            self.kv_connector,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
        )
