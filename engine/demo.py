"""``kvtier demo``: a multi-turn chat workload on the embedded demo model, summarised.

Several users chat at once; every turn's prompt carries the whole conversation so far, so
later turns should find their history cached. The GPU pool is kept small (``--num-gpu-blocks``)
so that the histories do not fit it: the workload runs once without KV offload (the baseline:
evicted history is recomputed) and once with it (host tier over LMDB in a temporary directory,
or ``--offload-dir``; the cost model decides per request whether reloading beats recomputing).
The summary reports the prefix-cache hit rate (GPU hits plus loaded tokens over prompt tokens)
and TTFT for first against later turns of the offload run, then per-tier hits, loaded versus
recomputed tokens, the cost model's decisions, and TTFT with and without offload side by side.
Each user pastes ~870 tokens of notes in the first turn (``--notes-words``), so a history
costs a real prefill to recompute, and the pool holds one history but not all of them.
Greedy sampling and short replies keep it to about a second of work on a laptop CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from engine.config import CacheConfig, EngineConfig
from engine.sampling_params import SamplingParams
from engine.tokenizer import encode_chat

SYSTEM_PROMPT = (
    "You are the kvtier demo assistant. You answer questions about caching, storage tiers "
    "and serving large language models. Keep answers short, precise and friendly, and say "
    "when you do not know something."
)
_TOPICS = ("pinned host memory", "LMDB on local disk", "Redis clusters", "S3 object storage",
           "prefix caching", "block hashing", "chunked prefill", "preemption")  # fmt: skip
_QUESTIONS = (
    "Tell me how {} helps a serving engine.",
    "What goes wrong with {} under heavy load?",
    "How would you measure the cost of {}?",
    "Compare {} with recomputing the prompt.",
    "Summarise what we said about {} so far.",
)


@dataclass(frozen=True, slots=True)
class TurnRecord:
    user: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float


@dataclass(frozen=True, slots=True)
class GroupSummary:
    requests: int
    prompt_tokens: int
    cached_tokens: int
    ttft_p50_s: float
    ttft_p90_s: float

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, math.ceil(len(ordered) * q / 100))
    return ordered[min(len(ordered), rank) - 1]


def user_notes(user: int, words: int) -> str:
    """A user's own long context (pasted notes, as in document QA): ``words`` words drawn,
    deterministically per user, from the demo model's corpus. Empty for ``words`` 0."""
    from engine.demo_model import _CORPUS

    vocab = _CORPUS.split()
    rng = random.Random(1000 + user)
    return " ".join(rng.choice(vocab) for _ in range(words))


def user_message(user: int, turn: int, notes_words: int = 0) -> str:
    """The user's turn: a question on their topic; the first turn also pastes their notes."""
    topic = _TOPICS[user % len(_TOPICS)]
    question = _QUESTIONS[turn % len(_QUESTIONS)].format(topic)
    if turn == 0 and notes_words:
        return f"Here are my notes: {user_notes(user, notes_words)}\n{question}"
    return question


