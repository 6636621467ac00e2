"""The engine's JSONL request log (``--request-log FILE``), in the schema of docs/analyze.md.

One JSON object per finished request, one per line::

    {"ts": 1764403200.12, "req_id": "llm-0", "prompt_tokens": 85,
     "block_hashes": ["9f2c...", ...], "hit_tiers": ["gpu", "host", "lmdb"],
     "decision": "load_prefix", "ttft_s": 0.0123,
     "ttft_breakdown_s": {"api_template": 0.0001, "to_core": 0.0003, "queue": 0.0, ...},
     "num_prefill_steps": 1, "kv_load_s": {"read": 0.0, "copy": 0.0009}}

``ts`` is the Unix time the request arrived; ``block_hashes`` the hex chained hashes of every
full block of the prompt; ``hit_tiers`` the tier that served each leading cached block;
``decision`` the reload decision (``cost_model.STRATEGY_*``); ``ttft_breakdown_s`` the phases
of ``ttft_s`` (engine/ttft.py, ``load_copy`` the measured copy of its KV load into the GPU
cache; null for a request ended before its first token) and
``num_prefill_steps`` the steps that computed its prompt; ``kv_load_s`` the measured parts of its
KV loads: ``read`` from tiers below the host (wall time of the load thread, chunks overlapping
the copies when pipelined) and ``copy`` into the GPU cache (``load_copy``);
``prefill_step_tokens`` every token of the steps that computed its prompt (other requests'
chunks and decodes included: what its ``prefill_compute`` paid for); ``kv_plan`` the offload
connector's planned split at admission (``gpu_tokens``, ``head_tokens`` computed beside the
load, ``load_tokens``, ``recompute_tokens``, ``predicted_s`` the cost model's TTFT; null
without a connector). With ``decision``
``overlap`` the head's compute is ``prefill_compute`` and the tail's load these parts. ``kvtier analyze`` reads it
(format ``request-log``; it needs only ``ts``, ``prompt_tokens`` and ``block_hashes``). Each line is written and flushed at once, so a crash loses at most
the line being written. Not thread-safe: the engine thread writes it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import IO


@dataclass(frozen=True, slots=True)
class RequestLogEntry:
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
    kv_plan: dict[str, float] | None = None

    def to_json(self) -> str:
        return json.dumps(
            {
                "ts": self.ts,
                "req_id": self.req_id,
                "prompt_tokens": self.prompt_tokens,
                "block_hashes": list(self.block_hashes),
                "hit_tiers": list(self.hit_tiers),
                "decision": self.decision,
                "ttft_s": self.ttft_s,
                "ttft_breakdown_s": None if self.ttft_breakdown_s is None
                else {k: round(v, 7) for k, v in self.ttft_breakdown_s.items()},
                "num_prefill_steps": self.num_prefill_steps,
                "kv_load_s": {"read": round(self.load_read_s, 7),
                              "copy": round(self.load_copy_s, 7)},
                "prefill_step_tokens": self.prefill_step_tokens,
                "kv_plan": self.kv_plan,
            },
            separators=(",", ":"),
        )


class RequestLog:
    """Appends entries to ``path`` (created with its parent directory; appended to if it
    exists). Raises OSError at construction when the file cannot be opened."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh: IO[str] | None = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        self.num_written = 0

    def write(self, entry: RequestLogEntry) -> None:
        """Append one line and flush. A closed log ignores the entry."""
        if self._fh is None:
            return
        self._fh.write(entry.to_json() + "\n")
        self._fh.flush()
        self.num_written += 1

    def close(self) -> None:
        """Idempotent."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None
