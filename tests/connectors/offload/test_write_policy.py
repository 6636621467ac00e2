"""Issue 17: with the default write policy, what one engine process computes reaches LMDB,
Redis, S3 and a ``kvtier cache-server`` although a 256 MiB host tier sits in front of each (it
never evicts here), and a second engine process loads it, with outputs identical to an engine
without offload.

Two engine processes (``tests/connectors/offload/engine_child.py``), real servers (LMDB files,
redis-server, moto's S3, a ``kvtier cache-server`` subprocess), ``decision: load``:

- A runs four prompts of 85-150 tokens on three engines: host+LMDB (closed: a restart),
  host+Redis+S3 and host+cache server (both still running while B reads), the last one also
  prefilling two more prompts only (``max_tokens=1``: the prefill engine of a disaggregated
  pair);
- B, a fresh process, runs the same prompts over host+LMDB, host+Redis, host+S3 and
  host+cache server: every full prompt block is loaded, from the one shared tier each has, and
  B decodes the prefilled prompts from A's KV, token for token as a single engine would.

And in this process: ``write_through_selective`` copies only the blocks an engine reloads.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine import SamplingParams
from tests.connectors.offload.test_connector import make_llm
from tests.servers import cache_server_process

ROOT = Path(__file__).resolve().parents[3]
HOST = {"kind": "host", "capacity": "256MiB"}
MAX_TOKENS = 8
rng = random.Random(17)
PROMPTS = [[rng.randrange(3, 500) for _ in range(n)] for n in (85, 103, 129, 150)]
DISAGG = [[rng.randrange(3, 500) for _ in range(n)] for n in (97, 140)]
FULL_BLOCK_TOKENS = sum(len(p) // 16 * 16 for p in PROMPTS)  # 448: 28 blocks


def offload(*tiers: dict[str, Any]) -> dict[str, Any]:
    return {"decision": "load", "calibrate": False, "tiers": [HOST, *tiers]}


def spawn(model: str, engines: list[dict[str, Any]]) -> subprocess.Popen[str]:
    spec = json.dumps({"model": model, "engines": engines})
    return subprocess.Popen(
        [sys.executable, "-m", "tests.connectors.offload.engine_child", spec],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def read_until(proc: subprocess.Popen[str], key: str) -> list[dict[str, Any]]:
    """The child's JSON lines up to (not including) the one holding ``key``."""
    assert proc.stdout is not None
    lines = []
    while True:
        line = proc.stdout.readline()
        assert line, f"engine process exited ({proc.wait(30)}) before {key!r}"
        msg = json.loads(line)
        if key in msg:
            return lines
        lines.append(msg)


