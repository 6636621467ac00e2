"""How soon a new prompt is computed after it reaches a busy engine, with a tier below host
memory (the default `--kv-offload`: a host tier over LMDB) against a host tier alone.

With a lower tier, every arriving request gets a prefetch job (connectors/offload/prefetch.py):
its lookup runs off the step path, and the scheduler answers "not yet" while the job reads.
A new prompt has nothing below to read; the question is whether it still loses its arrival
step to the job's lookup. Per config, one engine (the embedded demo model, or ``--model``):
a long prompt keeps every step busy while new short prompts arrive, one every third step;
reported per config: the steps from a request's ``add_request`` to its first token (1: the
step it arrived in) and that time in ms (medians), and the ratio of the two configs. The
configs run in turns (A B, B A, ...), each on its own engine built once.

Prints JSON (also to ``--out``) and a one-line summary stating the machine.
Usage: python -m bench.arrival [--rounds 3] [--arrivals 12] [--model DIR] [--out F]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from typing import Any

from bench.common import emit_report, machine_info


def _config(root: str, lower: bool) -> str:
    path = os.path.join(root, f"{'lower' if lower else 'host'}.yaml")
    lines = ["tiers:", "  - {kind: host, capacity: 256MiB}"]
    if lower:
        lines.append(f"  - {{kind: lmdb, path: {root}/db, capacity: 2GiB}}")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return path


def _round(llm: Any, rng: random.Random, arrivals: int) -> tuple[list[int], list[float]]:
    """One busy period: (steps to first token, seconds to first token) per arriving prompt."""
    from engine.sampling_params import SamplingParams

    engine = llm.engine
    vocab = 400
    background = SamplingParams(temperature=0.0, max_tokens=4 * arrivals, ignore_eos=True)
    short = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tag = rng.randrange(1 << 30)
    engine.add_request(f"bg-{tag}", [rng.randrange(10, vocab) for _ in range(1500)], background)
    added: dict[str, tuple[int, float]] = {}
    steps: list[int] = []
    seconds: list[float] = []
    step = 0
    while engine.has_unfinished_requests():
        if step % 3 == 1 and len(added) < arrivals:
            rid = f"new-{tag}-{len(added)}"
            engine.add_request(rid, [rng.randrange(10, vocab) for _ in range(100)], short)
            added[rid] = (step, time.perf_counter())
        for out in engine.step():
            if out.req_id in added and len(out.token_ids) == 1:
                at_step, at = added[out.req_id]
                steps.append(step - at_step + 1)
                seconds.append(time.perf_counter() - at)
        step += 1
    return steps, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--arrivals", type=int, default=12)
    parser.add_argument("--model", default=None, help="HF dir (default: the demo model)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from engine.llm import LLM

    root = tempfile.mkdtemp(prefix="kvtier-arrival-")
    engines = {
        name: LLM(
            args.model,
            device="cpu",
            kv_offload_config=_config(root, lower),
            max_num_batched_tokens=512,
        )
        for name, lower in (("host_over_lmdb", True), ("host_only", False))
    }
    rng = random.Random(0)
    got: dict[str, dict[str, list[float]]] = {n: {"steps": [], "ms": []} for n in engines}
    order = list(engines)
    for r in range(args.rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            steps, seconds = _round(engines[name], rng, args.arrivals)
            got[name]["steps"] += steps
            got[name]["ms"] += [s * 1e3 for s in seconds]
    for llm in engines.values():
        llm.close()
    medians = {
        n: {
            "steps_to_first_token": statistics.median(v["steps"]),
            "ttft_ms": statistics.median(v["ms"]),
            "requests": len(v["ms"]),
        }
        for n, v in got.items()
    }
    ratio = medians["host_over_lmdb"]["ttft_ms"] / medians["host_only"]["ttft_ms"]
    m = machine_info()
    summary = (
        "arrival under load: host over LMDB {a[steps_to_first_token]:g} step(s), "
        "{a[ttft_ms]:.1f} ms to the first token; host alone {b[steps_to_first_token]:g}, "
        "{b[ttft_ms]:.1f} ms ({r:.2f}x) | {n} rounds x {k} arrivals, medians, {cpu} x{c}"
    ).format(
        a=medians["host_over_lmdb"],
        b=medians["host_only"],
        r=ratio,
        n=args.rounds,
        k=args.arrivals,
        cpu=m["cpu_model"],
        c=m["cpu_count"],
    )
    report = {
        "bench": "arrival",
        "machine": m,
        "model": args.model or "demo",
        "configs": medians,
        "ttft_ratio_lower_over_host_only": ratio,
        "summary": summary,
    }
    emit_report(report, args.out)


if __name__ == "__main__":
    main()
