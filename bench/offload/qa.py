"""bench/offload/main.py's multi-round QA section in LMCache's shape: the event-driven driver
(users ask their rounds one after another, at most ``concurrency`` requests in flight, a fixed
round-robin admission order, the same in both modes) and the section itself (offload on vs off).
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench.common import percentile
from bench.offload.parts import (
    _REQ_IDS,
    GREEDY1,
    Setup,
    bytes_per_block,
    close_llm,
    make_llm,
    random_tokens,
    run_requests,
    two_byte_kv,
)
from engine.sampling_params import SamplingParams

# -- multi-round QA driver ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class QaTurn:
    """One finished QA request (a user's question of one round)."""

    user: int
    round: int
    prompt_tokens: int
    ttft_s: float  # from RequestMetrics: add_request to the first token
    cached_tokens: int  # GPU prefix hit plus tokens loaded from the tiers
    loaded_tokens: int  # of those, served by a tier below the GPU (the request log's hit_tiers)
    decision: str  # the request log's reload decision ("recompute" without offload)


@dataclass(frozen=True, slots=True)
class QaRun:
    """A whole QA session on one engine."""

    turns: tuple[QaTurn, ...]  # in the order they finished
    wall_s: float  # first admission to last finish
    generated_tokens: int
    max_in_flight: int
    preemptions: int  # scheduler preemptions during the run (0: in-flight work never starved)


def qa_order(users: int, rounds: int) -> list[tuple[int, int]]:
    """The fixed admission order: (user, round), user 0..users-1 of round 0, then round 1..."""
    return [(u, r) for r in range(rounds) for u in range(users)]


def run_qa(
    llm: Any,
    histories: Sequence[Sequence[int]],
    questions: Sequence[Sequence[Sequence[int]]],
    params: SamplingParams,
    concurrency: int,
    log_path: str,
    stall_s: float,
) -> QaRun:
    """Drive a multi-round QA session through ``llm.engine`` (add_request / step).

    User ``u`` asks ``questions[r][u]`` in round ``r`` after its round ``r - 1`` answer came
    back; its prompt is its history (``histories[u]`` then every earlier question and answer)
    plus the question. At most ``concurrency`` requests are in flight; whenever there is room,
    the first (user, round) of ``qa_order`` whose user has nothing in flight is admitted, so
    two engines see the same order whatever their speed. ``llm`` must write its request log to
    ``log_path`` (the per-request cache hits come from there). Does not mutate the inputs.
    Raises RuntimeError when no request finishes for ``stall_s`` seconds."""
    eng = llm.engine
    history = [list(h) for h in histories]
    pending = qa_order(len(histories), len(questions))
    inflight: dict[str, tuple[int, int, list[int]]] = {}
    busy: set[int] = set()
    done: list[tuple[str, int, int, Any]] = []
    preempt0 = eng.stats()["num_preemptions_total"]
    generated = max_in_flight = 0
    t0 = last_progress = time.perf_counter()
    while pending or inflight:
        while len(inflight) < concurrency:
            nxt = next((i for i, (u, _) in enumerate(pending) if u not in busy), None)
            if nxt is None:
                break
            u, r = pending.pop(nxt)
            prompt = history[u] + list(questions[r][u])
            rid = f"qa-{u}-{r}-{next(_REQ_IDS)}"
            eng.add_request(rid, prompt, params)
            inflight[rid] = (u, r, prompt)
            busy.add(u)
        max_in_flight = max(max_in_flight, len(inflight))
        for out in eng.step():
            if not out.finished or out.req_id not in inflight:
                continue
            u, r, prompt = inflight.pop(out.req_id)
            busy.discard(u)
            history[u] = prompt + list(out.token_ids)
            generated += len(out.token_ids)
            done.append((out.req_id, u, r, out))
            last_progress = time.perf_counter()
        if time.perf_counter() - last_progress > stall_s:
            stats = eng.stats()
            for rid in inflight:
                eng.abort_request(rid)
            raise RuntimeError(
                f"QA stalled: {len(done)} requests done, {len(inflight)} in "
                f"flight, none finished for {stall_s:.0f} s; stats {stats}"
            )
    wall = time.perf_counter() - t0
    logged = _read_request_log(log_path)
    bs = llm.config.cache.block_size
    turns = []
    for rid, u, r, out in done:
        entry = logged.get(rid, {})
        tiers = entry.get("hit_tiers", [])
        ttft = out.metrics.ttft_s if out.metrics is not None and out.metrics.ttft_s else 0.0
        turns.append(
            QaTurn(
                u,
                r,
                len(out.prompt_token_ids),
                ttft,
                out.num_cached_tokens,
                bs * sum(t != "gpu" for t in tiers),
                str(entry.get("decision", "unknown")),
            )
        )
    return QaRun(
        tuple(turns),
        wall,
        generated,
        max_in_flight,
        eng.stats()["num_preemptions_total"] - preempt0,
    )


def _read_request_log(path: str) -> dict[str, dict[str, Any]]:
    """req_id -> entry of an engine request log (engine/request_log.py); {} if absent."""
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        entries = [json.loads(line) for line in f if line.strip()]
    return {e["req_id"]: e for e in entries}


# -- multi-round QA ------------------------------------------------------------------------


def qa_sizes(setup: Setup) -> dict[str, int]:
    """The QA run's derived sizes: the longest prompt, the GPU pool (``concurrency + 1``
    users' longest histories: too small for all users, but requests in flight never wait for
    blocks) and a host tier that keeps every user's history."""
    q = setup.qa
    turn = q["question"] + q["answer"]
    max_prompt = q["system"] + q["context"] + (q["rounds"] - 1) * turn + q["question"]
    user_blocks = -(-(max_prompt + q["answer"]) // 16) + 1
    own_blocks = -(-(q["context"] + q["rounds"] * turn) // 16) + 2  # past the system prompt
    slot = bytes_per_block(setup) + (64 << 10)  # an encoded block: a header over the bytes
    all_blocks = q["system"] // 16 + q["users"] * own_blocks
    pool = (q["concurrency"] + 1) * user_blocks + 4
    return {
        "max_prompt_tokens": max_prompt,
        "num_gpu_blocks": pool,
        "all_history_blocks": all_blocks,
        "pool_holds_all_histories": pool >= all_blocks,  # then the run shows no reloads
        "host_capacity": max(setup.host_capacity, all_blocks * slot * 5 // 4),
    }


def bench_qa(setup: Setup) -> dict[str, Any]:
    """LMCache's multi-round QA shape, offload off vs on (``setup.qa_decision``, by default
    the cost model; host tier), each mode on a fresh engine driven by ``run_qa`` with the same
    users, questions and admission order.
    Reports TTFT p50/p99 (all requests, and rounds >= 1 alone: the reuse of an evicted history),
    output tokens/s over the run's wall time, cache hits per request and the decisions.
    ``setup.qa_lossless``: a third engine, offload on with ``compression: lossless``."""
    q, sizes = setup.qa, qa_sizes(setup)
    out: dict[str, Any] = {"params": {**q, **sizes}}
    params = SamplingParams(max_tokens=q["answer"], temperature=0.0, ignore_eos=True)
    host = {"kind": "host", "capacity": f"{sizes['host_capacity']}B"}
    modes: list[tuple[str, dict[str, Any] | None]] = [
        ("off", None),
        ("on", {"decision": setup.qa_decision, "tiers": [host]}),
    ]
    if setup.qa_lossless and two_byte_kv(setup):
        modes.append(
            (
                "on_lossless",
                {"decision": setup.qa_decision, "compression": "lossless", "tiers": [host]},
            )
        )
    for name, offload in modes:
        rng = random.Random(2)
        system = random_tokens(rng, q["system"])
        histories = [system + random_tokens(rng, q["context"]) for _ in range(q["users"])]
        questions = [
            [random_tokens(rng, q["question"]) for _ in range(q["users"])]
            for _ in range(q["rounds"])
        ]
        log_path = os.path.join(setup.workdir, f"qa-{name}.jsonl")
        llm = make_llm(setup, sizes["num_gpu_blocks"], offload, request_log=log_path)
        try:
            run_requests(llm, [random_tokens(rng, 32)], GREEDY1, setup.request_timeout_s)  # warm-up
            before = llm.kv_stats()
            run = run_qa(
                llm,
                histories,
                questions,
                params,
                q["concurrency"],
                log_path,
                setup.request_timeout_s,
            )
            after = llm.kv_stats()
        finally:
            close_llm(llm)
        out[name] = _qa_figures(run, before, after)
    out["ttft_p50_ratio"] = out["off"]["ttft_p50_s"] / out["on"]["ttft_p50_s"]
    out["ttft_p50_later_rounds_ratio"] = (
        out["off"]["ttft_p50_later_rounds_s"] / out["on"]["ttft_p50_later_rounds_s"]
    )
    out["throughput_ratio"] = out["on"]["output_tokens_per_s"] / out["off"]["output_tokens_per_s"]
    if "on_lossless" in out:
        on = out["on_lossless"]
        out["lossless_ttft_p50_ratio"] = out["off"]["ttft_p50_s"] / on["ttft_p50_s"]
        out["lossless_throughput_ratio"] = (
            on["output_tokens_per_s"] / out["off"]["output_tokens_per_s"]
        )
    return out


def _qa_figures(run: QaRun, before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    ttfts = sorted(t.ttft_s for t in run.turns)
    later = sorted(t.ttft_s for t in run.turns if t.round > 0)
    decisions = {
        k: v - before.get("decisions", {}).get(k, 0) for k, v in after.get("decisions", {}).items()
    }
    return {
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "ttft_p50_later_rounds_s": percentile(later, 50),
        "output_tokens_per_s": run.generated_tokens / run.wall_s,
        "wall_s": run.wall_s,
        "requests": len(run.turns),
        "generated_tokens": run.generated_tokens,
        "decisions": {k: v for k, v in decisions.items() if v},
        "cached_tokens": sum(t.cached_tokens for t in run.turns),
        "loaded_tokens": sum(t.loaded_tokens for t in run.turns),
        "kv_loaded_tokens": after["loaded_tokens"] - before["loaded_tokens"],
        "max_in_flight": run.max_in_flight,
        "preemptions": run.preemptions,
        "per_request": [
            [
                t.user,
                t.round,
                t.prompt_tokens,
                round(t.ttft_s * 1e3, 3),
                t.cached_tokens,
                t.loaded_tokens,
                t.decision,
            ]
            for t in run.turns
        ],
        "per_request_fields": [
            "user",
            "round",
            "prompt_tokens",
            "ttft_ms",
            "cached_tokens",
            "loaded_tokens",
            "decision",
        ],
    }
