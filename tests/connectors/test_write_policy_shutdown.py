"""Issue 17, crash and shutdown: what an engine acknowledged to LMDB survives a SIGKILL (and no
torn block is visible), and a SIGTERM of ``kvtier serve`` drains: the blocks its host tier held
are in LMDB afterwards, although LMDB is write-back there (only the shutdown flush moves them).

Every engine has a 256 MiB host tier in front (it never evicts here); the restarted engine runs
in this process over the same LMDB files (``decision: load``) and must load every full block of
the prompts the dead one acknowledged, with the outputs of an engine without offload.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from cachestore.codec import CodecError, decode_block
from engine import LLM, SamplingParams
from tests.connectors.test_write_policy import (
    MAX_TOKENS,
    PROMPTS,
    ROOT,
    offload,
    phases,
    reference,  # noqa: F401 - the module fixture, shared
    spawn,
)
from tests.servers import free_port
from tiers.lmdb import LmdbTier

LONG = [(list(range(7, 67)), 180)]  # 60 prompt tokens decoding to 15 blocks: a run to kill in


def lmdb_config(path: Path, **extra: Any) -> dict[str, Any]:
    return {"kind": "lmdb", "path": str(path), "capacity": "64MiB", **extra}


def lmdb_blocks(path: Path) -> tuple[int, int]:
    """(blocks that decode, blocks that do not) in the LMDB at ``path``, read directly."""
    tier = LmdbTier(path, 64 << 20)
    try:
        keys = tier.lru_keys()
        good = bad = 0
        for value in tier.get_many(keys):
            try:
                decode_block(value)  # type: ignore[arg-type]
                good += 1
            except CodecError:
                bad += 1
        return good, bad
    finally:
        tier.close()


def restart_loads(model_dir: str, lmdb: dict[str, Any], prompts: list[list[int]]
                  ) -> tuple[list[list[int]], dict[str, Any]]:
    """A fresh engine over ``lmdb``: its tokens for ``prompts`` (one at a time) and kv_stats."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(model_dir, num_gpu_blocks=16, dtype="float32", device="cpu", kv_offload=True,
             kv_offload_config=offload(lmdb)) as llm:
        ids = [list(llm.generate([p], params)[0].token_ids) for p in prompts]
        return ids, llm.kv_stats()


def test_sigkill_keeps_every_acknowledged_block_and_shows_no_torn_one(
    model_dir: str, reference: list[list[int]], tmp_path: Path  # noqa: F811
) -> None:
    lmdb = lmdb_config(tmp_path / "lmdb")
    steps = phases()
    proc = spawn(model_dir, [{"offload": offload(lmdb), "phases": steps[:2] + LONG + steps[2:]}])
    try:
        assert proc.stdout is not None
        acked = [json.loads(proc.stdout.readline()) for _ in range(2)]
        proc.send_signal(signal.SIGKILL)  # in the middle of the long run
        assert proc.wait(30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # generate() returned only once its blocks were written through: acknowledged.
    acked_blocks = acked[-1]["kv"]["tiers"]["lmdb"]["written_through"]
    assert acked_blocks >= (len(PROMPTS[0]) + len(PROMPTS[1])) // 16
    good, bad = lmdb_blocks(tmp_path / "lmdb")
    assert bad == 0 and good >= acked_blocks
    ids, kv = restart_loads(model_dir, lmdb, PROMPTS[:2])
    assert ids == reference[:2]
    assert kv["loaded_tokens"] == sum(len(p) // 16 * 16 for p in PROMPTS[:2])
    assert kv["recomputed_tokens"] == 0 and kv["failed_loads"] == 0


def test_sigterm_of_kvtier_serve_flushes_host_blocks_to_lmdb(
    model_dir: str, reference: list[list[int]], tmp_path: Path  # noqa: F811
) -> None:
    lmdb = lmdb_config(tmp_path / "lmdb", write_policy="write_back")
    (tmp_path / "offload.json").write_text(json.dumps(offload(lmdb)))  # YAML is a JSON superset
    port = free_port()
    cmd = [sys.executable, "-m", "engine.cli", "serve", "--model", model_dir, "--port", str(port),
           "--served-model-name", "tiny", "--device", "cpu", "--num-gpu-blocks", "16",
           "--dtype", "float32", "--log-level", "warning", "--engine-num-threads", "1",
           "--kv-offload", "--kv-offload-config", str(tmp_path / "offload.json")]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, "kvtier serve exited early"
            assert time.monotonic() < deadline, "kvtier serve did not come up"
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        for prompt in PROMPTS:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS,
                    "temperature": 0.0, "ignore_eos": True}
            reply = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
            assert reply.status_code == 200, reply.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # Write-back LMDB under a host tier that never evicted: only the drain put blocks there.
    good, bad = lmdb_blocks(tmp_path / "lmdb")
    assert bad == 0 and good >= sum(len(p) // 16 for p in PROMPTS)
    ids, kv = restart_loads(model_dir, lmdb, PROMPTS)
    assert ids == reference[:4]
    assert kv["loaded_tokens"] == sum(len(p) // 16 * 16 for p in PROMPTS)
    assert kv["recomputed_tokens"] == 0 and kv["failed_loads"] == 0
