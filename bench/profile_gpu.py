"""Where a decode step and a host-tier reload spend their time, on a CUDA host (diagnostics).

    python -m bench.profile_gpu [--sections decode,reload,mixed] [--out FILE] [--length 16384]
        [--suffix 224 --decoders 8 --pair 2]

- ``decode`` (Llama-3-8B shape, random bf16 weights, batch 1 after a 512-token prompt):
  the engine step (``ModelRunner.execute_model``), the decode graph's replay alone (GPU time
  of back-to-back replays), the host time before the replay is launched, a per-kernel table of
  one replay (torch.profiler), and the bandwidth of each weight's matrix-vector product (M=1)
  against the bytes it reads.
- ``reload``: an in-step host reload of a ``--length`` prefix (+16 tokens), through the engine
  (``LLM``): wall time per step, a cProfile of the reload step (top cumulative Python
  functions) and torch.profiler's CPU-side view of it (synchronizations and copies).
- ``mixed``: the QA run's reused step: ``--pair`` requests whose ``--length``-token prefixes
  sit in the host tier only arrive together (``--suffix`` new tokens each) while ``--decoders``
  requests decode; then the pair alone, and one alone. Step times and batch sizes, each
  request's TTFT and breakdown, and the kernels of one mixed arrival.

Prints JSON and a one-line summary. A measurement tool, not a target: bench/engine.py and
bench/offload/main.py hold the targets.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

from bench.common import machine_info


def _kernel_table(prof: Any, reps: int, top: int = 18) -> list[dict[str, Any]]:
    rows = []
    for ev in prof.key_averages():
        dev_us = getattr(ev, "self_device_time_total", 0) or getattr(ev, "self_cuda_time_total", 0)
        if dev_us <= 0 or ev.key.startswith("cuda"):
            continue
        rows.append(
            {
                "kernel": ev.key[:90],
                "calls_per_rep": ev.count / reps,
                "us_per_rep": round(dev_us / reps, 1),
            }
        )
    rows.sort(key=lambda r: -r["us_per_rep"])
    return rows[:top]


def _cpu_table(prof: Any, names: tuple[str, ...]) -> dict[str, Any]:
    out = {}
    for ev in prof.key_averages():
        if any(n in ev.key for n in names):
            out[ev.key[:60]] = {"count": ev.count, "cpu_ms": round(ev.cpu_time_total / 1e3, 2)}
    return out


def profile_decode(quick: bool) -> dict[str, Any]:
    from bench.engine import EngineDriver, build_models, decode_ms_per_step, random_prompts
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.runner.model_runner import ModelRunner

    device = torch.device("cuda")
    loaded, hf = build_models("llama3-8b", device)
    del hf
    cfg = EngineConfig(
        dtype="bfloat16",
        device="cuda",
        attention_backend="flashinfer",
        cache=CacheConfig(num_gpu_blocks=2048),
        scheduler=SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=8, max_model_len=8192),
    )
    runner = ModelRunner.from_loaded(cfg, loaded, "profile-llama3-8b")
    drv = EngineDriver(runner)
    res: dict[str, Any] = {"fused_kernels": runner.fused_kernels}
    prompt = random_prompts(1, 512, runner.vocab_size, 5)
    tables = drv.tables(1, 512 + 512)
    first = drv.prefill(prompt, tables, "pd")
    seqs = {rid: prompt[0] + [tok] for rid, tok in first.items()}
    drv.decode(seqs, tables, 8)
    steps = 32 if quick else 64

    # 1. the engine step
    res["step_ms"] = round(decode_ms_per_step(drv, seqs, tables, steps), 3)

    # 2. host time before the replay is launched, and the replay call itself
    graphs = runner.cuda_graphs
    g = graphs._graphs[1]
    marks: list[float] = []
    real_replay = g.graph.replay

    def replay() -> None:
        marks.append(time.perf_counter())
        real_replay()
        marks.append(time.perf_counter())

    g.graph.replay = replay
    real_exec = runner.execute_model
    starts: list[float] = []
    ends: list[float] = []

    def execute(*a: Any, **kw: Any) -> Any:
        starts.append(time.perf_counter())
        try:
            return real_exec(*a, **kw)
        finally:
            ends.append(time.perf_counter())

    runner.execute_model = execute
    try:
        drv.decode(seqs, tables, steps)
    finally:
        g.graph.replay = real_replay
        del runner.execute_model
    pre = [marks[2 * i] - starts[i] for i in range(len(starts))]
    post = [ends[i] - marks[2 * i + 1] for i in range(len(starts))]
    gaps = [starts[i + 1] - ends[i] for i in range(len(starts) - 1)]
    res["host_before_replay_ms"] = round(statistics.median(pre) * 1e3, 3)
    res["replay_call_ms"] = round(
        statistics.median([marks[2 * i + 1] - marks[2 * i] for i in range(len(starts))]) * 1e3, 3
    )
    res["after_replay_to_return_ms"] = round(statistics.median(post) * 1e3, 3)
    res["between_steps_ms"] = round(statistics.median(gaps) * 1e3, 3)

    # 2b. where the host time of a step goes: cProfile of the same steps (inflated by the
    # profiler's own overhead; read it for proportions), top functions by own time
    pr = cProfile.Profile()
    pr.enable()
    drv.decode(seqs, tables, steps)
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
    res["host_cprofile_steps"] = steps
    res["host_cprofile"] = "\n".join(line[:150] for line in s.getvalue().splitlines()[:45])

    # 3. replay alone on the GPU (back to back, no host work in between)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(5):
        g.graph.replay()
    torch.cuda.synchronize()
    start.record()
    for _ in range(steps):
        g.graph.replay()
    end.record()
    torch.cuda.synchronize()
    res["replay_gpu_ms"] = round(start.elapsed_time(end) / steps, 3)
    hidden = g.hidden[:1]
    with torch.inference_mode():
        start.record()
        for _ in range(steps):
            runner.model.compute_logits(hidden).argmax(-1)
        end.record()
    torch.cuda.synchronize()
    res["logits_argmax_gpu_ms"] = round(start.elapsed_time(end) / steps, 3)

    # 4. kernels of one replay
    from torch.profiler import ProfilerActivity, profile

    reps = 5
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            g.graph.replay()
        torch.cuda.synchronize()
    table = _kernel_table(prof, reps, top=25)
    res["replay_kernels"] = table
    res["replay_kernel_sum_us"] = round(
        sum(r["us_per_rep"] for r in _kernel_table(prof, reps, 10**6)), 1
    )

    # 5. matrix-vector bandwidth per weight (M=1), against bytes read
    layer = runner.model.model.layers[0]
    weights = {
        "qkv": layer.self_attn.qkv_proj.weight,
        "o": layer.self_attn.o_proj.weight,
        "gate_up": layer.mlp.gate_up_proj.weight if hasattr(layer.mlp, "gate_up_proj") else None,
        "down": layer.mlp.down_proj.weight if hasattr(layer.mlp, "down_proj") else None,
        "lm_head": runner.model.lm_head.weight,
    }
    gemv = {}
    for name, w in weights.items():
        if w is None:
            continue
        x = torch.randn(1, w.shape[1], dtype=w.dtype, device=device)
        with torch.inference_mode():
            for _ in range(5):
                torch.nn.functional.linear(x, w)
            torch.cuda.synchronize()
            start.record()
            for _ in range(50):
                torch.nn.functional.linear(x, w)
            end.record()
        torch.cuda.synchronize()
        us = start.elapsed_time(end) / 50 * 1e3
        gemv[name] = {
            "shape": list(w.shape),
            "us": round(us, 1),
            "GB_s": round(w.numel() * w.element_size() / us / 1e3, 0),
        }
    res["gemv_m1"] = gemv
    n_bytes = sum(
        p.numel() * p.element_size()
        for n, p in runner.model.named_parameters()
        if "embed_tokens" not in n
    )
    res["weight_bytes_read_per_step_gb"] = round(n_bytes / 1e9, 2)
    res["hbm_floor_ms_at_4_8_tb_s"] = round(n_bytes / 4.8e12 * 1e3, 3)
    del runner, loaded
    torch.cuda.empty_cache()
    return res


def profile_reload(length: int) -> dict[str, Any]:
    from bench.offload.main import GREEDY1, _prefix_in_tiers_only
    from bench.offload.parts import (
        build_setup,
        close_llm,
        first_token_steps,
        make_llm,
        random_tokens,
        run_requests,
    )

    workdir = tempfile.mkdtemp(prefix="kvtier-prof-")
    setup = build_setup("full", workdir)
    offload = {
        "decision": "load",
        "calibrate": False,
        "in_step_host_loads": True,
        "tiers": [{"kind": "host", "capacity": f"{setup.host_capacity}B"}],
    }
    rng = random.Random(9)
    llm = make_llm(setup, (length + 64) // 16 + 4, offload)
    res: dict[str, Any] = {"length": length}
    try:
        run_requests(llm, [random_tokens(rng, 64)], GREEDY1, setup.request_timeout_s)
        plain = []
        for _ in range(2):
            prefix = _prefix_in_tiers_only(llm, rng, length, setup)
            f = first_token_steps(llm, prefix + random_tokens(rng, 16), setup.request_timeout_s)
            plain.append(
                {
                    "ttft_ms": round(f.ttft_s * 1e3, 2),
                    "steps": f.steps,
                    "step_ms": [round(x, 2) for x in f.step_ms],
                    "schedule_ms": round(f.schedule_ms, 2),
                    "load_ms": round(f.load_ms, 2),
                    "execute_ms": round(f.execute_ms, 2),
                    "cached": f.cached_tokens,
                }
            )
        res["plain"] = plain
        # A full-context prefill of 16 new tokens with the prefix already in the GPU cache:
        # the forward pass the reload step cannot avoid.
        prefix = random_tokens(rng, length)
        run_requests(llm, [prefix + random_tokens(rng, 16)], GREEDY1, setup.request_timeout_s)
        f = first_token_steps(llm, prefix + random_tokens(rng, 16), setup.request_timeout_s)
        res["gpu_hit_same_shape"] = {
            "ttft_ms": round(f.ttft_s * 1e3, 2),
            "steps": f.steps,
            "execute_ms": round(f.execute_ms, 2),
            "cached": f.cached_tokens,
        }
        # cProfile of one reload
        prefix = _prefix_in_tiers_only(llm, rng, length, setup)
        prompt = prefix + random_tokens(rng, 16)
        pr = cProfile.Profile()
        pr.enable()
        f = first_token_steps(llm, prompt, setup.request_timeout_s)
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(45)
        res["cprofile_ttft_ms"] = round(f.ttft_s * 1e3, 2)
        res["cprofile"] = "\n".join(line[:150] for line in s.getvalue().splitlines()[:80])
        # torch.profiler: syncs and copies on the host side of one reload
        from torch.profiler import ProfilerActivity, profile

        prefix = _prefix_in_tiers_only(llm, rng, length, setup)
        prompt = prefix + random_tokens(rng, 16)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            f = first_token_steps(llm, prompt, setup.request_timeout_s)
            torch.cuda.synchronize()
        res["torchprof_ttft_ms"] = round(f.ttft_s * 1e3, 2)
        res["cpu_calls"] = _cpu_table(
            prof,
            (
                "Synchronize",
                "cudaMemcpy",
                "cudaLaunchKernel",
                "cudaGraphLaunch",
                "aten::copy_",
                "pin_memory",
                "cudaHostAlloc",
                "cudaEventQuery",
                "cudaStreamWait",
            ),
        )
        res["kernels"] = _kernel_table(prof, 1, top=15)
    finally:
        close_llm(llm)
    return res


def _step_until_first_tokens(eng: Any, rids: set[str], timeout_s: float) -> dict[str, Any]:
    """Step ``eng`` until every request in ``rids`` has its first token: each step's wall time,
    batch size and the model runner's parts (ms: ``engine.ttft`` STEP_PARTS and the CPU and
    sub-parts beside them; forward_cpu equal to forward is a thread held in its launches),
    and each request's TTFT and breakdown (ms)."""
    steps: list[dict[str, Any]] = []
    sched = eng.scheduler
    seen: dict[str, Any] = {}
    last: list[Any] = [None]
    parts: list[dict[str, float]] = [{}]
    schedule = sched.schedule
    runner = eng.runner
    execute = runner.execute_model

    def scheduled() -> Any:
        last[0] = schedule()
        return last[0]

    def executed(*args: Any, **kwargs: Any) -> Any:
        out = execute(*args, **kwargs)
        parts[0] = dict(getattr(out, "step_parts", None) or {})
        return out

    sched.schedule = scheduled  # this call only
    runner.execute_model = executed
    t0 = time.perf_counter()
    try:
        while len(seen) < len(rids):
            s0 = time.perf_counter()
            parts[0] = {}
            outs = eng.step()
            wall = time.perf_counter() - s0
            tokens = getattr(last[0], "num_batched_tokens", None)
            row: dict[str, Any] = {"ms": round(wall * 1e3, 2), "tokens": tokens}
            if parts[0]:
                row["parts_ms"] = {k: round(v * 1e3, 2) for k, v in parts[0].items()}
            steps.append(row)
            _first_tokens(outs, rids, seen)
            if time.perf_counter() - t0 > timeout_s:
                raise RuntimeError(f"no first tokens after {len(steps)} steps")
    finally:
        del sched.schedule  # the class's method again
        del runner.execute_model
    return {"steps": steps, "requests": list(seen.values())}


