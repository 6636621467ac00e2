"""Chained block hashing: determinism across processes, namespace isolation, chain property."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from cachestore.hashing import (
    BlockHash,
    Namespace,
    block_key,
    hash_block_tokens,
    hash_request_tokens,
    sha256,
    store_prefix_of,
    xxh128,
)

TOKENS = [(7 * i + 3) % 50_000 for i in range(16 * 5 + 7)]  # 5 full blocks + 7 tokens
BASE = Namespace(model_fingerprint="llama-tiny:abc:float16")


def test_partial_blocks_are_not_hashed() -> None:
    assert len(hash_request_tokens(BASE, TOKENS)) == 5
    assert hash_request_tokens(BASE, TOKENS[:15]) == []
    assert hash_request_tokens(BASE, TOKENS[:80]) == hash_request_tokens(BASE, TOKENS)


def test_chain_definition_and_parent_resume() -> None:
    hashes = hash_request_tokens(BASE, TOKENS)
    prev = BASE.seed()
    for i, h in enumerate(hashes):
        prev = hash_block_tokens(prev, TOKENS[16 * i : 16 * (i + 1)], None, sha256)
        assert h == prev
    # h[0] is H(seed || 16 int32 LE), exactly as DESIGN.md writes it.
    import hashlib
    import struct

    raw = BASE.seed() + struct.pack("<16i", *TOKENS[:16])
    assert hashes[0] == hashlib.sha256(raw).digest()
    assert hash_request_tokens(BASE, TOKENS[32:], parent=hashes[1]) == hashes[2:]


@pytest.mark.parametrize("i", [0, 15, 16, 40, 79])
def test_changing_token_i_changes_hashes_from_its_block_on(i: int) -> None:
    before = hash_request_tokens(BASE, TOKENS)
    changed = list(TOKENS)
    changed[i] += 1
    after = hash_request_tokens(BASE, changed)
    b = i // 16
    assert after[:b] == before[:b]
    assert all(x != y for x, y in zip(after[b:], before[b:], strict=True))
    assert len(after) == len(before) == 5


def test_token_in_partial_tail_changes_nothing() -> None:
    changed = list(TOKENS)
    changed[85] += 1
    assert hash_request_tokens(BASE, changed) == hash_request_tokens(BASE, TOKENS)


@pytest.mark.parametrize(
    "change",
    [
        {"cache_salt": "tenant-b"},
        {"model_fingerprint": "llama-tiny:abd:float16"},
        {"block_size": 32},
        {"tp_rank": 1, "tp_size": 2},
        {"tp_size": 2},
        {"kv_layout_version": 2},
        {"hash_name": "xxh128"},
    ],
)
def test_every_namespace_field_changes_every_key(change: dict) -> None:
    other = dataclasses.replace(BASE, **change)
    tokens = TOKENS[: 16 * 4 * (2 if other.block_size == 32 else 1)]
    mine = hash_request_tokens(BASE, TOKENS[:64])
    theirs = hash_request_tokens(other, tokens)
    assert BASE.seed() != other.seed()
    assert BASE.key_prefix() != other.key_prefix()
    assert not set(mine) & set(theirs)
    mine_keys = {block_key(BASE, h) for h in mine}
    assert not mine_keys & {block_key(other, h) for h in theirs}


def test_hash_functions() -> None:
    xx = dataclasses.replace(BASE, hash_name="xxh128")
    assert all(len(h) == 16 for h in hash_request_tokens(xx, TOKENS))
    assert all(len(h) == 32 for h in hash_request_tokens(BASE, TOKENS))
    assert xxh128(b"a") != xxh128(b"b")
    with pytest.raises(ValueError, match="unknown block hash 'md5'"):
        Namespace(model_fingerprint="m", hash_name="md5")


def test_extra_keys_change_the_key() -> None:
    plain = hash_request_tokens(BASE, TOKENS[:32])
    lora = hash_request_tokens(BASE, TOKENS[:32], extra_keys=[["lora:7"], None])
    assert lora[0] != plain[0] and lora[1] != plain[1]  # the chain carries the change on
    other = hash_request_tokens(BASE, TOKENS[:32], extra_keys=[["lora:8"], None])
    assert other[0] != lora[0]
    assert hash_request_tokens(BASE, TOKENS[:32], extra_keys=[None, ["img:1"]])[0] == plain[0]
    assert hash_request_tokens(BASE, TOKENS[:32], extra_keys=[[], None]) == plain


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="int32"):
        hash_block_tokens(BlockHash(b""), [2**31] * 16)
    with pytest.raises(ValueError, match="tp_rank 2 out of range"):
        Namespace(model_fingerprint="m", tp_rank=2, tp_size=2)
    with pytest.raises(ValueError, match="block_size must be positive"):
        Namespace(model_fingerprint="m", block_size=0)


_CHILD = """
import json, sys
from cachestore.hashing import Namespace, hash_request_tokens, block_key
tokens = json.loads(sys.argv[1])
out = {}
for name in ("sha256", "xxh128"):
    ns = Namespace(model_fingerprint="llama-tiny:abc:float16", cache_salt="s", hash_name=name)
    out[name] = [block_key(ns, h) for h in hash_request_tokens(ns, tokens)]
print(json.dumps(out))
"""


def test_keys_identical_in_a_fresh_interpreter() -> None:
    repo = Path(__file__).parents[2]
    # A different PYTHONHASHSEED would expose any use of Python's hash().
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(TOKENS)],
        cwd=repo,
        env={"PYTHONHASHSEED": "12345", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    child = json.loads(proc.stdout)
    for name in ("sha256", "xxh128"):
        ns = Namespace(model_fingerprint="llama-tiny:abc:float16", cache_salt="s", hash_name=name)
        assert child[name] == [block_key(ns, h) for h in hash_request_tokens(ns, TOKENS)]
        assert len(child[name]) == 5


def test_a_key_prefix_without_its_head_range_is_the_store_prefix() -> None:
    """What the cache daemon checks a head slice's block against: its model's namespace, the
    same for every slice (a TP=2 rank's block names ``ns``, its key ``ns.h0-1/...``)."""
    sliced = dataclasses.replace(BASE, kv_heads=(2, 4))
    assert sliced.key_prefix() == BASE.key_prefix() + ".h2-4"
    assert store_prefix_of(sliced.key_prefix()) == sliced.store_prefix() == BASE.key_prefix()
    assert store_prefix_of(BASE.key_prefix()) == BASE.key_prefix()
    assert store_prefix_of("tenant.h1x") == "tenant.h1x"  # not a head range: left alone
