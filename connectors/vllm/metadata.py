"""What crosses between the connector's two sides, as plain picklable values. Torch-free.

Scheduler -> worker, once per engine step (``StepPlan``, carried inside vLLM's connector
metadata): the blocks to load before the forward (``LoadJob``: keys and the vLLM block ids
they land in, in order) and the full blocks to save after it (``SaveJob``), plus the prefill
this step is a clean sample of (one request alone in the step), for the cost model.

Worker -> scheduler, once per step (``WorkerFeedback``, inside vLLM's worker metadata): the
measured transfers per tier and the timed prefill, fed to the scheduler's cost model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cachestore.hashing import BlockKey


@dataclass(frozen=True, slots=True)
class LoadJob:
    req_id: str
    keys: tuple[BlockKey, ...]
    block_ids: tuple[int, ...]  # vLLM block ids, one per key
    tiers: tuple[str, ...]  # the tier the scheduler saw serving each key


@dataclass(frozen=True, slots=True)
class SaveJob:
    req_id: str
    keys: tuple[BlockKey, ...]
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class StepPlan:
    loads: tuple[LoadJob, ...] = ()
    saves: tuple[SaveJob, ...] = ()
    # (new tokens, cached context tokens) when one request alone is prefilled this step.
    prefill_sample: tuple[int, int] | None = None


@dataclass(slots=True)
class WorkerFeedback:
    transfers: list[tuple[str, int, float]] = field(default_factory=list)  # tier, bytes, s
    prefills: list[tuple[int, int, float]] = field(default_factory=list)  # new, context, s

    def merge(self, other: WorkerFeedback) -> WorkerFeedback:
        """Both workers' samples (TP ranks), as a new value."""
        return WorkerFeedback(self.transfers + other.transfers, self.prefills + other.prefills)
