"""Host tier over a shared slab (tiers.host_memfd): a sealed memfd that other processes map
read-only, offsets matching ``locate``; pinned entries keep their bytes through churn."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tiers import host_memfd
from tiers.host import HostTier

pytestmark = pytest.mark.skipif(not host_memfd.available(), reason="no memfd seals")
SLOT = 4096


def _val(i: int, n: int = SLOT) -> bytes:
    return bytes([i % 256]) * n


@pytest.fixture
def tier() -> Iterator[HostTier]:
    t = HostTier(4 * SLOT, SLOT, shared=True)
    yield t
    t.check_integrity()
    t.close()


def test_a_reader_maps_the_same_bytes_read_only(tier: HostTier) -> None:
    assert tier.slab_tensor() is None and not tier.pinned_memory
    fd = tier.shared_fd()
    assert fd is not None
    reader = host_memfd.map_readonly(os.dup(fd))
    assert len(reader) == 4 * SLOT
    tier.put_many([("a", _val(7, 100)), ("b", _val(9))])  # written after the reader mapped
    (offset,) = tier.locate(["b"], _val(9, 8), SLOT)
    assert offset is not None and reader[offset : offset + SLOT] == _val(9)
    # Nobody but the tier writes: no writable mapping, no write, no resize, even re-opened.
    again = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
    try:
        with pytest.raises(PermissionError):
            mmap.mmap(again, SLOT)
        with pytest.raises(PermissionError):
            os.write(again, b"x")
        with pytest.raises(PermissionError):
            os.ftruncate(again, 0)
    finally:
        os.close(again)
    reader.close()


def test_pinned_entries_keep_their_bytes_through_churn(tier: HostTier) -> None:
    tier.put_many([("a", _val(1)), ("b", _val(2))])
    (offset,) = tier.locate(["a"], _val(1, 8), SLOT, pin=True)
    reader = host_memfd.map_readonly(os.dup(tier.shared_fd() or -1))
    for i in range(3, 40):  # ten times the 4 slots
        tier.put_many([(f"k{i}", _val(i))])
        assert tier.put_many([("a", _val(99))]) == []  # an overwrite of a pinned entry: skipped
    assert tier.delete_many(["a"]) == 0
    assert offset is not None and reader[offset : offset + SLOT] == _val(1)
    assert tier.num_pins() == 1 and "a" in tier.lru_keys() and "b" not in tier.lru_keys()
    tier.unpin(["a"])
    assert tier.num_pins() == 0
    tier.put_many([(f"j{i}", _val(i + 100)) for i in range(4)])
    assert "a" not in tier.lru_keys() and reader[offset : offset + SLOT] != _val(1)
    reader.close()


def test_another_process_reads_the_slab(tier: HostTier) -> None:
    tier.put_many([("a", _val(5))])
    fd = os.dup(tier.shared_fd() or -1)
    os.set_inheritable(fd, True)
    code = (
        "import os, sys; from tiers import host_memfd; "
        f"m = host_memfd.map_readonly({fd}); sys.stdout.write(m[:{SLOT}].hex())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        pass_fds=(fd,),
        capture_output=True,
        text=True,
        check=True,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    os.close(fd)
    assert bytes.fromhex(out.stdout) == _val(5)


def test_unsealed_memory_is_refused() -> None:
    fd = os.memfd_create("not-a-slab")
    os.ftruncate(fd, SLOT)
    with pytest.raises(OSError, match="not sealed"):
        host_memfd.map_readonly(fd)  # closes fd
    with pytest.raises(OSError):
        os.fstat(fd)


def test_a_shared_slab_cannot_be_pinned_memory() -> None:
    with pytest.raises(ValueError, match="cannot be pinned"):
        HostTier(4 * SLOT, SLOT, shared=True, pin_memory=True)


def test_close_releases_the_fd() -> None:
    t = HostTier(4 * SLOT, SLOT, shared=True)
    fd = t.shared_fd()
    assert fd is not None
    t.close()
    assert t.shared_fd() is None
    with pytest.raises(OSError):
        os.fstat(fd)
