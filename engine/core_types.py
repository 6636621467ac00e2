"""The contract between the scheduler (torch-free, decides) and the model runner (moves tensors).

One ``SchedulerOutput`` per step is all the runner sees; one ``ModelRunnerOutput`` is all it
returns. A KV connector's traffic rides them both ways (vLLM's ``KVConnectorMetadata`` and
``KVConnectorOutput``): its scheduler side's orders in ``SchedulerOutput.kv_connector_metadata``,
its worker side's report in ``ModelRunnerOutput.kv_connector_output``. Names follow vLLM / FlashAttention: ``block_table``, ``num_computed_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams
from engine.ttft import LoadTiming


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request's slice of a step.

    ``token_ids`` are the tokens fed this step: a prefill chunk, or the one last sampled token
    when decoding. Their positions are ``num_computed_tokens .. num_computed_tokens+len-1``; the
    KV of positions ``< num_computed_tokens`` is already in the cache under ``block_table``.
    ``block_table`` covers at least ``num_computed_tokens + len(token_ids)`` positions; the
    runner writes the new KV into it (slot = block_table[pos // bs] * bs + pos % bs).
    ``sample`` is true when the last position of this slice produces the next token (decode, or
    the final chunk of a prefill). ``num_output_tokens`` counts tokens already generated, so a
    seeded sampler can derive per-token randomness independent of batching.
    """

    req_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    sample: bool
    sampling: SamplingParams
    num_output_tokens: int = 0
    # All tokens so far (prompt + output), filled only when ``sampling.needs_history``
    # (penalties, a grammar, prompt logprobs); else empty. The scheduler's live list: read it
    # during the step only.
    all_token_ids: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0
    # A decode of a request whose outputs show no text yet (``Request.awaits_text``): its step
    # is kept short like a first token's (``engine/sched/first_tokens.py``).
    awaits_text: bool = False
    # The ids this slice's sample must not produce (``Request.min_tokens_stop_ids``: stop ids
    # and EOS while under ``sampling.min_tokens`` outputs); empty for everyone else.
    min_tokens_stop_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    requests: list[ScheduledRequest]
    num_batched_tokens: int
    # Requests that finished or were preempted since the last step: the runner drops their state.
    finished_req_ids: frozenset[str] = frozenset()
    # Filled by the KV connector's scheduler side (``build_connector_meta``), opaque here; None
    # when no connector.
    kv_connector_metadata: object | None = None

    @property
    def is_empty(self) -> bool:
        return not self.requests


@dataclass(frozen=True, slots=True)
class KVConnectorOutput:
    """The worker side's report of one step, built by its ``after_step`` and consumed by the
    scheduler side (``SchedulerConnector.update_connector_output``) in
    ``Scheduler.update_from_output``, before the step's requests advance. ``report``: the
    connector's own (opaque here, as ``kv_connector_metadata``); ``load_timings``: the measured
    copy time of each load that finished in this step (the TTFT breakdown's ``load``,
    engine/ttft.py), which the scheduler stamps on its requests."""

    report: object | None = None
    load_timings: tuple[LoadTiming, ...] = ()


@dataclass(slots=True)
class ModelRunnerOutput:
    # req_id -> sampled token id, only for requests with ``sample=True``.
    sampled_token_ids: dict[str, int]
    # Optional, for tests: req_id -> logits row (a torch tensor) of the sampled pos.
    logits: dict[str, object] | None = None
    # req_id -> the sampled token's logprob entry (engine.outputs.TokenLogprob), for requests
    # with ``sampling.logprobs`` set.
    logprobs: dict[str, object] = field(default_factory=dict)
    # req_id -> (first prompt position covered, entries): prompt logprobs of this step's
    # chunk, for requests with ``sampling.prompt_logprobs`` set.
    prompt_logprobs: dict[str, tuple[int, list[object]]] = field(default_factory=dict)
    # The KV connector's worker-side report of this step (empty steps too); None without one.
    kv_connector_output: KVConnectorOutput | None = None
    # Where the step's wall time went in the runner (seconds; ``STEP_PARTS``): building the
    # inputs, the connector's pre-forward hook (its copies issued), the forward (its kernels
    # enqueued on CUDA, computed on the CPU), logits and sampling (on CUDA: waiting for the
    # device), the connector's post-forward hooks. Empty for an empty step.
    step_parts: dict[str, float] = field(default_factory=dict)