def run(model: str, engines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    proc = spawn(model, engines)
    try:
        lines = read_until(proc, "done")
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return lines


def phases(max_disagg: int | None = None) -> list[tuple[list[int], int]]:
    out = [(p, MAX_TOKENS) for p in PROMPTS]
    if max_disagg is not None:
        out += [(p, max_disagg) for p in DISAGG]
    return out


@pytest.fixture(scope="module")
def reference(model_dir: str) -> list[list[int]]:
    """Greedy tokens of every prompt (the disaggregated ones too) without offload."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with make_llm(model_dir, 16) as llm:
        return [list(llm.generate([p], params)[0].token_ids) for p in PROMPTS + DISAGG]


@pytest.fixture
def cache_server(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A ``kvtier cache-server`` process; yields its remote tier config."""
    with cache_server_process(tmp_path, "tok-wp-17", "wp", data_subdir="server") as port:
        yield {
            "kind": "remote",
            "url": f"tcp://127.0.0.1:{port}",
            "token": "tok-wp-17",
            "timeout_s": 10,
        }


def test_a_second_process_loads_what_the_first_computed_behind_a_256mib_host_tier(
    model_dir: str,
    reference: list[list[int]],
    tmp_path: Path,
    cache_server: dict[str, Any],
    redis_config: dict[str, Any],
    s3_config: dict[str, Any],
) -> None:
    lmdb = {"kind": "lmdb", "path": str(tmp_path / "lmdb"), "capacity": "64MiB"}
    a = spawn(
        model_dir,
        [
            {"offload": offload(lmdb), "phases": phases()},
            {"offload": offload(redis_config, s3_config), "phases": phases(), "hold": True},
            {"offload": offload(cache_server), "phases": phases(max_disagg=1), "hold": True},
        ],
    )
    try:
        a_lines = read_until(a, "held")  # A's last two engines keep running meanwhile
        b_lines = run(
            model_dir,
            [
                {"offload": offload(lmdb), "phases": phases()},
                {"offload": offload(redis_config), "phases": phases()},
                {"offload": offload(s3_config), "phases": phases()},
                {"offload": offload(cache_server), "phases": phases(max_disagg=MAX_TOKENS)},
            ],
        )
        assert a.stdin is not None
        a.stdin.write("close\n")
        a.stdin.flush()
        read_until(a, "done")
        assert a.wait(60) == 0
    finally:
        if a.poll() is None:
            a.kill()
            a.wait()
    # A computed everything (its tiers were empty) and wrote every prompt block through: the
    # host tier evicted nothing, so none of this is the old evict-to-demote path.
    for e, shared in enumerate(("lmdb", "redis", "remote")):
        last = [m for m in a_lines if m["engine"] == e][-1]
        assert last["kv"]["loaded_tokens"] == 0
        assert last["kv"]["tiers"][shared]["written_through"] >= 28
        assert last["kv"]["tiers"][shared]["written_back"] == 0
    assert [m["ids"] for m in a_lines if m["engine"] == 0] == reference[:4]
    assert [m["ids"] for m in a_lines if m["engine"] == 2] == reference[:4] + [
        r[:1] for r in reference[4:]
    ]
    # B: every full prompt block loaded from the one shared tier it has, nothing recomputed.
    for e, shared in enumerate(("lmdb", "redis", "s3", "remote")):
        mine = [m for m in b_lines if m["engine"] == e]
        kv = mine[len(PROMPTS) - 1]["kv"]
        assert [m["ids"] for m in mine[: len(PROMPTS)]] == reference[:4], shared
        assert kv["loaded_tokens"] == FULL_BLOCK_TOKENS, shared
        assert kv["recomputed_tokens"] == 0 and kv["failed_loads"] == 0, shared
        assert kv["tiers"][shared]["hit_blocks"] == FULL_BLOCK_TOKENS // 16, shared
    # Disaggregation: B decodes the prompts A only prefilled, from A's KV, as one engine would.
    b_remote = [m for m in b_lines if m["engine"] == 3]
    assert [m["ids"] for m in b_remote[len(PROMPTS) :]] == reference[4:]
    before, after = b_remote[len(PROMPTS) - 1]["kv"], b_remote[-1]["kv"]
    assert after["loaded_tokens"] - before["loaded_tokens"] == sum(
        len(p) // 16 * 16 for p in DISAGG
    )
    assert after["recomputed_tokens"] == 0 and after["gpu_hit_tokens"] == 0


def test_selective_write_through_copies_only_blocks_reloaded_from_host(
    model_dir: str,
    reference: list[list[int]],
    tmp_path: Path,
) -> None:
    """``write_through_selective`` with one hit: a block goes to LMDB once an engine reloads it
    from the host tier, not when it is saved (in this process; the host tier never evicts)."""
    lmdb = {
        "kind": "lmdb",
        "path": str(tmp_path / "lmdb"),
        "capacity": "64MiB",
        "write_policy": "write_through_selective",
        "write_through_hits": 1,
    }
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with make_llm(model_dir, 16, offload(lmdb)) as llm:
        # PROMPTS[1:] push PROMPTS[0]'s blocks out of the 16 GPU blocks; the rerun reloads them.
        ids = [list(llm.generate([p], params)[0].token_ids) for p in PROMPTS + PROMPTS[:1]]
        kv = llm.kv_stats()
    assert ids == reference[:4] + reference[:1]
    assert kv["tiers"]["host"]["hit_blocks"] == len(PROMPTS[0]) // 16 == 5
    assert kv["tiers"]["lmdb"]["written_through"] == 5
    assert kv["loaded_tokens"] == 80 and kv["recomputed_tokens"] == 0


def test_a_running_engine_loads_what_another_engine_process_stores_in_its_lmdb_directory(
    model_dir: str, reference: list[list[int]], tmp_path: Path
) -> None:
    """Two engines of one machine on one LMDB directory (what the default config gives two
    engines of one model): B is already running when A, another process, computes the prompts;
    B then loads every full block A stored, without a restart, and writes none of them again.
    Before, B's index was the directory as B opened it: it recomputed everything."""
    lmdb = {"kind": "lmdb", "path": str(tmp_path / "lmdb"), "capacity": "64MiB"}
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with make_llm(model_dir, 16, offload(lmdb)) as b:
        a = run(model_dir, [{"offload": offload(lmdb), "phases": phases()}])
        assert [line["ids"] for line in a] == reference[:4]
        got = [list(b.generate([p], params)[0].token_ids) for p in PROMPTS]
        b.engine.flush_kv()
        kv = b.kv_stats()
    assert got == reference[:4]
    assert kv["loaded_tokens"] == FULL_BLOCK_TOKENS and kv["recomputed_tokens"] == 0, kv
    assert kv["tiers"]["lmdb"]["hit_blocks"] == FULL_BLOCK_TOKENS // 16
    assert kv["tiers"]["lmdb"]["written_through"] == 0  # A's blocks are not written again
