"""Serving benchmark: ``kvtier serve`` over HTTP, driven by concurrent streaming OpenAI-style
chat clients in the multi-round QA shape (vLLM production-stack's client), with KV offload off,
on, and on with ``compression: lossless``, one server per mode, in one run.

Usage: python -m bench.serving --model DIR [--modes off,offload,lossless] [--qps 0.5,1,2]
       [--duration-s 60] [--users 10] [--rounds 5] [--system-words 800] [--history-words 900]
       [--question-words 20] [--answer-len 100] [--num-gpu-blocks 1200] [--host-capacity 8GiB]
       [--max-model-len 8192] [--pool-histories N] [--quiet-batch 2] [--server-arg FLAG ...]
       [--log-dir DIR] [--out FILE]

Shape: ``--users`` sessions at a time, each a shared system prompt, its own history and
``--rounds`` rounds of a question and an ``--answer-len``-token answer (``ignore_eos``); a
finished session is replaced by a new user. Requests go out at ``--qps`` (one every 1/qps s,
to the session idle longest; a request waits while every session is busy, so the achieved qps
is reported too), for ``--duration-s`` per qps level; a comma list is a sweep. The servers all
start first; the modes are then driven one at a time (``--concurrent``: all at once), each
level with fresh users (new random words: no reuse across levels).

Per mode and qps: TTFT p50/p90/p99 (all requests, and rounds >= 2 alone: the reuse of a
history), inter-token latency, output tokens/s and requests/s, and from the server's request
log the engine-side TTFT and its breakdown (engine/ttft.py) per percentile, plus the client's
overhead over it (HTTP, SSE, the return path: client TTFT - engine TTFT - API phases). Words are
drawn from the demo tokenizer's corpus (~2.3 tokens each). JSON, then a one-line summary.

Pool pressure (``--pool-histories N``): the GPU pool is sized to hold about N histories (system
prompt + history + every round), so that the users' histories cannot all stay on the GPU and
the head of the queue waits for blocks. Each level reports the offered qps beside the processed
requests/s, and after the levels ``--quiet-batch`` fresh sessions run one round together with
nothing else waiting: their inter-token latency is the decode ITL of that batch on an idle
engine, the yardstick of the loaded ITL (``itl_vs_quiet``). The server's scheduler and lookup
counters (/metrics) are read after each level: scheduler ms per step, lookups per loaded block.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx

from bench import chat_load
from bench.common import emit_report, machine_info, metric_sums, percentile
from bench.soak import spawn_server, stop_server, wait_healthy
from engine.models.demo_model import _CORPUS
from engine.ttft import API_PHASES, ENGINE_PHASES

MODES = ("off", "offload", "lossless")
_WORDS = _CORPUS.split()
_QS = (50, 90, 99)


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


Record = chat_load.RequestRecord  # round is 1-based here


@dataclass(frozen=True, slots=True)
class Shape:
    users: int
    rounds: int
    system_words: int
    history_words: int
    question_words: int
    answer_len: int
    duration_s: float
    request_timeout_s: float = 600.0


async def stream_chat(
    http: httpx.AsyncClient,
    messages: list[dict[str, str]],
    answer_len: int,
    rec: Record,
    timeout_s: float,
) -> str:
    """One streaming chat request of ``messages`` (bench/chat_load.py fills ``rec``)."""
    body = {"messages": messages, "max_tokens": answer_len, "temperature": 0.0, "ignore_eos": True}
    return await chat_load.stream_chat(http, body, rec, timeout_s)


@dataclass(slots=True)
class _Session:
    user: int
    messages: list[dict[str, str]]
    rng: random.Random
    round: int = 0
    idle_since: float = 0.0
    busy: bool = False


async def drive(base_url: str, shape: Shape, qps: float, seed: int) -> dict[str, Any]:
    """Runs one qps level against one server; returns its records and wall time."""
    rng = random.Random(seed)
    system = words(rng, shape.system_words)
    records: list[Record] = []
    next_user = 0

    def new_session() -> _Session:
        nonlocal next_user
        user_rng = random.Random(seed * 100_003 + next_user)
        history = words(user_rng, shape.history_words)
        s = _Session(
            next_user,
            [{"role": "system", "content": f"{system}\n{history}"}],
            user_rng,
            idle_since=time.perf_counter(),
        )
        next_user += 1
        return s

    sessions = [new_session() for _ in range(shape.users)]
    idle = asyncio.Event()
    idle.set()
    tasks: set[asyncio.Task[None]] = set()
    t0 = time.perf_counter()

    async def one(http: httpx.AsyncClient, s: _Session) -> None:
        s.messages.append({"role": "user", "content": words(s.rng, shape.question_words)})
        rec = Record(s.user, s.round + 1, time.perf_counter() - t0)
        try:
            answer = await stream_chat(
                http, s.messages, shape.answer_len, rec, shape.request_timeout_s
            )
        except (httpx.HTTPError, json.JSONDecodeError) as exc:
            rec.error, answer = f"{type(exc).__name__}: {exc}"[:200], ""
        rec.end_s = time.perf_counter() - t0
        records.append(rec)
        s.messages.append({"role": "assistant", "content": answer})
        s.round += 1
        if s.round >= shape.rounds or not rec.ok:
            sessions[sessions.index(s)] = new_session()
        else:
            s.busy, s.idle_since = False, time.perf_counter()
        idle.set()

    limits = httpx.Limits(max_connections=shape.users + 4)
    async with httpx.AsyncClient(base_url=base_url, limits=limits) as http:
        tick = t0
        while time.perf_counter() - t0 < shape.duration_s:
            await asyncio.sleep(max(0.0, tick - time.perf_counter()))
            while True:
                ready = [s for s in sessions if not s.busy]
                if ready:
                    break
                idle.clear()
                await idle.wait()
            s = min(ready, key=lambda x: x.idle_since)
            s.busy = True
            task = asyncio.create_task(one(http, s))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            tick += 1.0 / qps
        sent_s = time.perf_counter() - t0
        if tasks:
            await asyncio.gather(*tasks)
    return {"records": records, "wall_s": time.perf_counter() - t0, "sent_s": sent_s}


async def quiet_itl(base_url: str, shape: Shape, batch: int, seed: int) -> dict[str, Any]:
    """``batch`` fresh sessions' first rounds at once, nothing else running: their ITL."""
    rng = random.Random(seed)
    system = words(rng, shape.system_words)
    recs = [Record(10_000 + i, 1, 0.0) for i in range(batch)]
    async with httpx.AsyncClient(base_url=base_url) as http:
        await asyncio.gather(
            *(
                stream_chat(
                    http,
                    [
                        {
                            "role": "system",
                            "content": f"{system}\n"
                            f"{words(random.Random(seed * 7 + i), shape.history_words)}",
                        },
                        {"role": "user", "content": words(rng, shape.question_words)},
                    ],
                    shape.answer_len,
                    rec,
                    shape.request_timeout_s,
                )
                for i, rec in enumerate(recs)
            )
        )
    # Steps where every request decodes: past the first gap (which may hold another's prefill).
    itl = [x for r in recs if r.ok for x in (r.itl_s[1:] or r.itl_s)]
    return {"batch": batch, "itl_ms": _pcts(itl), "failed": sum(not r.ok for r in recs)}


