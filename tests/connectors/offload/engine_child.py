"""An engine process for the write-policy tests: ``python -m tests.connectors.offload.engine_child SPEC``.

SPEC (JSON): ``{"model": DIR, "engines": [{"offload": {...} | null, "phases": [[prompt_ids,
max_tokens], ...], "hold": bool}, ...]}``. Engines are built in order (CPU, float32, 16 GPU
blocks, one torch thread), each running its phases one ``generate`` call at a time (greedy,
``ignore_eos``); after each phase one JSON line goes to stdout (flushed): ``{"engine": e,
"phase": p, "ids": [...], "kv": {...}}`` with the ``kv_stats()`` counters the tests read. An
engine without ``hold`` is closed (``llm.close()``: drain and flush) right after its phases;
held ones stay open until a line arrives on stdin after ``{"held": true}`` is printed, so that
another process can read what they stored while they still run.
"""

from __future__ import annotations

import json
import sys
from typing import Any

KV_KEYS = (
    "gpu_hit_tokens",
    "loaded_tokens",
    "recomputed_tokens",
    "saved_blocks",
    "loaded_blocks",
    "failed_loads",
    "tiers",
)


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main(spec: dict[str, Any]) -> None:
    import torch

    torch.set_num_threads(1)
    from engine import LLM, SamplingParams

    held = []
    for e, engine in enumerate(spec["engines"]):
        offload = engine["offload"]
        kw = {"kv_offload": True, "kv_offload_config": offload} if offload else {}
        llm = LLM(spec["model"], num_gpu_blocks=16, dtype="float32", device="cpu", **kw)
        for p, (prompt, max_tokens) in enumerate(engine["phases"]):
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            (res,) = llm.generate([prompt], params)
            kv = llm.kv_stats()
            _emit(
                {
                    "engine": e,
                    "phase": p,
                    "ids": list(res.token_ids),
                    "kv": {k: kv.get(k) for k in KV_KEYS},
                }
            )
        if engine.get("hold"):
            held.append(llm)
        else:
            llm.close()
    if held:
        _emit({"held": True})
        sys.stdin.readline()
        for llm in held:
            llm.close()
    _emit({"done": True})


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
