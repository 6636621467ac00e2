"""Two engine processes share one ``kvtier cache-server`` (issue 7's first "done when").

A real daemon (subprocess, free port, temp data dir, tokens) and engines in their own
processes, each ``LLM(kv_offload=True)`` on the same tiny random-weight model with a remote
tier (``decision: load``, so the CPU cost model cannot choose to recompute):

- sharing: engine A generates for a prompt; engine B, a fresh process, serves the same prompt
  loading A's blocks from the daemon (``kv_stats()``: every full prompt block loaded, only the
  tail computed) with output identical to A's and to an offload-free engine's;
- disaggregation: A prefills a second prompt only (``max_tokens=1``) and stores its KV; B
  decodes the full request loading that KV, again identical to the offload-free output.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.servers import cache_server_process

ROOT = Path(__file__).resolve().parents[3]
PROMPT_TOKENS = 72  # 4 full 16-token blocks + an 8-token tail
MAX_TOKENS = 8

# One engine process: run each phase (prompt, max_tokens) in order, print one JSON line with
# the generated ids and the kv_stats() counters after each phase.
ENGINE = """
import json, sys
import torch
torch.set_num_threads(1)
from engine import LLM, SamplingParams
spec = json.loads(sys.argv[1])
kw = {"kv_offload": True, "kv_offload_config": spec["offload"]} if spec["offload"] else {}
keys = ("gpu_hit_tokens", "loaded_tokens", "recomputed_tokens", "saved_blocks",
        "loaded_blocks", "failed_loads", "tiers")
out = []
with LLM(spec["model"], num_gpu_blocks=16, dtype="float32", device="cpu", **kw) as llm:
    for prompt, max_tokens in spec["phases"]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        (res,) = llm.generate([prompt], params)
        kv = llm.kv_stats()
        out.append({"ids": list(res.token_ids), "kv": {k: kv.get(k) for k in keys}})
print(json.dumps(out))
"""


def _engine(
    model: str, offload: dict[str, Any] | None, phases: list[tuple[list[int], int]]
) -> list[dict[str, Any]]:
    spec = json.dumps({"model": model, "offload": offload, "phases": phases})
    proc = subprocess.run(
        [sys.executable, "-c", ENGINE, spec], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _delta(after: dict[str, Any], before: dict[str, Any], key: str) -> int:
    return int(after["kv"][key]) - int(before["kv"][key])


@pytest.fixture
def daemon(tmp_path: Path) -> Any:
    with cache_server_process(tmp_path, "tok-engines-01", "engines") as port:
        yield f"tcp://127.0.0.1:{port}"


def test_two_engines_share_kv_through_the_daemon(tmp_path: Path, daemon: str) -> None:
    from tests.engine.hf_models import make_tiny_model

    model = make_tiny_model(tmp_path / "models", "llama", seed=3)
    rng = random.Random(11)
    shared = [rng.randrange(3, 500) for _ in range(PROMPT_TOKENS)]
    disagg = [rng.randrange(3, 500) for _ in range(PROMPT_TOKENS)]
    remote = {"kind": "remote", "url": daemon, "token": "tok-engines-01", "timeout_s": 10}
    engine_a = {"decision": "load", "tiers": [remote]}
    # B reads through its own host tier: the remote tier is below it.
    engine_b = {"decision": "load", "tiers": [{"kind": "host", "capacity": "2MiB"}, remote]}

    ref = _engine(model, None, [(shared, MAX_TOKENS), (disagg, MAX_TOKENS)])
    a = _engine(model, engine_a, [(shared, MAX_TOKENS), (disagg, 1)])
    b = _engine(model, engine_b, [(shared, MAX_TOKENS), (disagg, MAX_TOKENS)])

    # A computed everything itself and stored the blocks of both requests in the daemon.
    assert a[0]["ids"] == ref[0]["ids"] and len(ref[0]["ids"]) == MAX_TOKENS
    assert a[1]["ids"] == ref[1]["ids"][:1]  # the prefill-only engine's one token
    assert a[1]["kv"]["loaded_tokens"] == 0 and a[1]["kv"]["saved_blocks"] >= 8
    # Sharing: B loads the 4 full prompt blocks from the daemon and computes only the tail.
    assert b[0]["ids"] == a[0]["ids"] == ref[0]["ids"]
    assert b[0]["kv"]["loaded_tokens"] == 64 and b[0]["kv"]["gpu_hit_tokens"] == 0
    assert b[0]["kv"]["recomputed_tokens"] == 0 and b[0]["kv"]["failed_loads"] == 0
    assert b[0]["kv"]["tiers"]["remote"]["hit_blocks"] == 4
    # Disaggregation: B decodes the request A only prefilled, from A's stored KV.
    assert b[1]["ids"] == ref[1]["ids"]
    assert _delta(b[1], b[0], "loaded_tokens") == 64
    assert _delta(b[1], b[0], "recomputed_tokens") == 0
    assert _delta(b[1], b[0], "gpu_hit_tokens") == 0
    assert b[1]["kv"]["tiers"]["remote"]["hit_blocks"] == 8 and b[1]["kv"]["failed_loads"] == 0
