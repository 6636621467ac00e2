"""Issue 17, crash and shutdown: what an engine acknowledged to LMDB survives a SIGKILL (and no
torn block is visible), and a SIGTERM of ``kvtier serve`` drains: the blocks its host tier held
are in LMDB afterwards, although LMDB is write-back there (only the shutdown flush moves them).
Before that, the same ``kvtier serve`` is the prefill engine of a disaggregated pair: an idle
engine saves its last blocks at once and copies them to the cache server.

Every engine has a 256 MiB host tier in front (it never evicts here); the restarted engine runs
in this process over the same LMDB files (``decision: load``) and must load every full block of
the prompts the dead one acknowledged, with the outputs of an engine without offload.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from cachestore.codec import CodecError, decode_block
from cachestore.hashing import block_key, hash_request_tokens
from engine import SamplingParams
from tests.connectors.offload.test_connector import make_llm
from tests.connectors.offload.test_write_policy import (
    DISAGG,
    MAX_TOKENS,
    PROMPTS,
    ROOT,
    cache_server,  # noqa: F401 - fixtures, shared
    offload,
    phases,
    reference,  # noqa: F401
    spawn,
)
from tests.servers import free_port, python_env, wait_until_healthy
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


def restart_loads(
    model_dir: str, lmdb: dict[str, Any], prompts: list[list[int]]
) -> tuple[list[list[int]], dict[str, Any]]:
    """A fresh engine over ``lmdb``: its tokens for ``prompts`` (one at a time) and kv_stats."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with make_llm(model_dir, 16, offload(lmdb)) as llm:
        ids = [list(llm.generate([p], params)[0].token_ids) for p in prompts]
        return ids, llm.kv_stats()


def test_sigkill_keeps_every_acknowledged_block_and_shows_no_torn_one(
    model_dir: str,
    reference: list[list[int]],  # noqa: F811
    tmp_path: Path,  # noqa: F811
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


def test_kvtier_serve_prefills_for_a_decode_engine_and_drains_on_sigterm(
    model_dir: str,
    reference: list[list[int]],  # noqa: F811
    tmp_path: Path,  # noqa: F811
    cache_server: dict[str, Any],  # noqa: F811
) -> None:
    """``kvtier serve`` A (host 256 MiB, LMDB write-back, the cache server write-through) serves
    the prompts, the disaggregated ones with ``max_tokens=1``; an engine B (host tier + the cache
    server, this process) decodes those from A's KV while A still runs; then SIGTERM: A's host
    blocks are in LMDB (only the drain writes there) and a restart loads them."""
    lmdb = lmdb_config(tmp_path / "lmdb", write_policy="write_back")
    (tmp_path / "offload.json").write_text(json.dumps(offload(lmdb, cache_server)))
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "engine.cli",
        "serve",
        "--model",
        model_dir,
        "--port",
        str(port),
        "--served-model-name",
        "tiny",
        "--device",
        "cpu",
        "--num-gpu-blocks",
        "16",
        "--dtype",
        "float32",
        "--log-level",
        "warning",
        "--engine-num-threads",
        "1",
        "--kv-offload",
        "--kv-offload-config",
        str(tmp_path / "offload.json"),
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=python_env())
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until_healthy(base, proc, 60)
        for prompt, max_tokens in phases(max_disagg=1):
            body = {
                "model": "tiny",
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
            }
            reply = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
            assert reply.status_code == 200, reply.text
        decoded, loaded = decode_elsewhere(model_dir, cache_server)
        assert decoded == reference[4:]
        assert loaded == sum(len(p) // 16 * 16 for p in DISAGG)
        # A's /metrics count its copies although it went idle before they ran (the core sends
        # its stats once more a second after going idle).
        blocks = sum(len(p) // 16 for p in PROMPTS + DISAGG)
        assert written_through(base, "remote", blocks) >= blocks
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # Write-back LMDB under a host tier that never evicted: only the drain put blocks there.
    good, bad = lmdb_blocks(tmp_path / "lmdb")
    assert bad == 0 and good >= sum(len(p) // 16 for p in PROMPTS + DISAGG)
    ids, kv = restart_loads(model_dir, lmdb, PROMPTS)
    assert ids == reference[:4]
    assert kv["loaded_tokens"] == sum(len(p) // 16 * 16 for p in PROMPTS)
    assert kv["recomputed_tokens"] == 0 and kv["failed_loads"] == 0


def written_through(base: str, tier: str, at_least: int, timeout_s: float = 10.0) -> float:
    """``kvtier_kv_tier_written_through_total{tier=...}`` from ``base``'s /metrics, polled until
    it reaches ``at_least`` or ``timeout_s`` passed (then its last value)."""
    pattern = re.compile(
        r'^kvtier_kv_tier_written_through_total\{[^}]*tier="'
        + re.escape(tier)
        + r'"[^}]*\} (\S+)$',
        re.M,
    )
    deadline = time.monotonic() + timeout_s
    while True:
        found = pattern.search(httpx.get(f"{base}/metrics", timeout=5).text)
        value = float(found.group(1)) if found else 0.0
        if value >= at_least or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


def decode_elsewhere(model_dir: str, remote: dict[str, Any]) -> tuple[list[list[int]], int]:
    """Engine B: waits (up to 20 s) until the cache server holds every full block of the
    DISAGG prompts (A copies them after its replies), then decodes them; (tokens, loaded)."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with make_llm(model_dir, 16, offload(remote)) as llm:
        ns = llm.engine.namespace
        keys = [[block_key(ns, h) for h in hash_request_tokens(ns, p)] for p in DISAGG]
        store = llm.engine.offload.store  # type: ignore[union-attr]
        deadline = time.monotonic() + 20
        while any(store.lookup(k).num_blocks < len(k) for k in keys):
            assert time.monotonic() < deadline, "the prefill engine's blocks never arrived"
            time.sleep(0.05)
        ids = [list(llm.generate([p], params)[0].token_ids) for p in DISAGG]
        kv = llm.kv_stats()
        assert kv["recomputed_tokens"] == 0 and kv["tiers"]["remote"]["hit_blocks"] > 0
        return ids, kv["loaded_tokens"]
