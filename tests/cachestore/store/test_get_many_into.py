"""HierarchicalStore.get_many_into: reads into the caller's buffers, byte-identical to
get_many_encoded; misses, corrupt values (a miss, deleted), blocks too large for their buffer,
promotion from one copy of the store's own, and promotion of owned tier views without a copy."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cachestore.codec import encode_block, encoded_size
from cachestore.store.hierarchical import HierarchicalStore, StoreConfig
from tests.cachestore.store_helpers import KEYS, META, PREFIX, counters, payload
from tiers import build_tiers
from tiers.base import Evicted, Value
from tiers.config import parse_tier_config
from tiers.host import HostTier
from tiers.lmdb import LmdbTier

SIZE = encoded_size(META, keyed=True)


def kblock(i: int) -> bytes:
    """The block of KEYS[i], carrying its key (format version 2, what the engine writes)."""
    return encode_block(payload(i), META, key=KEYS[i])


def bufs(n: int, size: int = SIZE) -> list[bytearray]:
    return [bytearray(b"\xee" * size) for _ in range(n)]


def filled(tmp_path: Path, **config: Any) -> HierarchicalStore:
    """Host (4 blocks) over LMDB (6): KEYS[0:4] only in LMDB, KEYS[4:8] in the host tier."""
    tiers = [HostTier(4 * SIZE, SIZE), LmdbTier(tmp_path / "db", 6 * SIZE)]
    store = HierarchicalStore(tiers, StoreConfig(namespace=PREFIX, **config))
    for i in range(8):
        store.put_many([(KEYS[i], kblock(i))])
    store.flush()
    host, lmdb = store.tiers
    assert host.lru_keys() == KEYS[4:8] and lmdb.lru_keys() == KEYS[0:4]
    return store


def test_byte_identical_to_get_many_encoded_for_every_buffer_kind(tmp_path: Path) -> None:
    store = filled(tmp_path, promote_on_get=False)
    keys = [KEYS[5], KEYS[1], KEYS[14], KEYS[6], KEYS[0]]  # host, lmdb, absent, host, lmdb
    want = [None if v is None else bytes(v) for v in store.get_many_encoded(keys)]
    staging = bytearray(len(keys) * (SIZE + 16))
    rows = np.zeros((len(keys), SIZE + 8), dtype=np.uint8)
    for out in (
        bufs(len(keys)),
        [memoryview(staging)[j * (SIZE + 16) : (j + 1) * (SIZE + 16)] for j in range(len(keys))],
        list(rows),
    ):
        lengths = store.get_many_into(keys, out)
        assert lengths == [None if w is None else SIZE for w in want]
        for buf, n, w in zip(out, lengths, want, strict=True):
            if w is not None:
                assert bytes(memoryview(buf).cast("B")[:n]) == w
    assert want[0] == kblock(5) and want[1] == kblock(1) and want[2] is None
    store.close()


def test_counts_hits_and_misses_per_tier(tmp_path: Path) -> None:
    store = filled(tmp_path, promote_on_get=False)
    out = bufs(4)
    assert store.get_many_into([KEYS[5], KEYS[1], KEYS[14], KEYS[0]], out) == [
        SIZE,
        SIZE,
        None,
        SIZE,
    ]
    # host: 1 hit, 3 misses (absent at pin time); lmdb: asked for those 3, 2 hits.
    assert counters(store, "hits") == [1, 2] and counters(store, "misses") == [3, 1]
    assert counters(store, "bytes_read") == [SIZE, 2 * SIZE]
    assert counters(store, "promotions") == [0, 0]
    assert store.tiers[0].num_pins() == 0  # the host pins taken for the copy are released
    store.close()


def test_misses_leave_buffers_alone(tmp_path: Path) -> None:
    store = filled(tmp_path)
    out = bufs(2)
    assert store.get_many_into([KEYS[12], KEYS[13]], out) == [None, None]
    assert out == bufs(2)
    assert store.get_many_into([], []) == []
    store.close()


def test_corrupt_value_in_lmdb_is_a_miss_and_deleted(tmp_path: Path) -> None:
    store = filled(tmp_path)
    host, lmdb = store.tiers
    bad = bytearray(kblock(1))
    bad[-20] ^= 0x01  # a flipped payload bit: the checksum fails
    lmdb.put_many([(KEYS[1], bytes(bad)), (KEYS[2], kblock(3))])  # KEYS[2] holds KEYS[3]'s block
    out = bufs(3)
    assert store.get_many_into([KEYS[1], KEYS[2], KEYS[0]], out) == [None, None, SIZE]
    assert counters(store, "corrupt") == [0, 2] and counters(store, "wrong_key") == [0, 1]
    assert lmdb.contains_many([KEYS[1], KEYS[2], KEYS[0]]) == [False, False, True]
    store.flush()
    assert not host.contains(KEYS[1]) and not host.contains(KEYS[2])  # nothing promoted
    assert host.contains(KEYS[0])
    store.close()


def test_corrupt_host_value_falls_through_to_lmdb_and_is_deleted(tmp_path: Path) -> None:
    store = filled(tmp_path, promote_on_get=False)
    host, lmdb = store.tiers
    lmdb.put_many([(KEYS[5], kblock(5))])
    bad = bytearray(kblock(5))
    bad[40] ^= 0xFF
    host.put_many([(KEYS[5], bytes(bad))])
    out = bufs(1)
    assert store.get_many_into([KEYS[5]], out) == [SIZE]
    assert bytes(out[0]) == kblock(5)  # LMDB's good copy overwrote the corrupt one
    assert counters(store, "corrupt") == [1, 0]
    assert not host.contains(KEYS[5]) and host.num_pins() == 0  # deleted once unpinned
    store.close()


def test_block_larger_than_its_buffer(tmp_path: Path) -> None:
    store = filled(tmp_path)
    small = [bytearray(b"\xee" * (SIZE - 1)), bytearray(SIZE)]
    assert store.get_many_into([KEYS[1], KEYS[2]], small) == [SIZE, SIZE]
    assert small[0] == bytearray(b"\xee" * (SIZE - 1))  # nothing written
    assert bytes(small[1]) == kblock(2)
    assert counters(store, "misses")[1] == 1 and counters(store, "hits")[1] == 1
    store.flush()
    assert not store.tiers[0].contains(KEYS[1]) and store.tiers[0].contains(KEYS[2])
    store.close()


def test_bad_buffers_raise_one_line(tmp_path: Path) -> None:
    store = filled(tmp_path)
    with pytest.raises(ValueError, match=r"^get_many_into: 2 keys but 1 buffers$"):
        store.get_many_into(KEYS[:2], bufs(1))
    with pytest.raises(ValueError, match=r"^get_many_into: buffer 0 is read-only$"):
        store.get_many_into(KEYS[:1], [bytes(SIZE)])
    assert counters(store, "hits") == [0, 0] and counters(store, "misses") == [0, 0]
    store.close()


class GatedHost(HostTier):
    """A host tier whose put_many waits for ``gate`` and records what it was given."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.gate.set()
        self.given: list[Value] = []

    def put_many(self, items: Sequence[tuple[str, Value]]) -> list[Evicted]:
        assert self.gate.wait(30)
        self.given.extend(v for _, v in items)
        return super().put_many(items)


