"""The long-context check a user runs first: ``LLM.generate`` after an N-token prompt, with CUDA
graphs on (the default), one fresh process per N so that a crash is reported, not fatal.

Usage: python -m bench.long_context --model DIR [--lengths 5000,8192,16000,32000]
       [--max-tokens 100] [--num-gpu-blocks 1200] [--out FILE]

Each case builds ``LLM(model=DIR, dtype="bfloat16", device="cuda", num_gpu_blocks=B)`` with
``B = max(--num-gpu-blocks, blocks the prompt and its output need)`` and generates
``--max-tokens`` greedy tokens from N random token ids. JSON per case: ok, error (its last line),
seconds, generated tokens, graph decode steps; a one-line summary last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from bench.common import emit_report, machine_info


def run_case(model: str, n: int, max_tokens: int, num_blocks: int, eager: bool) -> dict[str, Any]:
    """One snippet run in this process (the child)."""
    import torch

    from engine import LLM, SamplingParams

    ids = torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    start = time.perf_counter()
    llm = LLM(
        model=model, dtype="bfloat16", device="cuda", num_gpu_blocks=num_blocks, enforce_eager=eager
    )
    built = time.perf_counter()
    out = llm.generate(
        [ids], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    )
    torch.cuda.synchronize()
    done = time.perf_counter()
    graphs = llm.engine.runner.cuda_graphs
    llm.close()
    return {
        "n": n,
        "ok": True,
        "num_gpu_blocks": num_blocks,
        "eager": eager,
        "generated": len(out[0].token_ids),
        "build_s": round(built - start, 2),
        "generate_s": round(done - built, 3),
        "graphs": graphs is not None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--lengths", default="5000,8192,16000,32000")
    ap.add_argument("--max-tokens", type=int, default=100)
    ap.add_argument("--num-gpu-blocks", type=int, default=1200)
    ap.add_argument("--eager", action="store_true", help="enforce_eager=True (the comparison)")
    ap.add_argument("--timeout-s", type=float, default=300)
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        blocks = max(args.num_gpu_blocks, -(-(args.child + args.max_tokens) // 16) + 1)
        print(
            "RESULT "
            + json.dumps(run_case(args.model, args.child, args.max_tokens, blocks, args.eager))
        )
        return 0
    cases = []
    for n in (int(x) for x in args.lengths.split(",")):
        cmd = [
            sys.executable,
            "-m",
            "bench.long_context",
            "--model",
            args.model,
            "--child",
            str(n),
            "--max-tokens",
            str(args.max_tokens),
            "--num-gpu-blocks",
            str(args.num_gpu_blocks),
        ]
        if args.eager:
            cmd.append("--eager")
        start = time.perf_counter()
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=args.timeout_s, env=os.environ
            )
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode == 0 and lines:
                case = json.loads(lines[-1][len("RESULT ") :])
            else:
                err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
                case = {"n": n, "ok": False, "rc": proc.returncode, "error": err[-1] if err else ""}
        except subprocess.TimeoutExpired:
            case = {"n": n, "ok": False, "error": f"timed out after {args.timeout_s} s"}
        case["wall_s"] = round(time.perf_counter() - start, 1)
        print(json.dumps(case), flush=True)
        cases.append(case)
    ok = sum(c["ok"] for c in cases)
    report = {
        "machine": machine_info(),
        "max_tokens": args.max_tokens,
        "cases": cases,
        "summary": f"long_context: {ok}/{len(cases)} prompt lengths generated "
        f"{args.max_tokens} tokens ({'eager' if args.eager else 'CUDA graphs'}): "
        + ", ".join(f"{c['n']}:{'ok' if c['ok'] else 'FAIL'}" for c in cases),
    }
    emit_report(report, args.out)
    return 0 if ok == len(cases) else 1


if __name__ == "__main__":
    raise SystemExit(main())
