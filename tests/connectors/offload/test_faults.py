"""Faults under ``kv_offload``: corrupt values planted in LMDB, Redis and S3 behind the tier's
back, and a Redis / S3 server killed in the middle of a run. Outputs stay identical to the
no-offload engine, no request fails, and the failed loads are counted exactly."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest

from cachestore.hashing import Namespace, block_key, hash_request_tokens
from engine import LLM
from tests.connectors.offload.test_connector import GREEDY, VOCAB, make_llm

USERS = 6


def prompts(seed: int = 9) -> list[list[int]]:
    """Six 40-token prompts: two full blocks each can be loaded (the last token is computed)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(40)] for _ in range(USERS)]


@pytest.fixture(scope="module")
def reference(model_dir: str) -> list[list[int]]:
    llm = make_llm(model_dir, 24)
    return [list(o.token_ids) for o in llm.generate(prompts(), GREEDY)]


def generate(llm: LLM) -> list[list[int]]:
    return [list(o.token_ids) for o in llm.generate(prompts(), GREEDY)]


def second_block_keys(llm: LLM) -> list[str]:
    ns = Namespace(model_fingerprint=llm.engine.runner.model_fingerprint)
    return [block_key(ns, hash_request_tokens(ns, p)[1]) for p in prompts()]


def flip(value: bytes) -> bytes:
    out = bytearray(value)
    out[len(out) // 2] ^= 0x10  # inside the payload: the checksum catches it
    return bytes(out)


def plant_lmdb(tier: dict[str, Any], keys: list[str]) -> None:
    import lmdb

    env = lmdb.open(tier["path"], max_dbs=2)
    db = env.open_db(b"blocks")
    with env.begin(write=True, db=db) as txn:
        for key in keys:
            txn.put(key.encode(), flip(txn.get(key.encode())))
    env.close()


def plant_redis(tier: dict[str, Any], keys: list[str]) -> None:
    import redis

    raw = redis.Redis.from_url(str(tier["url"]))
    for key in keys:
        name = "kvtier:" + key
        raw.set(name, flip(raw.get(name)))
    raw.close()


def plant_s3(tier: dict[str, Any], keys: list[str], s3: Any) -> None:
    bucket, prefix = tier["bucket"], tier["prefix"]
    for key in keys:
        pointer = msgpack.unpackb(
            s3.get_object(Bucket=bucket, Key=f"{prefix}k/{key}")["Body"].read()
        )
        i = pointer["k"].index(key)
        group = bytearray(s3.get_object(Bucket=bucket, Key=pointer["g"])["Body"].read())
        off, n = pointer["o"][i], pointer["n"][i]
        group[off : off + n] = flip(bytes(group[off : off + n]))
        s3.put_object(Bucket=bucket, Key=pointer["g"], Body=bytes(group))


@pytest.mark.parametrize("kind", ["lmdb", "redis", "s3"])
def test_corrupt_second_blocks_are_recomputed_from_there(
    model_dir: str,
    reference: list[list[int]],
    kind: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    if kind == "lmdb":
        tier: dict[str, Any] = {"kind": "lmdb", "path": str(tmp_path / "lmdb"), "capacity": "64MiB"}
    else:
        tier = dict(request.getfixturevalue(f"{kind}_config"))
    config = {"decision": "load", "tiers": [tier]}
    with make_llm(model_dir, 24, config) as first:
        assert generate(first) == reference
        keys = second_block_keys(first)
    if kind == "lmdb":
        plant_lmdb(tier, keys)
    elif kind == "redis":
        plant_redis(tier, keys)
    else:
        plant_s3(tier, keys, request.getfixturevalue("s3_server").client())
    with make_llm(model_dir, 24, config) as llm:  # restarted: everything must come from `kind`
        assert generate(llm) == reference
        kv = llm.kv_stats()
    # Each prompt: block 0 loads, block 1 is corrupt -> recomputed from token 16 on.
    assert kv["num_loads"] == USERS and kv["failed_loads"] == USERS
    assert kv["loaded_tokens"] == 16 * USERS and kv["recomputed_tokens"] == 16 * USERS
    assert kv["tiers"][kind]["hit_blocks"] == USERS
    (row,) = kv["store"]["tiers"]
    assert row["corrupt"] == USERS


def kill_after_first_hit(llm: LLM, kill: Callable[[], None]) -> list[int]:
    """Kill the tier's server right after the first lookup that finds blocks: the planned load
    then reads from a dead server. Returns a list that counts the kills."""
    store = llm.engine.offload.store  # type: ignore[union-attr]
    lookup = store.lookup
    killed: list[int] = []

    def lookup_then_kill(keys: Any) -> Any:
        found = lookup(keys)
        if found.num_blocks and not killed:
            kill()
            killed.append(1)
        return found

    store.lookup = lookup_then_kill  # type: ignore[method-assign]
    return killed


@pytest.mark.parametrize("kind", ["redis", "s3"])
def test_tier_server_killed_mid_run(
    model_dir: str, reference: list[list[int]], kind: str, request: pytest.FixtureRequest
) -> None:
    server = request.getfixturevalue(f"{kind}_server")
    if not server.managed:
        pytest.skip("an external server cannot be killed")
    tier = dict(request.getfixturevalue(f"{kind}_config"))
    if kind == "redis":
        tier.update(socket_timeout_s=0.5, connect_timeout_s=0.5)
    else:
        tier.update(timeout_s=1.0, connect_timeout_s=0.5, max_attempts=1)
    config = {"decision": "load", "load_timeout_s": 3.0, "tiers": [tier]}
    with make_llm(model_dir, 24, config) as first:
        assert generate(first) == reference
    try:
        with make_llm(model_dir, 24, config) as llm:
            killed = kill_after_first_hit(llm, server.kill if kind == "redis" else server.stop)
            assert generate(llm) == reference  # every request finishes, same tokens
            assert killed == [1]
            kv = llm.kv_stats()
            assert kv["num_loads"] >= 1 and kv["failed_loads"] == kv["num_loads"]
            assert kv["loaded_tokens"] == 0
            assert kv["store"]["tiers"][0]["errors"] >= 1
            # The server stays down: saves and lookups fail quietly, outputs do not change.
            assert generate(llm) == reference
    finally:
        server.ensure_running()