def gated_store(tmp_path: Path, lmdb_cls: type[LmdbTier] = LmdbTier) -> HierarchicalStore:
    host = GatedHost(8 * SIZE, SIZE)
    store = HierarchicalStore(
        [host, lmdb_cls(tmp_path / "db", 8 * SIZE)], StoreConfig(namespace=PREFIX)
    )
    store.tiers[1].put_many([(KEYS[i], kblock(i)) for i in range(4)])
    return store


def test_promotion_copies_once_and_survives_buffer_reuse(tmp_path: Path) -> None:
    store = gated_store(tmp_path)
    host = store.tiers[0]
    host.gate.clear()  # the promotion waits until the caller has reused its buffers
    out = bufs(2)
    assert store.get_many_into([KEYS[0], KEYS[3]], out) == [SIZE, SIZE]
    assert [bytes(b) for b in out] == [kblock(0), kblock(3)]
    for buf in out:
        buf[:] = b"\0" * SIZE
    host.gate.set()
    store.flush()
    assert counters(store, "promotions") == [2, 0]
    assert [bytes(v) for v in host.get_many([KEYS[0], KEYS[3]])] == [kblock(0), kblock(3)]
    assert all(isinstance(v, memoryview) for v in host.given)  # the store's one copy, as is
    assert store.get_many_into([KEYS[0]], bufs(1)) == [SIZE]
    assert counters(store, "hits") == [1, 2]
    store.close()


