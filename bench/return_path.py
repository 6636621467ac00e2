"""From the engine core's first-token stamp to the request's coroutine in the API process.

``kvtier serve`` runs the engine core in a process of its own; each step's outputs cross ZMQ to
the API's output thread, which detokenizes them and hands each to its request's coroutine on
the event loop. That hop is the TTFT breakdown's ``return`` phase less the HTTP write, and a
first token that lands in a step with many decoding streams waits for their handling too.

The core (the tiny random Llama on CPU, one thread) decodes ``--streams`` long requests; short
ones (2 tokens) are sent one after another beside them, and for each the time from the core's
``first_token_time`` to (a) the API's output thread receiving the step and (b) the request's
coroutine receiving the output is recorded (both ``time.monotonic()``, one clock per host).

Prints JSON (p50 / p90 of both, the machine) and a one-line summary.

    python -m bench.return_path [--streams 8] [--requests 60] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from typing import Any

from bench.common import emit_report, machine_info, percentile


def measure(streams: int, requests: int) -> dict[str, list[float]]:
    from engine import SamplingParams
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.core.client import CoreProcConfig, EngineCoreClient
    from tests.engine.hf_models import make_tiny_model

    model = make_tiny_model(tempfile.mkdtemp(prefix="return-path-"), "llama", seed=3)
    config = EngineConfig(
        model=model,
        device="cpu",
        cache=CacheConfig(num_gpu_blocks=256),
        scheduler=SchedulerConfig(max_model_len=512),
    )
    engine = EngineCoreClient.start(config, CoreProcConfig(num_threads=1))
    received: dict[str, tuple[float, float | None]] = {}  # req id -> output thread's time
    handle = engine._handle

    def stamped(event: Any) -> None:
        now = time.monotonic()
        for output in getattr(event, "outputs", ()):
            received.setdefault(output.req_id, (now, output.first_token_time))
        handle(event)

    engine._handle = stamped  # type: ignore[method-assign]
    out: dict[str, list[float]] = {"to_output_thread_ms": [], "to_coroutine_ms": []}

    async def one(i: int, max_tokens: int, record: bool) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        req_id = f"r{i}-{max_tokens}"
        async for output in engine.generate([1, *range(5 + i, 60 + i)], params, req_id):
            first = output.metrics.first_token_time if output.metrics else None
            if record and first is not None and output.carries_first_token:
                at_thread, core_first = received[req_id]
                out["to_coroutine_ms"].append((time.monotonic() - first) * 1e3)
                out["to_output_thread_ms"].append((at_thread - (core_first or first)) * 1e3)

    async def run() -> None:
        background = [asyncio.create_task(one(i, 400, False)) for i in range(streams)]
        await asyncio.sleep(0.5)
        for k in range(requests):
            await one(100 + k, 2, True)
            await asyncio.sleep(0.01)
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=8, help="requests decoding meanwhile")
    ap.add_argument("--requests", type=int, default=60, help="short requests timed")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    times = measure(args.streams, args.requests)
    stats = {}
    for name, values in times.items():
        values.sort()
        stats[name] = {
            "p50": round(statistics.median(values), 3),
            "p90": round(percentile(values, 90), 3),
            "n": len(values),
        }
    report = {
        "machine": machine_info(),
        "streams": args.streams,
        "ms": stats,
        "summary": (
            f"return_path ({args.streams} streams decoding): core first token -> API output "
            f"thread p50 {stats['to_output_thread_ms']['p50']:.2f} ms, -> the request's "
            f"coroutine p50 {stats['to_coroutine_ms']['p50']:.2f} ms "
            f"(p90 {stats['to_coroutine_ms']['p90']:.2f})"
        ),
    }
    emit_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
