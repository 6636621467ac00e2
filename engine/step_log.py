"""The engine's JSONL step log (``kvtier serve --step-log FILE``): one line per engine step.

The request log (``--request-log``) says where each request's TTFT went; this one says what
each step carried, so that a request's slow step can be read against what ran beside it and
before it (which prompt chunks, how many decodes, which loads finished, how long the runner's
parts took). One line:

    {"t": 1796474503.4512, "ms": 31.52, "tokens": 418, "decodes": 3,
     "prefill": [["chatcmpl-...-0", 209, 6272, true], ...],
     "parts": {"inputs": 1.4, "hook": 2.4, "forward": 15.2, ...},
     "loads": [["chatcmpl-...-0", 10.1, true]], "waiting": 0, "running": 5, "gc": [12.3, 2]}

``t``: wall-clock start (the request log's ``ts`` clock); ``ms``: the step's wall time;
``tokens``: tokens computed; ``decodes``: requests that fed one sampled token; ``prefill``:
each prompt chunk as [request id, tokens, tokens already computed, samples its first token];
``parts``: the runner's ``step_parts`` in ms (engine/ttft.py ``STEP_PARTS``); ``loads``: the KV
loads that finished in the step as [request id, copy ms, in-step]; ``waiting`` / ``running``:
the scheduler's queues after the step was scheduled; ``gc`` (only when some ran): the ms of
the process's garbage collections that started during the step and the oldest generation
among them (``engine.gc_clock``: a collection on the engine thread stalls the step, and
nothing else in the line would say so). Empty steps are not written.

Lines are buffered and flushed every ``FLUSH_LINES`` and at close (a crash may lose the last
few): a decode step every few ms must not pay a flush each. Not thread-safe: the engine thread
writes it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO

from engine.core_types import ModelRunnerOutput, SchedulerOutput
from engine.gc_clock import GcClock

FLUSH_LINES = 64


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


class StepLog:
    """Appends one line per step to ``path`` (created with its parent directory). Raises
    OSError at construction when the file cannot be opened."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh: IO[str] | None = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        self._pending = 0
        self.num_written = 0
        self._gc = GcClock()

    def write(
        self,
        wall_start: float,
        seconds: float,
        out: SchedulerOutput,
        runner_out: ModelRunnerOutput,
        num_waiting: int,
        num_running: int,
    ) -> None:
        """One step: scheduled as ``out``, run in ``seconds`` from ``wall_start``. Ignored once
        closed."""
        if self._fh is None:
            return
        gc_seconds, gc_generation = self._gc.take(wall_start)
        if out.is_empty:
            return
        prefill = []
        decodes = 0
        for sliced in out.requests:
            if sliced.num_output_tokens > 0 and len(sliced.token_ids) == 1:
                decodes += 1
            else:
                prefill.append(
                    [
                        sliced.req_id,
                        len(sliced.token_ids),
                        sliced.num_computed_tokens,
                        sliced.sample,
                    ]
                )
        kv = runner_out.kv_connector_output
        loads = [
            [t.req_id, _ms(t.copy_s), t.in_step]
            for t in (kv.load_timings if kv is not None else ())
        ]
        line = {
            "t": round(wall_start, 4),
            "ms": _ms(seconds),
            "tokens": out.num_batched_tokens,
            "decodes": decodes,
            "prefill": prefill,
            "parts": {k: _ms(v) for k, v in runner_out.step_parts.items()},
            "loads": loads,
            "waiting": num_waiting,
            "running": num_running,
        }
        if gc_generation >= 0:
            line["gc"] = [_ms(gc_seconds), gc_generation]
        self._fh.write(json.dumps(line, separators=(",", ":")) + "\n")
        self.num_written += 1
        self._pending += 1
        if self._pending >= FLUSH_LINES:
            self._fh.flush()
            self._pending = 0

    def close(self) -> None:
        """Flushes and closes; idempotent."""
        self._gc.close()
        if self._fh is not None:
            self._fh.close()
            self._fh = None