def test_a_read_asked_not_to_promote_leaves_the_top_tier_alone(tmp_path: Path) -> None:
    store = filled(tmp_path)
    out = bufs(2)
    assert store.get_many_into([KEYS[0], KEYS[3]], out, promote=False) == [SIZE, SIZE]
    assert [bytes(b) for b in out] == [kblock(0), kblock(3)]
    store.flush()
    assert counters(store, "promotions") == [0, 0]
    assert store.tiers[0].lru_keys() == KEYS[4:8]  # nothing evicted to make room
    assert store.get_many_into([KEYS[0]], bufs(1)) == [SIZE]  # the default still promotes
    store.flush()
    assert counters(store, "promotions") == [1, 0] and KEYS[0] in store.tiers[0].lru_keys()
    store.close()


class CopyingLmdb(LmdbTier):
    """An LMDB tier claiming its views die at its next call (as the remote tier's do)."""

    owns_read_values = False


@pytest.mark.parametrize(("lmdb_cls", "kind"), [(LmdbTier, memoryview), (CopyingLmdb, bytes)])
def test_get_many_promotes_owned_views_without_a_copy(
    tmp_path: Path, lmdb_cls: type[LmdbTier], kind: type
) -> None:
    store = gated_store(tmp_path, lmdb_cls)
    host = store.tiers[0]
    got = store.get_many_encoded([KEYS[1], KEYS[2]])
    assert [bytes(v) for v in got] == [kblock(1), kblock(2)]  # type: ignore[arg-type]
    del got
    store.flush()
    assert [type(v) for v in host.given] == [kind, kind]
    assert [bytes(v) for v in host.get_many([KEYS[1], KEYS[2]])] == [kblock(1), kblock(2)]
    # Staging (the connector's lower-tier load) writes the views too, then pins them.
    assert store.stage_host([KEYS[3]]) == 1
    assert type(host.given[-1]) is kind and bytes(host.get_many([KEYS[3]])[0]) == kblock(3)
    store.unpin_host([KEYS[3]])
    store.close()


def test_redis_below_lmdb(tmp_path: Path, redis_config: dict[str, Any]) -> None:
    cfg = parse_tier_config(
        {
            "tiers": [
                {"kind": "host", "capacity": f"{4 * SIZE}B", "slot_bytes": f"{SIZE}B"},
                {"kind": "lmdb", "path": str(tmp_path / "db"), "capacity": f"{8 * SIZE}B"},
                {**redis_config, "read_connections": 2},
            ]
        }
    )
    store = HierarchicalStore(build_tiers(cfg), StoreConfig(namespace=PREFIX))
    host, lmdb, redis = store.tiers
    redis.put_many([(KEYS[i], kblock(i)) for i in range(6)])
    bad = bytearray(kblock(5))
    bad[-1] ^= 1
    redis.put_many([(KEYS[5], bytes(bad))])
    lmdb.put_many([(KEYS[0], kblock(0))])
    keys = [KEYS[0], KEYS[1], KEYS[4], KEYS[5], KEYS[9]]
    want = [
        None if v is None else bytes(v) for v in store.get_many_encoded(keys)
    ]  # reads KEYS[5] first: corrupt, deleted
    assert want == [kblock(0), kblock(1), kblock(4), None, None]
    redis.put_many([(KEYS[5], bytes(bad))])
    store.flush()
    out = bufs(len(keys))
    lengths = store.get_many_into(keys, out)
    assert lengths == [SIZE, SIZE, SIZE, None, None]
    assert [bytes(b) for b, n in zip(out, lengths, strict=True) if n] == want[:3]
    assert counters(store, "corrupt") == [0, 0, 2]
    assert redis.contains_many([KEYS[5], KEYS[4]]) == [False, True]
    store.flush()
    assert host.contains_many(keys[:3]) == [True, True, True]  # promoted from LMDB and Redis
    store.close()
