"""Does a prefill step of a token count the process has not run before cost more? (CUDA diagnostics)

    python -m bench.new_shapes [--variants default,eager,warm] [--counts 24] [--out FILE]

The twenty-fifth session's QA run (docs/scheduling.md) showed prefill steps whose forward took
22-40 ms to launch where the same shape of step took 11-13: every one of them had a total token
count the engine had not run before, and no step with a count seen before stalled. This bench
runs the engine's model (Llama-3-8B shape, random bf16 weights, ``ModelRunner``) in a fresh
process per variant and, for ``--counts`` token counts in 150-520, runs one prefill step of the
count (new) and then another of the same count (seen), each right after a ~10 ms host-to-device
copy queued on a side stream (the in-step load's place): a step that synchronizes the device
while launching waits for that copy. Per step: the forward's launch time and the thread's CPU
time in it (``step_parts``), the step's wall time, and the caching allocator's counters
(cudaMalloc / cudaFree calls, retries). Then one new-count step under torch.profiler: the CUDA
runtime calls by CPU time (a module load, a cudaFree or a synchronization shows there).

Variants (each its own process, set before CUDA starts): ``default``; ``eager``
(``CUDA_MODULE_LOADING=EAGER``: every kernel loaded at start, none on first use);
``expandable`` (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``); ``warm``: the runner's
GEMM warm-up at build (``gemm_warmup``, engine/runner/gemm_warmup.py; the other variants build
without it).

Prints JSON and a one-line summary. A measurement tool, not a target.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from typing import Any

VARIANT_ENV = {
    "default": {},
    "eager": {"CUDA_MODULE_LOADING": "EAGER"},
    "expandable": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    "warm": {},
    "smoke": {},
    "smokewarm": {},
}
STATS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")


def _measure(variant: str, num_counts: int, seed: int) -> dict[str, Any]:
    import torch

    from bench.common import machine_info, random_weight_model
    from bench.engine import MAX_LEN, SHAPES, EngineDriver, random_prompts
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.core_types import ScheduledRequest, SchedulerOutput
    from engine.models import ModelArchConfig
    from engine.models.loader import LoadedModel
    from engine.runner.model_runner import ModelRunner
    from engine.sampling_params import SamplingParams

    t_start = time.perf_counter()
    smoke = variant.startswith("smoke")  # a CPU check of this script on a tiny shape
    cuda = not smoke
    device = torch.device("cuda" if cuda else "cpu")
    cfg_shape = dict(SHAPES["llama3-8b"])
    if smoke:
        cfg_shape.update(
            hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=1000,
        )  # fmt: skip
    dtype = torch.bfloat16 if cuda else torch.float32
    arch = ModelArchConfig.from_hf(cfg_shape)
    model = random_weight_model(arch, dtype, device, MAX_LEN)
    loaded = LoadedModel(model=model, arch=arch, dtype=dtype, hf_config=cfg_shape)
    cfg = EngineConfig(
        dtype="bfloat16" if cuda else "float32",
        device=device.type,
        attention_backend="flashinfer" if cuda else "torch",
        cache=CacheConfig(num_gpu_blocks=1200 if cuda else 64),
        scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=16, max_model_len=8192),
        gemm_warmup=variant.endswith("warm"),
    )
    runner = ModelRunner.from_loaded(cfg, loaded, "new-shapes-llama3-8b")
    res: dict[str, Any] = {"variant": variant, "env": VARIANT_ENV[variant]}
    res["build_s"] = round(time.perf_counter() - t_start, 1)
    drv = EngineDriver(runner)
    vocab = runner.vocab_size
    tables = drv.tables(1, 1024)
    # a pending copy on a side stream before each step, ~10 ms (the in-step load's place)
    side = torch.cuda.Stream() if cuda else None
    host = torch.empty((512 << 20) if cuda else 1024, dtype=torch.uint8, pin_memory=cuda)
    dev = torch.empty_like(host, device=device)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def stats() -> dict[str, int]:
        return torch.cuda.memory_stats(device) if cuda else {}

    def side_copy() -> None:
        if side is not None:
            with torch.cuda.stream(side):
                dev.copy_(host, non_blocking=True)

    step_no = [0]
    greedy = SamplingParams(temperature=0.0, max_tokens=1)

    def step(n: int, copy: bool = True) -> dict[str, Any]:
        step_no[0] += 1
        prompt = random_prompts(1, n, vocab, 1000 + step_no[0])
        sync()
        before = stats()
        if copy:
            side_copy()
        t0 = time.perf_counter()
        req = ScheduledRequest(f"s{step_no[0]}", prompt[0], 0, tables[0], True, greedy)
        out = runner.execute_model(SchedulerOutput([req], n))
        wall = time.perf_counter() - t0
        sync()
        after = stats()
        runner.execute_model(SchedulerOutput([], 0, frozenset({f"s{step_no[0]}"})))
        parts = out.step_parts
        row = {
            "n": n,
            "forward_ms": round(parts["forward"] * 1e3, 2),
            "forward_cpu_ms": round(parts["forward_cpu"] * 1e3, 2),
            "wall_ms": round(wall * 1e3, 2),
        }
        for k in STATS:
            row[k] = after.get(k, 0) - before.get(k, 0)
        return row

    # the copy alone, for scale
    sync()
    t0 = time.perf_counter()
    side_copy()
    sync()
    res["side_copy_ms"] = round((time.perf_counter() - t0) * 1e3, 2)
    for n in (256, 512, 256, 512):
        step(n, copy=False)
    if variant.endswith("warm"):  # ModelRunner ran it at build (config gemm_warmup)
        res["warm"] = runner.gemm_warmup
        res["warm_s"] = (runner.gemm_warmup or {}).get("s")
    rng = random.Random(seed)
    counts = rng.sample([c for c in range(150, 521) if c not in (256, 512)], num_counts)
    rows = []
    for n in counts:
        rows.append({"kind": "new", **step(n)})
        rows.append({"kind": "seen", **step(n)})
    res["steps"] = rows
    for kind in ("new", "seen"):
        fw = [r["forward_ms"] for r in rows if r["kind"] == kind]
        res[kind] = {
            "forward_ms_p50": round(statistics.median(fw), 2),
            "forward_ms_max": round(max(fw), 2),
            "wall_ms_p50": round(
                statistics.median([r["wall_ms"] for r in rows if r["kind"] == kind]), 2
            ),
            **{k: sum(r[k] for r in rows if r["kind"] == kind) for k in STATS},
        }
    seen_p50 = res["seen"]["forward_ms_p50"]
    res["new"]["stalled"] = sum(
        1 for r in rows if r["kind"] == "new" and r["forward_ms"] > 1.5 * seen_p50
    )
    res["seen"]["stalled"] = sum(
        1 for r in rows if r["kind"] == "seen" and r["forward_ms"] > 1.5 * seen_p50
    )
    # one new count under the profiler: the runtime calls by CPU time
    from torch.profiler import ProfilerActivity, profile

    fresh = 521  # above every measured count: new to the process
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        res["profiled_step"] = step(fresh)
    calls = []
    for ev in prof.key_averages():
        cpu_us = getattr(ev, "cpu_time_total", 0)
        if cpu_us >= 300:
            calls.append({"name": ev.key[:80], "count": ev.count, "cpu_ms": round(cpu_us / 1e3, 2)})
    calls.sort(key=lambda r: -r["cpu_ms"])
    res["profiled_calls"] = calls[:30]
    res["machine"] = machine_info()
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="default,eager,warm")
    ap.add_argument("--counts", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds per variant")
    ap.add_argument("--out", default="")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(_measure(args.child, args.counts, args.seed)))
        return 0
    results: dict[str, Any] = {}
    for variant in args.variants.split(","):
        env = {**os.environ, **VARIANT_ENV[variant]}
        cmd = [sys.executable, "-m", "bench.new_shapes", "--child", variant]
        cmd += ["--counts", str(args.counts), "--seed", str(args.seed)]
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            results[variant] = {"error": f"timed out after {args.timeout} s"}
            continue
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        if p.returncode != 0 or not lines:
            results[variant] = {"error": f"rc {p.returncode}: {p.stderr.strip()[-1500:]}"}
            continue
        results[variant] = json.loads(lines[-1])
    text = json.dumps(results, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        print(text)
    parts = []
    for v, r in results.items():
        if "error" in r:
            parts.append(f"{v}: {r['error'][:200]}")
            continue
        new, seen = r["new"], r["seen"]
        parts.append(
            f"{v}: forward new p50 {new['forward_ms_p50']} (max {new['forward_ms_max']}, "
            f"{new['stalled']} of {args.counts} stalled) / seen {seen['forward_ms_p50']} "
            f"({seen['stalled']} stalled); cudaMalloc new {new['num_device_alloc']} seen "
            f"{seen['num_device_alloc']}, cudaFree {new['num_device_free']}/{seen['num_device_free']}, "
            f"retries {new['num_alloc_retries']}; side copy {r['side_copy_ms']} ms; build {r['build_s']} s"
        )
    print("new_shapes: " + " | ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