def run_workload(engine: object, users: int, turns: int, max_tokens: int,
                 notes_words: int = 0) -> list[TurnRecord]:
    """Runs ``turns`` rounds; in each, every user's next turn is submitted at once and the
    engine stepped until all finish. Mutates the engine's cache (that is the point)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    histories = [[{"role": "system", "content": SYSTEM_PROMPT}] for _ in range(users)]
    records: list[TurnRecord] = []
    for turn in range(turns):
        prompt_lens: dict[str, int] = {}
        for user, history in enumerate(histories):
            history.append({"role": "user", "content": user_message(user, turn, notes_words)})
            req_id = f"u{user}-t{turn}"
            token_ids = encode_chat(engine.tokenizer, history)  # type: ignore[attr-defined]
            prompt_lens[req_id] = len(token_ids)
            engine.add_request(req_id, token_ids, params, arrival_time=time.monotonic())  # type: ignore[attr-defined]
        finals = {}
        while engine.has_unfinished_requests():  # type: ignore[attr-defined]
            for output in engine.step():  # type: ignore[attr-defined]
                if output.finished:
                    finals[output.req_id] = output
        for user, history in enumerate(histories):
            out = finals[f"u{user}-t{turn}"]
            history.append({"role": "assistant", "content": out.text})
            ttft = out.metrics.ttft_s if out.metrics is not None else None
            records.append(
                TurnRecord(
                    user=user,
                    turn=turn,
                    prompt_tokens=prompt_lens[out.req_id],
                    cached_tokens=out.num_cached_tokens,
                    ttft_s=float("nan") if ttft is None else ttft,
                )
            )
    return records


def summarize(records: list[TurnRecord]) -> GroupSummary:
    ttfts = [r.ttft_s for r in records] or [0.0]
    return GroupSummary(
        requests=len(records),
        prompt_tokens=sum(r.prompt_tokens for r in records),
        cached_tokens=sum(r.cached_tokens for r in records),
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p90_s=percentile(ttfts, 90),
    )


def format_summary(model_name: str, records: list[TurnRecord], wall_s: float) -> str:
    total = summarize(records)
    first = summarize([r for r in records if r.turn == 0])
    later = summarize([r for r in records if r.turn > 0])
    users = len({r.user for r in records})
    turns = len({r.turn for r in records})
    lines = [
        f"kvtier demo: model={model_name} users={users} turns={turns} (greedy)",
        f"requests            {total.requests}",
        f"prompt tokens       {total.prompt_tokens}",
        f"prefix-cache hits   {total.cached_tokens} tokens "
        f"(hit rate {100 * total.hit_rate:.1f}% of prompt tokens)",
        f"{'':20}{'first turns':>14}{'later turns':>14}",
        f"{'requests':20}{first.requests:>14}{later.requests:>14}",
        f"{'hit rate %':20}{100 * first.hit_rate:>14.1f}{100 * later.hit_rate:>14.1f}",
        f"{'TTFT p50 ms':20}{1e3 * first.ttft_p50_s:>14.1f}{1e3 * later.ttft_p50_s:>14.1f}",
        f"{'TTFT p90 ms':20}{1e3 * first.ttft_p90_s:>14.1f}{1e3 * later.ttft_p90_s:>14.1f}",
        f"wall time           {wall_s:.2f} s",
    ]
    return "\n".join(lines)


def demo_offload_config(directory: str, host_capacity: str, decision: str) -> dict[str, Any]:
    """The embedded offload config: a small host tier over LMDB under ``directory``."""
    return {
        "decision": decision,
        "tiers": [
            {"kind": "host", "capacity": host_capacity},
            {"kind": "lmdb", "path": f"{directory}/lmdb", "capacity": "1GiB"},
        ],
    }


def format_offload(
    kv: dict[str, Any],
    records: list[TurnRecord],
    baseline: list[TurnRecord] | None,
    num_gpu_blocks: int,
) -> str:
    """Per-tier hits, token accounting, decisions, bytes, and TTFT against the baseline."""
    tiers = ", ".join(f"{name} {row['hit_blocks']} blocks" for name, row in kv["tiers"].items())
    decisions = ", ".join(f"{k} {v}" for k, v in sorted(kv["decisions"].items())) or "none"
    lines = [
        f"kv offload          host + lmdb, decision policy {kv['decision_policy']}, "
        f"GPU pool {num_gpu_blocks} blocks",
        f"tier hits           {tiers}",
        f"tokens              gpu hit {kv['gpu_hit_tokens']}, loaded {kv['loaded_tokens']}, "
        f"recomputed {kv['recomputed_tokens']} (held by tiers but computed)",
        f"cost model          {decisions}",
        f"bytes               saved {kv['saved_bytes'] / 2**20:.2f} MiB, loaded "
        f"{kv['loaded_bytes'] / 2**20:.2f} MiB in {1e3 * kv['load_seconds']:.1f} ms; "
        f"failed loads {kv['failed_loads']}",
    ]
    if baseline is not None:
        later_off = summarize([r for r in records if r.turn > 0])
        later_base = summarize([r for r in baseline if r.turn > 0])
        ratio = later_base.ttft_p50_s / later_off.ttft_p50_s if later_off.ttft_p50_s else math.nan
        lines += [
            f"{'later turns':20}{'no offload':>14}{'offload':>14}",
            f"{'cache hit %':20}{100 * later_base.hit_rate:>14.1f}{100 * later_off.hit_rate:>14.1f}",
            f"{'TTFT median ms':20}{1e3 * later_base.ttft_p50_s:>14.1f}"
            f"{1e3 * later_off.ttft_p50_s:>14.1f}",
            f"TTFT speed-up       {ratio:.2f}x (median of later turns, no offload / offload)",
        ]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--users", type=int, default=4, help="concurrent conversations")
    parser.add_argument("--turns", type=int, default=3, help="turns per conversation")
    parser.add_argument("--max-tokens", type=int, default=12, help="reply length cap")
    parser.add_argument("--notes-words", type=int, default=300,
                        help="words of notes each user pastes in the first turn (~870 tokens at "
                             "300): long histories, so a recompute costs what a reload saves")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    parser.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=80,
        help="GPU KV pool size in 16-token blocks (small: the users' histories must not all "
             "fit; one history must)",
    )
    parser.add_argument("--host-capacity", default="12MiB",
                        help="host tier size (default: about half the demo's KV, so both tiers hit)")
    parser.add_argument(
        "--decision",
        default="cost",
        choices=("cost", "load", "recompute"),
        help="reload-versus-recompute policy",
    )
    parser.add_argument(
        "--offload-dir",
        default=None,
        help="keep the LMDB tier here (default: a temporary directory)",
    )
    parser.add_argument(
        "--no-baseline", action="store_true", help="skip the run without KV offload"
    )


def main(args: argparse.Namespace) -> int:
    from engine.llm_engine import LLMEngine

    if args.users < 1 or args.turns < 1 or args.num_gpu_blocks < 1 or args.notes_words < 0:
        print("kvtier demo: --users, --turns and --num-gpu-blocks must be >= 1, --notes-words >= 0")
        return 2
    config = EngineConfig(
        model=None, device=args.device, cache=CacheConfig(num_gpu_blocks=args.num_gpu_blocks)
    )
    baseline = None
    if not args.no_baseline:
        engine = LLMEngine(config)
        baseline = run_workload(engine, args.users, args.turns, args.max_tokens, args.notes_words)
        engine.close()
    with tempfile.TemporaryDirectory(prefix="kvtier-demo-") as tmp:
        offload = demo_offload_config(args.offload_dir or tmp, args.host_capacity, args.decision)
        engine = LLMEngine(dataclasses.replace(config, kv_offload=True, kv_offload_config=offload))
        try:
            start = time.perf_counter()
            records = run_workload(engine, args.users, args.turns, args.max_tokens, args.notes_words)
            wall_s = time.perf_counter() - start
            kv = engine.kv_stats()
        finally:
            engine.close()
    print(format_summary(engine.model_name, records, wall_s))
    print(format_offload(kv, records, baseline, args.num_gpu_blocks))
    return 0
