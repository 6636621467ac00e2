"""The request log's schema: one JSON object per finished request, one per line (JSONL).

The engine writes it (``--request-log FILE``, ``engine/request_log.py``); ``kvtier analyze``
reads it (``cachestore.analyze.traces``, format ``request-log``, which needs only ``ts``,
``prompt_tokens`` and ``block_hashes``). docs/analyze.md has the schema too::

    {"ts": 1764403200.12, "req_id": "llm-0", "prompt_tokens": 85,
     "block_hashes": ["9f2c...", ...], "hit_tiers": ["gpu", "host", "lmdb"],
     "decision": "load_prefix", "ttft_s": 0.0123,
     "ttft_breakdown_s": {"api_template": 0.0001, "to_core": 0.0003, "queue": 0.0, ...},
     "num_prefill_steps": 1, "kv_load_s": {"read": 0.0, "copy": 0.0009},
     "prefill_step_tokens": 85, "prefill_step_parts_s": {"inputs": 0.0002, ...},
     "kv_plan": {"gpu_tokens": 0, ...}}

- ``ts``: the Unix time the request arrived; ``block_hashes``: the hex chained hashes of every
  full block of the prompt; ``hit_tiers``: the tier that served each leading cached block;
  ``decision``: the reload decision (``cachestore.cost.model.Strategy``, its value).
- ``ttft_breakdown_s``: the phases of ``ttft_s`` (engine/ttft.py; ``load_copy`` the measured
  copy of its KV load into the GPU cache); null for a request ended before its first token.
- ``num_prefill_steps``: the steps that computed its prompt; ``prefill_step_tokens``: every
  token of those steps (other requests' chunks and decodes included: what its
  ``prefill_compute`` paid for); ``prefill_step_parts_s``: where those steps' time went in
  the model runner, summed over them (engine/ttft.py ``STEP_PARTS``: ``inputs``, ``hook`` the
  KV connector's pre-forward work, ``forward`` (on CUDA its kernels enqueued), ``sample``
  (on CUDA the wait for the device), ``after``); empty when not measured.
- ``kv_load_s``: the measured parts of its KV loads: ``read`` from tiers below the host (wall
  time of the load thread, chunks overlapping the copies when pipelined) and ``copy`` into the
  GPU cache (``load_copy``). With ``decision`` ``overlap`` the head's compute is
  ``prefill_compute`` and the tail's load these parts.
- ``kv_plan``: the offload connector's planned split at admission (``gpu_tokens``,
  ``head_tokens`` computed beside the load, ``load_tokens``, ``recompute_tokens``,
  ``predicted_s`` the cost model's TTFT, ``backlog_s`` the seconds of other loads' reads
  queued on the load thread that it was priced behind, ``options``: ``{strategy: [raw price
  s, ratio]}`` of what ``decision: cost`` weighed, the chosen one first, each ranked by price
  times its kind's measured-to-priced ratio; empty when nothing was priced); null without a
  connector.

Pure: no I/O here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# The JSON field names; the reader needs the first three and sniffs the format by the third.
TS = "ts"
PROMPT_TOKENS = "prompt_tokens"
BLOCK_HASHES = "block_hashes"
REQ_ID = "req_id"
HIT_TIERS = "hit_tiers"
DECISION = "decision"
TTFT_S = "ttft_s"
TTFT_BREAKDOWN_S = "ttft_breakdown_s"
NUM_PREFILL_STEPS = "num_prefill_steps"
KV_LOAD_S = "kv_load_s"
PREFILL_STEP_TOKENS = "prefill_step_tokens"
PREFILL_STEP_PARTS_S = "prefill_step_parts_s"
KV_PLAN = "kv_plan"


@dataclass(frozen=True, slots=True)
class RequestLogEntry:
    """One finished request, as the module docstring describes its line."""

    ts: float
    req_id: str
    prompt_tokens: int
    block_hashes: tuple[str, ...]
    hit_tiers: tuple[str, ...]
    decision: str
    ttft_s: float | None
    ttft_breakdown_s: dict[str, float] | None = None
    num_prefill_steps: int = 0
    load_read_s: float = 0.0
    load_copy_s: float = 0.0
    prefill_step_tokens: int = 0
    kv_plan: dict[str, Any] | None = None
    prefill_step_parts_s: dict[str, float] | None = None

    def to_json(self) -> str:
        """The entry as one compact JSON line (no newline); seconds rounded to 0.1 us."""
        breakdown = self.ttft_breakdown_s
        return json.dumps(
            {
                TS: self.ts,
                REQ_ID: self.req_id,
                PROMPT_TOKENS: self.prompt_tokens,
                BLOCK_HASHES: list(self.block_hashes),
                HIT_TIERS: list(self.hit_tiers),
                DECISION: self.decision,
                TTFT_S: self.ttft_s,
                TTFT_BREAKDOWN_S: None
                if breakdown is None
                else {k: round(v, 7) for k, v in breakdown.items()},
                NUM_PREFILL_STEPS: self.num_prefill_steps,
                KV_LOAD_S: {"read": round(self.load_read_s, 7), "copy": round(self.load_copy_s, 7)},
                PREFILL_STEP_TOKENS: self.prefill_step_tokens,
                PREFILL_STEP_PARTS_S: {
                    k: round(v, 7) for k, v in (self.prefill_step_parts_s or {}).items()
                },
                KV_PLAN: self.kv_plan,
            },
            separators=(",", ":"),
        )
