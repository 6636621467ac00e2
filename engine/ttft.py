"""Per-request TTFT breakdown: where the time from arrival to the first token went.

The scheduler and the engine stamp a request's ``RequestTimes`` as it moves (added to the
core, admitted, its KV load seen done, each step that computed a prefill chunk); at its first
token ``breakdown`` turns the stamps into phases. All stamps are ``time.monotonic()``, one
clock for every process of the host, so the API's arrival time and the core's stamps compare.

Phases (seconds), which add up to the engine-side TTFT (first token - arrival), the parts
of ``schedule`` and of ``load`` (``SUB_PHASES``) aside:

- ``to_core``: arrival in the API (after tokenizing) -> the core's ``add_request`` (request
  message, ZMQ, and the wait for the core's current step to end)
- ``queue``: waiting to be admitted, less ``schedule``
- ``schedule``: the scheduler's own work on it, ``hash`` + ``lookup`` (GPU prefix and the
  connector's tiers, the cost model's decision included) + ``decide`` (block allocation and the
  connector's load set-up); summed over every pass that considered it
- ``load``: the request's KV load on its TTFT path: admitted with an asynchronous KV load ->
  the step that saw the load done (its granularity is the step: a load that ends mid-step is
  seen at the next boundary), plus the copy time of an in-step load (copied before the forward
  of the step that admits it), taken out of that step's ``prefill_compute``. An overlapped
  tail load runs beside the head's compute: it shows in ``prefill_wait`` only as far as the
  head waits for it
- ``load_copy`` (a part of ``load``, never added to the others): the worker's own copy time of
  the request's blocks into the GPU cache, as the worker measured it (CUDA: events around the
  copies, read once they completed, so no extra sync; CPU: wall clock). An in-step load's
  copy time is what moves from ``prefill_compute`` to ``load`` (with layer-wise loads the
  copies partly run under the forward, so that is an upper bound of their exposed time). For
  an asynchronous load the rest of ``load`` is the tier read, staging and step granularity;
  for an overlap's tail it may exceed ``load`` (the copies ran beside the head's compute)
- ``prefill_wait``: ready to compute -> the end of its last prefill step, less compute: the
  rest of the step it was admitted in, and the gaps between its chunks
- ``prefill_compute``: the model runner's time for every step that computed one of its chunks
  (the whole batch's time: steps are shared); it includes the first token's sampling, whose
  GPU time cannot be split off without an extra device sync
- ``first_sample``: the end of that step's forward and sampling -> its output (connector
  ``after_step``, scheduler update)

and, from the API process (sent with the request): ``api_template``, ``api_tokenize``; and,
measured only there once the token arrives: ``return`` (core's first-token time -> the API
hands the first chunk to the HTTP response) and ``first_text`` (core's first-token time -> the
first chunk that carries text, which a client such as the production-stack QA client takes as
its first token; the finishing chunk if none does: longer than ``return`` by the decode steps
of leading tokens that detokenize to nothing). Not thread-safe: the engine thread owns it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

# Phases in timeline order: the names of the request-log keys and the ``phase`` label of the
# Prometheus histogram ``kvtier_request_ttft_phase_seconds``. Keep them stable: add new
# names, never rename (``load_copy`` came after the others).
API_PHASES = ("api_template", "api_tokenize")
ENGINE_PHASES = (
    "to_core",
    "queue",
    "schedule",
    "hash",
    "lookup",
    "decide",
    "load",
    "load_copy",
    "prefill_wait",
    "prefill_compute",
    "first_sample",
)
RETURN_PHASE = "return"
FIRST_TEXT_PHASE = "first_text"
ALL_PHASES = (*API_PHASES, *ENGINE_PHASES, RETURN_PHASE, FIRST_TEXT_PHASE)
# Where a step's time went in the model runner (``ModelRunnerOutput.step_parts``): summed
# over a request's prefill steps, they are what its ``prefill_compute`` (before an in-step
# copy is moved to ``load``) was made of, the rest being the engine's own between the
# runner's return and the step's end stamp (``RequestTimes.prefill_step_parts_s``).
STEP_PARTS = ("inputs", "hook", "forward", "sample", "after")
# Beside them, not part of the sum: the engine thread's own CPU time (``time.thread_time``)
# over ``forward``. Well under ``forward``, the thread was waiting there (another thread
# holding the GIL, a full driver queue, a call that blocks on the device), not launching:
# what the H200 QA run's 12-47 ms launches of the same ~500-token step need to tell apart.
# ``others_cpu``: the CPU time the process's other Python threads ran for meanwhile (a save's
# seal thread, a load thread, a tier's writer): each of them holding the GIL delays every
# torch call of the launches (engine/runner/thread_cpu.py).
STEP_CPU_PARTS = ("forward_cpu", "others_cpu")
# Beside them too, not summed: where ``inputs`` went (``inputs_upload``: the inputs' pinned
# staging and host->device copy; ``inputs_plan``: the attention plan, its staging fence's wait
# included) and the thread's CPU time over ``inputs`` and ``hook``. A part whose CPU time
# equals its wall time while nothing of it should wait was spinning in a blocking driver call.
STEP_SUB_PARTS = ("inputs_upload", "inputs_plan", "inputs_cpu", "hook_cpu")
# Sub-phases of ``schedule`` and of ``load``: never added to the others.
SCHEDULE_PARTS = ("hash", "lookup", "decide")
LOAD_PARTS = ("load_copy",)
SUB_PHASES = (*SCHEDULE_PARTS, *LOAD_PARTS)


@dataclass(frozen=True, slots=True)
class LoadTiming:
    """A KV connector's measure of one finished load of request ``req_id``: ``copy_s`` its
    copies into the GPU cache took (device time on CUDA); ``in_step``: they ran before the
    forward of a step that computed the request (so inside that step's time)."""

    req_id: str
    copy_s: float
    in_step: bool = False
    read_s: float = 0.0  # its reads from tiers below the host (the load thread's wall time)


@dataclass(slots=True)
class RequestTimes:
    """Stamps of one request until its first token (monotonic seconds; None: not yet)."""

    added: float | None = None
    admitted: float | None = None  # last admission decision (RUNNING or WAITING_FOR_KV)
    ready: float | None = None  # admitted RUNNING: may compute from now on
    last_prefill_end: float | None = None
    hash_s: float = 0.0
    lookup_s: float = 0.0
    decide_s: float = 0.0
    prefill_compute_s: float = 0.0
    load_copy_s: float = 0.0  # every load's copy time (``LoadTiming.copy_s``)
    in_step_load_s: float = 0.0  # of which inside one of its prefill steps
    load_read_s: float = 0.0  # lower-tier reads (``LoadTiming.read_s``), for the request log
    num_prefill_steps: int = 0
    prefill_step_tokens: int = 0  # every token of the steps that computed its prompt
    prefill_step_parts_s: dict[str, float] = field(default_factory=dict)  # STEP_PARTS, summed
    api: dict[str, float] = field(default_factory=dict)

    def on_step(
        self,
        start: float,
        end: float,
        step_tokens: int = 0,
        parts: Mapping[str, float] | None = None,
    ) -> None:
        """A step from ``start`` to ``end`` (``step_tokens`` tokens in all, other requests'
        included; ``parts``: the runner's ``step_parts``) computed one of this request's
        prefill chunks."""
        self.prefill_compute_s += end - start
        self.num_prefill_steps += 1
        self.prefill_step_tokens += step_tokens
        self.last_prefill_end = end
        for name, seconds in (parts or {}).items():
            self.prefill_step_parts_s[name] = self.prefill_step_parts_s.get(name, 0.0) + seconds

    def on_load(self, timing: LoadTiming) -> None:
        """The connector reported one of this request's loads done."""
        self.load_copy_s += timing.copy_s
        self.load_read_s += timing.read_s
        if timing.in_step:
            self.in_step_load_s += timing.copy_s

    def _stamps(self, arrival: float) -> tuple[float, float, float]:
        """(added, admitted, ready), each missing stamp (a request admitted before this
        bookkeeping, a test's bare scheduler) taken as the one before it."""
        added = _or(self.added, arrival)
        admitted = _or(self.admitted, added)
        return added, admitted, _or(self.ready, admitted)

    def queued_scheduled(self, arrival: float) -> tuple[float, float]:
        """When the request reached the core and when it could first compute (the stamps
        vLLM's queue and prefill times run between)."""
        added, _, ready = self._stamps(arrival)
        return added, ready

    def breakdown(self, arrival: float, first_token: float) -> dict[str, float]:
        """The phases of a request whose first token came at ``first_token``. Pure. Missing
        stamps make their phases 0 rather than failing."""
        added, admitted, ready = self._stamps(arrival)
        prefill_end = _or(self.last_prefill_end, first_token)
        schedule = self.hash_s + self.lookup_s + self.decide_s
        # In-step copies ran inside its prefill steps: moved from compute to load, so the
        # additive phases still sum to the TTFT.
        in_step = min(self.in_step_load_s, self.prefill_compute_s)
        out = {name: max(0.0, self.api.get(name, 0.0)) for name in API_PHASES}
        out.update(
            to_core=max(0.0, added - arrival),
            queue=max(0.0, admitted - added - schedule),
            schedule=schedule,
            hash=self.hash_s,
            lookup=self.lookup_s,
            decide=self.decide_s,
            load=max(0.0, ready - admitted) + in_step,
            load_copy=self.load_copy_s,
            prefill_wait=max(0.0, prefill_end - ready - self.prefill_compute_s),
            prefill_compute=self.prefill_compute_s - in_step,
            first_sample=max(0.0, first_token - prefill_end),
        )
        return out


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


def api_times(template_s: float, tokenize_s: float) -> dict[str, float]:
    return {"api_template": template_s, "api_tokenize": tokenize_s}


def clean_api_times(raw: Mapping[str, object] | None) -> dict[str, float]:
    """The API phases of ``raw`` (from the wire) as floats; unknown keys and bad values are
    dropped, never raised on: timings must not fail a request."""
    if not raw:
        return {}
    out: dict[str, float] = {}
    for name in API_PHASES:
        value = raw.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = float(value)
    return out
