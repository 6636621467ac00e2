"""``Tier.get_many_into`` (reads into the caller's buffers) on every tier, the lifetime of
``get_many``'s recycled buffers, and the LMDB read path that never waits on the writer."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from tests.tiers.conftest import MIB
from tests.tiers.test_contract import KIB, chain_keys, value
from tiers.base import Tier
from tiers.buffers import ReadBuffers


@pytest.mark.parametrize("nbytes", [64 * KIB, 2 * MIB], ids=["64KiB", "2MiB"])
def test_get_many_into_slices_of_one_buffer(tier: Tier, nbytes: int) -> None:
    keys = chain_keys(4)
    vals = [value(i, nbytes) for i in range(4)]
    tier.put_many([(keys[i], vals[i]) for i in (0, 1, 3)])  # key 2 absent
    slot = nbytes + 100  # slots larger than the values: bytes past each value stay untouched
    staging = bytearray(b"\xee" * (4 * slot))
    view = memoryview(staging)
    lengths = tier.get_many_into(keys, [view[i * slot : (i + 1) * slot] for i in range(4)])
    assert lengths == [nbytes, nbytes, None, nbytes]
    for i in (0, 1, 3):
        assert staging[i * slot : i * slot + nbytes] == vals[i]
        assert staging[i * slot + nbytes : (i + 1) * slot] == b"\xee" * 100
    assert staging[2 * slot : 3 * slot] == b"\xee" * slot  # a miss writes nothing


def test_get_many_into_numpy_rows_and_a_buffer_too_small(tier: Tier) -> None:
    keys = chain_keys(2)
    vals = [value(i, 300 * KIB) for i in range(2)]
    tier.put_many(list(zip(keys, vals, strict=True)))
    rows = np.zeros((2, 300 * KIB), dtype=np.uint8)
    small = np.zeros(1000, dtype=np.uint8)
    assert tier.get_many_into(keys, [rows[0], small]) == [300 * KIB, 300 * KIB]
    assert rows[0].tobytes() == vals[0]
    assert not small.any()  # did not fit: the length says so, nothing was written


def test_get_many_into_bad_buffers_are_one_line_errors(tier: Tier) -> None:
    keys = chain_keys(2)
    with pytest.raises(ValueError, match="2 keys but 1 buffers"):
        tier.get_many_into(keys, [bytearray(10)])
    with pytest.raises(ValueError, match="buffer 1 is read-only"):
        tier.get_many_into(keys, [bytearray(10), b"0123456789"])
    assert tier.get_many_into([], []) == []


def test_get_many_values_outlive_later_calls(tier: Tier) -> None:
    """Recycled read buffers are reused only once no value of theirs is held."""
    keys = chain_keys(6)
    vals = [value(i, 1 * MIB) for i in range(6)]
    tier.put_many(list(zip(keys, vals, strict=True)))
    first = tier.get_many(keys[:3])
    for _ in range(3):
        later = tier.get_many(keys[3:])
        assert [bytes(v) for v in later] == vals[3:]  # type: ignore[arg-type]
    assert [bytes(v) for v in first] == vals[:3]  # type: ignore[arg-type]


def test_read_buffers_reuse_only_released_buffers() -> None:
    pool = ReadBuffers(max_idle_bytes=4 * MIB)
    a = pool.take(3 * MIB)
    a[:3] = b"abc"
    b = pool.take(3 * MIB)  # ``a`` is held: a second buffer
    assert a.obj is not b.obj
    assert pool.idle_bytes() == 0
    held = id(a.obj)
    del a
    assert pool.idle_bytes() == 4 * MIB  # 3 MiB rounds up to 2 MiB granules
    c = pool.take(1 * MIB)
    assert id(c.obj) == held and c.nbytes == 1 * MIB
    del b, c
    big = pool.take(9 * MIB)  # over max_idle_bytes: idle ones are dropped to make room
    assert big.nbytes == 9 * MIB and pool.idle_bytes() <= 4 * MIB
    assert pool.take(0).nbytes == 0


def test_lmdb_reads_do_not_wait_for_the_writer(tmp_path: Path) -> None:
    from tiers.lmdb import LmdbTier

    tier = LmdbTier(tmp_path / "lmdb", capacity_bytes=64 * MIB)
    try:
        keys = chain_keys(3)
        tier.put_many([(k, value(i, 4 * KIB)) for i, k in enumerate(keys)])
        got: list[object] = []
        with tier._lock:  # what the writer holds through a whole write transaction
            reader = threading.Thread(
                target=lambda: got.extend(
                    [tier.get_many(keys[:1]), tier.get_many_into(keys[1:2], [bytearray(8 * KIB)])]
                )
            )
            reader.start()
            reader.join(timeout=10)
            assert not reader.is_alive(), "get_many waited for the index lock"
        assert bytes(got[0][0]) == value(0, 4 * KIB)  # type: ignore[index]
        assert got[1] == [4 * KIB]
        # The queued hits still count: keys 0 and 1 are now more recent than key 2.
        assert tier.lru_keys() == [keys[2], keys[0], keys[1]]
    finally:
        tier.close()