def server_counters(base_url: str) -> dict[str, float]:
    """The server's scheduler and lookup counters from /metrics (0 where absent)."""
    names = (
        "kvtier_scheduler_steps_total",
        "kvtier_scheduler_seconds_total",
        "kvtier_scheduler_blocked_skips_total",
        "kvtier_kv_lookup_blocks_total",
        "kvtier_kv_loaded_blocks_total",
        "kvtier_num_preemptions_total",
        "kvtier_scheduler_released_loads_total",
        "kvtier_scheduler_first_token_deferred_tokens_total",
    )
    try:
        text = httpx.get(f"{base_url}/metrics", timeout=30).text
    except httpx.HTTPError:
        return dict.fromkeys(names, 0.0)
    return metric_sums(text, names)


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    steps = d["kvtier_scheduler_steps_total"]
    loaded = d["kvtier_kv_loaded_blocks_total"]
    return {
        "scheduler_ms_per_step": round(1e3 * d["kvtier_scheduler_seconds_total"] / steps, 4)
        if steps
        else None,
        "steps": int(steps),
        "blocked_skips": int(d["kvtier_scheduler_blocked_skips_total"]),
        "lookups_per_loaded_block": round(d["kvtier_kv_lookup_blocks_total"] / loaded, 3)
        if loaded
        else None,
        "preemptions": int(d["kvtier_num_preemptions_total"]),
        "released_loads": int(d.get("kvtier_scheduler_released_loads_total", 0)),
        "first_token_deferred_tokens": int(d["kvtier_scheduler_first_token_deferred_tokens_total"]),
    }


def pool_blocks(shape: Shape, histories: int, tokens_per_word: float = 2.3) -> int:
    """GPU blocks holding about ``histories`` whole conversations (every round included)."""
    per_round = shape.question_words * tokens_per_word + shape.answer_len
    tokens = (shape.system_words + shape.history_words) * tokens_per_word + shape.rounds * per_round
    return max(int(histories * tokens / 16), 64)