def _first_tokens(outs: list[Any], rids: set[str], seen: dict[str, Any]) -> None:
    for o in outs:
        if o.req_id in rids and o.req_id not in seen:
            m = o.metrics
            seen[o.req_id] = {
                "ttft_ms": round((m.ttft_s or 0.0) * 1e3, 2),
                "cached": o.num_cached_tokens,
                "breakdown_ms": {
                    k: round(v * 1e3, 2) for k, v in (m.ttft_breakdown or {}).items() if v
                },
            }


def profile_mixed(
    length: int,
    suffix: int,
    decoders: int,
    pair: int,
    mode: str = "full",
    layered: bool = False,
    in_step_per_step: int | None = None,
    coalesced: bool = False,
    issue_ahead: int = 0,
    layer_path: str = "staged",
) -> dict[str, Any]:
    """The QA run's reused step, reproduced: ``pair`` requests whose ``length``-token prefixes
    sit in the host tier only arrive together (``suffix`` new tokens each) while ``decoders``
    requests of the same length decode; then the same pair with nothing else running, and one
    request alone (bench.offload's lone reload). Step times, TTFTs and breakdowns, and the
    kernels of one mixed arrival. Every run's ``cached`` must equal ``length`` (the prefix was
    loaded, not recomputed) for its figures to mean anything. ``layered``: in-step loads land
    layer by layer (``layered_loads: true``), and the mixed arrival is also run with the layer
    copy kernel on a fixed number of looping programs. ``in_step_per_step``: the connector's
    ``in_step_loads_per_step`` (None: its default). ``coalesced``: ``coalesced_loads: true``
    (a run of consecutive host slots moves as one copy into device staging and one scatter, a
    few copy commands a load where per-block copies queue one a block). ``issue_ahead``:
    ``load_issue_ahead`` (the layer groups issued as the forward reaches them; 0: all first).
    ``layer_path``: how layer-wise loads move (``_force_layer_path``)."""
    from bench.offload.main import _prefix_in_tiers_only
    from bench.offload.parts import build_setup, bytes_per_block, close_llm, make_llm, random_tokens
    from engine.sampling_params import SamplingParams

    workdir = tempfile.mkdtemp(prefix="kvtier-prof-")
    setup = build_setup(mode, workdir)
    reps, variants = 3, (16, 32, 64)  # variants: the layer copy kernel's programs
    num_prefixes = pair * (reps + 1 + len(variants)) + 1
    per_req = (length + suffix + 512) // 16 + 2
    # The host tier holds every prefix the runs reload (all are written before the first
    # arrival) and the decoders' blocks, saved when they are aborted before the alone runs:
    # the bench's default 8 GiB held under half of the prefixes, and a tier without room for
    # the decoders' blocks lost the alone runs' prefixes to them.
    host_blocks = num_prefixes * (length // 16 + 2) + decoders * (per_req + 1000 // 16) + 64
    host_bytes = host_blocks * (bytes_per_block(setup) + (64 << 10))
    offload: dict[str, Any] = {"tiers": [{"kind": "host", "capacity": f"{host_bytes}B"}]}
    if layered:
        offload["layered_loads"] = True
    if in_step_per_step is not None:
        offload["in_step_loads_per_step"] = in_step_per_step
    if coalesced:
        offload["coalesced_loads"] = True
    if issue_ahead:
        offload["load_issue_ahead"] = issue_ahead
    blocks = per_req * (decoders + pair * (reps + 1 + len(variants)) + 2) + 64
    llm = make_llm(setup, blocks, offload)
    eng = llm.engine
    rng = random.Random(11)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    res: dict[str, Any] = {
        "length": length,
        "suffix": suffix,
        "decoders": decoders,
        "pair": pair,
        "layered": layered,
        "coalesced": coalesced,
        "issue_ahead": issue_ahead,
        "layer_path": layer_path,
        "in_step_loads_per_step": offload.get("in_step_loads_per_step", 0),
    }
    ids = iter(range(10**6))
    try:
        if layer_path != "staged":
            _force_layer_path(eng, layer_path)
        # every prefix the runs reload, each in the host tier only (needs an idle pool)
        groups = [
            [_prefix_in_tiers_only(llm, rng, length, setup) for _ in range(pair)]
            for _ in range(reps + 1 + len(variants))
        ]
        lone = _prefix_in_tiers_only(llm, rng, length, setup)
        long = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
        drs = {f"dec-{next(ids)}" for _ in range(decoders)}
        for rid in drs:
            eng.add_request(rid, random_tokens(rng, length), long)
        _step_until_first_tokens(eng, drs, setup.request_timeout_s)
        quiet = []
        for _ in range(8):
            s0 = time.perf_counter()
            eng.step()
            quiet.append((time.perf_counter() - s0) * 1e3)
        res["decode_step_ms"] = round(statistics.median(quiet), 2)

        def arrive(prefixes: list[list[int]]) -> dict[str, Any]:
            rids = set()
            for prefix in prefixes:
                rid = f"re-{next(ids)}"
                eng.add_request(rid, prefix + random_tokens(rng, suffix), one)
                rids.add(rid)
            return _step_until_first_tokens(eng, rids, setup.request_timeout_s)

        res["mixed"] = [arrive(g) for g in groups[: reps - 1]]
        from torch.profiler import ProfilerActivity, profile

        cuda = torch.cuda.is_available()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            res["mixed"].append(arrive(groups[reps - 1]))
            if cuda:
                torch.cuda.synchronize()
        res["mixed_kernels"] = _kernel_table(prof, 1, top=20)
        res["mixed_cpu"] = _cpu_table(
            prof, ("Synchronize", "cudaMemcpy", "cudaLaunchKernel", "aten::copy_", "plan")
        )
        copier = _host_copier(eng)
        if copier is not None and copier.layered and copier._words is not None:  # the kernel
            res["mixed_by_copy_programs"] = {}
            for v, g in zip(variants, groups[reps + 1 :], strict=True):
                copier.layer_copy_programs = v
                res["mixed_by_copy_programs"][str(v)] = arrive(g)
            copier.layer_copy_programs = 0
        for rid in drs:
            eng.abort_request(rid)
        while eng.has_unfinished_requests():
            eng.step()
        eng.flush_kv()  # the decoders' saves land now, not in the alone runs' steps
        res["alone_pair"] = arrive(groups[reps])
        res["alone_one"] = arrive([lone])
        runs = [*res["mixed"], *res.get("mixed_by_copy_programs", {}).values()]
        runs += [res["alone_pair"], res["alone_one"]]
        res["all_loaded"] = all(q["cached"] == length for r in runs for q in r["requests"])
    finally:
        close_llm(llm)
    return res


def _host_copier(eng: Any) -> Any | None:
    """The offload worker's host-tier copier (``SlabCopier``), None without one."""
    return getattr(getattr(eng.offload.worker, "_loader", None), "_copier", None)


def _force_layer_path(eng: Any, path: str) -> None:
    """Make the engine's layer-wise host loads take ``path`` (CUDA): ``driver``, one driver
    copy per block and group of layers; ``kernel``, the Triton kernel reading the pinned slab
    itself, one launch per layer (``engine.kernels.copy_layer_from_host``: kernel launches,
    not copy commands); the default, ``staged``, the 2-D copies through device staging. Raises
    ValueError where the path cannot run."""
    copier = _host_copier(eng)
    if copier is None or not copier.layered or not torch.cuda.is_available():
        raise ValueError(f"layer path {path}: no layer-wise CUDA copier")
    copier.staged_layers = False
    if path == "driver":
        if not copier._driver_layers:
            raise ValueError("layer path driver: no driver copies here")
    elif path == "kernel":
        kv = eng.runner.kv_cache
        copier._driver_layers = False
        copier._words = kv.tensor.reshape(kv.num_blocks, -1).view(torch.int32)
    else:
        raise ValueError(f"layer path {path!r}: staged, driver or kernel")


def _mixed_summary(m: dict[str, Any]) -> str:
    """One line: each run's TTFTs (the medians over repetitions of the first, second, ...
    request to get its token, and their mean) and its step."""
    if "error" in m:
        return f"mixed: {m['error']}"

    def med(runs: list[dict[str, Any]]) -> str:
        ranks = [sorted(q["ttft_ms"] for q in r["requests"]) for r in runs]
        by_rank = [statistics.median(x) for x in zip(*ranks, strict=False)]
        step = statistics.median(s["ms"] for r in runs for s in r["steps"])
        mean = statistics.fmean(by_rank)
        # the first step of each run (the loads' step): its launches' wall and CPU time
        first = [r["steps"][0].get("parts_ms", {}) for r in runs if r["steps"]]
        fwd = [(p["forward"], p["forward_cpu"], p["sample"]) for p in first if "forward" in p]
        launch = ""
        if fwd:
            f, c, smp = (statistics.median(x) for x in zip(*fwd, strict=True))
            launch = f", its forward {f:.1f} (cpu {c:.1f}) sample {smp:.1f}"
        return (
            f"TTFT {'/'.join(f'{t:.1f}' for t in by_rank)} ms (mean {mean:.1f}; step {step:.1f}"
            f"{launch})"
        )

    by = m.get("mixed_by_copy_programs", {})
    parts = [f"mixed {med(m['mixed'])}"]
    parts += [f"{k} programs {med([r])}" for k, r in by.items()]
    parts += [f"pair alone {med([m['alone_pair']])}", f"one alone {med([m['alone_one']])}"]
    return (
        f"mixed ({m['length']}+{m['suffix']}, {m['decoders']} decoding, layered "
        f"{m['layered']}, coalesced {m.get('coalesced', False)}, issue ahead "
        f"{m.get('issue_ahead', 0)}, layer path {m.get('layer_path', 'staged')}, in-step loads a step "
        f"{m.get('in_step_loads_per_step')}, decode step "
        f"{m['decode_step_ms']} ms): " + "; ".join(parts) + f"; all loaded {m['all_loaded']}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sections", default="decode,reload")
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--suffix", type=int, default=224, help="mixed: new tokens per request")
    ap.add_argument("--decoders", type=int, default=8, help="mixed: requests decoding meanwhile")
    ap.add_argument("--pair", type=int, default=2, help="mixed: requests arriving together")
    ap.add_argument("--setup", default="full", help="mixed: tiny runs anywhere (a smoke run)")
    ap.add_argument(
        "--layered", action="store_true", help="mixed: in-step loads land layer by layer"
    )
    ap.add_argument(
        "--coalesced", action="store_true", help="mixed: coalesced_loads (runs of slots whole)"
    )
    ap.add_argument(
        "--in-step-loads-per-step",
        type=int,
        help="mixed: the connector's in_step_loads_per_step (default: its own, 0)",
    )
    ap.add_argument(
        "--issue-ahead", type=int, default=0, help="mixed: load_issue_ahead (0: groups first)"
    )
    ap.add_argument(
        "--layer-path",
        default="staged",
        choices=("staged", "driver", "kernel"),
        help="mixed: how layer-wise loads move (staged 2-D copies, per-block driver copies, "
        "the Triton kernel)",
    )
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() and args.setup == "full":
        raise SystemExit("bench.profile_gpu needs CUDA (or --sections mixed --setup tiny)")
    res: dict[str, Any] = {"machine": machine_info(), "argv": sys.argv[1:]}
    for name in args.sections.split(","):
        t0 = time.perf_counter()
        try:
            if name == "decode":
                res[name] = profile_decode(args.quick)
            elif name == "mixed":
                res[name] = profile_mixed(
                    args.length,
                    args.suffix,
                    args.decoders,
                    args.pair,
                    args.setup,
                    args.layered,
                    args.in_step_loads_per_step,
                    args.coalesced,
                    args.issue_ahead,
                    args.layer_path,
                )
            else:
                res[name] = profile_reload(args.length)
        except Exception as exc:  # report and go on
            import traceback

            res[name] = {
                "error": f"{type(exc).__name__}: {exc}",
                "trace": traceback.format_exc()[-3000:],
            }
        res[name + "_s"] = round(time.perf_counter() - t0, 1)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)
    d = res.get("decode", {})
    r = res.get("reload", {})
    print(json.dumps(res, indent=1))
    if "mixed" in res:
        print(_mixed_summary(res["mixed"]))
        return 0
    print(
        f"decode b1: step {d.get('step_ms')} ms, replay {d.get('replay_gpu_ms')} ms, host before "
        f"replay {d.get('host_before_replay_ms')} ms | reload {r.get('length')}: "
        f"{[p['ttft_ms'] for p in r.get('plain', [])]} ms"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