def _pcts(values: list[float], scale: float = 1e3) -> dict[str, float | None]:
    s = sorted(values)
    return {f"p{q}": (round(percentile(s, q) * scale, 3) if s else None) for q in _QS}


def read_log(path: str, offset: int) -> tuple[dict[str, dict[str, Any]], int]:
    """Request-log entries appended since ``offset`` (by req_id), and the new offset."""
    if not os.path.exists(path):
        return {}, offset
    with open(path, encoding="utf-8") as f:
        f.seek(offset)
        text = f.read()
        end = f.tell()
    entries = {}
    for line in text.splitlines():
        if line.strip():
            row = json.loads(line)
            entries[row["req_id"]] = row
    return entries, end


def engine_side(records: list[Record], log: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The engine's TTFT and its phases per percentile, for the requests found in the log."""
    rows = [(r, log.get(f"{r.req_id}-0")) for r in records if r.ok]
    rows = [(r, e) for r, e in rows if e is not None and e.get("ttft_s") is not None]
    out: dict[str, Any] = {"matched": len(rows)}
    if not rows:
        return out
    out["ttft_ms"] = _pcts([e["ttft_s"] for _, e in rows])
    later = [e for r, e in rows if r.round >= 2]
    out["ttft_later_rounds_ms"] = _pcts([e["ttft_s"] for e in later])
    with_phases = [(r, e) for r, e in rows if e.get("ttft_breakdown_s")]
    phases: dict[str, Any] = {}
    for phase in (*API_PHASES, *ENGINE_PHASES):
        phases[phase] = _pcts([e["ttft_breakdown_s"].get(phase, 0.0) for _, e in with_phases])
    out["phases_ms"] = phases
    out["phases_later_rounds_p50_ms"] = {
        phase: _pcts(
            [e["ttft_breakdown_s"].get(phase, 0.0) for r, e in with_phases if r.round >= 2]
        )["p50"]
        for phase in (*API_PHASES, *ENGINE_PHASES)
    }
    overhead = []
    for r, e in with_phases:
        api = sum(e["ttft_breakdown_s"].get(p, 0.0) for p in API_PHASES)
        overhead.append(max(0.0, (r.ttft_s or 0.0) - e["ttft_s"] - api))
    out["client_overhead_ms"] = _pcts(overhead)
    out["prefill_steps_p50"] = percentile(
        sorted(e.get("num_prefill_steps", 0) for _, e in rows), 50
    )
    out["hit_blocks_p50"] = percentile(sorted(len(e.get("hit_tiers", [])) for _, e in rows), 50)
    return out


def summarize(run: dict[str, Any], qps: float, log: dict[str, dict[str, Any]]) -> dict[str, Any]:
    recs: list[Record] = run["records"]
    ok = [r for r in recs if r.ok]
    errors: dict[str, int] = {}
    for r in recs:
        if not r.ok:
            errors[r.error[:120]] = errors.get(r.error[:120], 0) + 1
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    later = [r.ttft_s for r in ok if r.ttft_s is not None and r.round >= 2]
    tokens = sum(r.completion_tokens for r in ok)
    return {
        "qps": qps,
        "requests": len(recs),
        "failed": len(recs) - len(ok),
        "errors": errors,
        "achieved_qps": round(len(recs) / max(run["sent_s"], 1e-9), 3),
        "wall_s": round(run["wall_s"], 2),
        "prompt_tokens_p50": percentile(sorted(r.prompt_tokens for r in ok), 50),
        "max_prompt_tokens": max((r.prompt_tokens for r in ok), default=0),
        "ttft_ms": _pcts(ttft),
        "ttft_later_rounds_ms": _pcts(later),
        "itl_ms": _pcts([x for r in ok for x in r.itl_s]),
        "output_tokens_per_s": round(tokens / max(run["wall_s"], 1e-9), 2),
        "requests_per_s": round(len(ok) / max(run["wall_s"], 1e-9), 3),
        "offered_qps": qps,
        "processed_req_per_s": round(len(ok) / max(run["wall_s"], 1e-9), 3),
        **steady_rates(recs),
        "engine": engine_side(ok, log),
    }


def steady_rates(recs: list[Record]) -> dict[str, float | None]:
    """The rate requests were sent and the rate they completed, each over the span between its
    first and last event ((n - 1) / span): in a finite run ``processed_req_per_s`` also pays
    the drain (the last request's whole latency) and so reads below the offered rate even when
    the engine keeps up; the completion rate falls below the send rate only when the engine
    falls behind (its completions spread out) or fails requests. None with fewer than 2."""
    sends = sorted(r.start_s for r in recs)
    ends = sorted(r.end_s for r in recs if r.ok and r.end_s is not None)

    def rate(ts: list[float]) -> float | None:
        return (
            round((len(ts) - 1) / (ts[-1] - ts[0]), 3) if len(ts) > 1 and ts[-1] > ts[0] else None
        )

    return {"send_rate_req_per_s": rate(sends), "completion_rate_req_per_s": rate(ends)}


def offload_config(mode: str, host_capacity: str, log_dir: str) -> list[str]:
    """The serve flags of ``mode``: a host tier of ``host_capacity`` (no disk tier, so the
    run measures the host link), with the lossless codec for ``lossless``."""
    if mode == "off":
        return []
    path = os.path.join(log_dir, f"serving_{mode}.yaml")
    with open(path, "w", encoding="utf-8") as f:
        f.write(
            f"compression: {'lossless' if mode == 'lossless' else 'none'}\n"
            f"tiers:\n  - {{kind: host, capacity: {host_capacity}}}\n"
        )
    return ["--kv-offload", "--kv-offload-config", path]


def best_qps(levels: list[dict[str, Any]], limit_ms: float = 1000.0) -> float | None:
    """The highest qps level whose TTFT p90 stayed under ``limit_ms`` with no failure."""
    good = [
        lv["qps"]
        for lv in levels
        if lv["failed"] == 0
        and lv["ttft_ms"]["p90"] is not None
        and lv["ttft_ms"]["p90"] < limit_ms
    ]
    return max(good) if good else None


def _level_line(lv: dict[str, Any]) -> str:
    """One level's figures, for the progress lines."""
    return (
        f"{lv['requests']} requests ({lv['failed']} failed) in {lv['wall_s']} s, "
        f"{lv['processed_req_per_s']} req/s processed (offered {lv['offered_qps']:g}), TTFT p50 "
        f"{lv['ttft_ms']['p50']} ms (later rounds {lv['ttft_later_rounds_ms']['p50']}), ITL p50 "
        f"{lv['itl_ms']['p50']} ms"
    )


def _summary_line(modes: dict[str, Any]) -> str:
    parts = []
    for mode, res in modes.items():
        lv = res["levels"][0]
        eng = lv["engine"].get("ttft_ms", {}).get("p50")
        quiet = res.get("quiet", {}).get("itl_ms", {}).get("p50")
        vs = f" ({lv['itl_ms']['p50'] / quiet:.2f}x quiet)" if quiet and lv["itl_ms"]["p50"] else ""
        parts.append(
            f"{mode}: qps {lv['qps']:g} TTFT p50 {lv['ttft_ms']['p50'] or 0:.1f} ms (later rounds "
            f"{lv['ttft_later_rounds_ms']['p50'] or 0:.1f}, engine {eng or 0:.1f}), ITL p50 "
            f"{lv['itl_ms']['p50'] or 0:.1f} ms{vs}, {lv['output_tokens_per_s']:.0f} tok/s, "
            f"{lv['processed_req_per_s']:.2f} req/s processed (completion rate "
            f"{lv.get('completion_rate_req_per_s')} vs sent {lv.get('send_rate_req_per_s')}), "
            f"{lv['failed']} failed, best qps (p90 < 1 s) {res['best_qps_p90_under_1s']}"
        )
    base = modes.get("off", {}).get("levels", [{}])[0].get("ttft_later_rounds_ms", {}).get("p50")
    on = modes.get("offload", {}).get("levels", [{}])[0].get("ttft_later_rounds_ms", {}).get("p50")
    ratio = f"; later-round p50 off/offload {base / on:.2f}x" if base and on else ""
    return "serving: " + "; ".join(parts) + ratio


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--qps", default="1", help="a qps, or a comma list for a sweep")
    ap.add_argument("--duration-s", type=float, default=60)
    ap.add_argument("--users", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--system-words", type=int, default=800, help="shared system prompt")
    ap.add_argument("--history-words", type=int, default=900, help="each user's own history")
    ap.add_argument("--question-words", type=int, default=20)
    ap.add_argument("--answer-len", type=int, default=100, help="tokens per answer")
    ap.add_argument("--num-gpu-blocks", type=int, default=1200)
    ap.add_argument("--host-capacity", default="8GiB")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument(
        "--pool-histories",
        type=float,
        default=0,
        help="size the GPU pool to hold about this many histories (overrides "
        "--num-gpu-blocks; 0: off)",
    )
    ap.add_argument(
        "--quiet-batch",
        type=int,
        default=2,
        help="sessions of the idle-engine ITL yardstick run after the levels (0: none)",
    )
    ap.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra kvtier serve flag (repeatable; e.g. --server-arg=--device=cpu)",
    )
    ap.add_argument("--concurrent", action="store_true", help="drive every mode at once")
    ap.add_argument("--startup-timeout-s", type=float, default=600)
    ap.add_argument("--log-dir", default=".")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        ap.error(f"--modes: unknown {bad}; choose from {','.join(MODES)}")
    try:
        qps_levels = [float(q) for q in args.qps.split(",")]
    except ValueError:
        ap.error(f"--qps: not a number list: {args.qps!r}")
    if any(q <= 0 for q in qps_levels):
        ap.error("--qps: every level must be > 0")
    os.makedirs(args.log_dir, exist_ok=True)
    shape = Shape(
        args.users,
        args.rounds,
        args.system_words,
        args.history_words,
        args.question_words,
        args.answer_len,
        args.duration_s,
    )
    if args.pool_histories > 0:
        args.num_gpu_blocks = pool_blocks(shape, args.pool_histories)
    common = [
        "--num-gpu-blocks",
        str(args.num_gpu_blocks),
        "--max-model-len",
        str(args.max_model_len),
        *args.server_arg,
    ]
    servers: dict[str, tuple[Any, str]] = {}
    logs = {m: os.path.join(args.log_dir, f"serving_{m}.requests.jsonl") for m in modes}
    offsets = dict.fromkeys(modes, 0)
    for m in modes:
        if os.path.exists(logs[m]):
            os.remove(logs[m])
    results: dict[str, Any] = {m: {"levels": []} for m in modes}
    try:
        for m in modes:
            flags = [
                *offload_config(m, args.host_capacity, args.log_dir),
                "--request-log",
                logs[m],
                *common,
            ]
            servers[m] = spawn_server(
                args.model, flags, [], os.path.join(args.log_dir, f"serving_{m}.log")
            )
        for m in modes:
            wait_healthy(
                *servers[m], os.path.join(args.log_dir, f"serving_{m}.log"), args.startup_timeout_s
            )
        for m in modes:  # one short request each: first-call costs stay out of the levels
            httpx.post(
                f"{servers[m][1]}/v1/chat/completions",
                timeout=args.startup_timeout_s,
                json={"messages": [{"role": "user", "content": "warm up"}], "max_tokens": 2},
            )
            offsets[m] = read_log(logs[m], 0)[1]
        for i, qps in enumerate(qps_levels):
            groups = [modes] if args.concurrent else [[m] for m in modes]
            for group in groups:
                print(f"serving: qps {qps:g}, {','.join(group)}", flush=True)

                async def run_group(
                    group: list[str] = group, qps: float = qps, seed: int = i + 1
                ) -> list[Any]:
                    return await asyncio.gather(
                        *(drive(servers[m][1], shape, qps, seed) for m in group)
                    )

                before = {m: server_counters(servers[m][1]) for m in group}
                runs = asyncio.run(run_group())
                time.sleep(1.5)  # the core sends its stats once more 1 s after going idle
                for m, run in zip(group, runs, strict=True):
                    entries, offsets[m] = read_log(logs[m], offsets[m])
                    level = summarize(run, qps, entries)
                    level["server"] = counter_deltas(before[m], server_counters(servers[m][1]))
                    results[m]["levels"].append(level)
                    # at once, flushed: a run cut at its time limit keeps its finished levels
                    print(f"serving: {m} done: {_level_line(level)}", flush=True)
        if args.quiet_batch > 0:
            for m in modes:
                print(f"serving: {m}: ITL of a quiet batch of {args.quiet_batch}", flush=True)
                results[m]["quiet"] = asyncio.run(
                    quiet_itl(servers[m][1], shape, args.quiet_batch, seed=997)
                )
                quiet_p50 = results[m]["quiet"].get("itl_ms", {}).get("p50")
                print(f"serving: {m} quiet ITL p50 {quiet_p50} ms", flush=True)
    finally:
        for m, (proc, _) in servers.items():
            results[m]["server_exit"] = stop_server(proc, 30)
    for res in results.values():
        res["best_qps_p90_under_1s"] = best_qps(res["levels"])
    report = {
        "machine": machine_info(),
        "params": {**vars(args), "modes": modes, "qps": qps_levels},
        "modes": results,
        "summary": _summary_line(results),
    }
    emit_report(report, args.out)
    failed = sum(lv["failed"] for r in results.values() for lv in r["levels"])
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
