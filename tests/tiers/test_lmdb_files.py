"""The LMDB tier under an operator's faults (``tiers.lmdb_files``), on real LMDB files: a full
disk fails the writes past it with TierError instead of killing the process with SIGBUS; an
unreadable directory is moved aside at open instead of stopping every start; a directory deleted
under a running tier is reported by ``ping`` (and the tier is down) instead of losing its
writes silently."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from cachestore.store.guarded_tiers import GuardedTiers
from cachestore.store.types import StoreConfig
from tiers import create_tier
from tiers.base import TierError
from tiers.config import LmdbTierConfig
from tiers.lmdb import LmdbTier

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20


def _val(i: int, n: int = MIB) -> bytes:
    return bytes([i % 256]) * n


@contextmanager
def _small_tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``where`` (a filesystem the test can fill); skips the
    test where mounting is not permitted (not root, no CAP_SYS_ADMIN)."""
    where.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill (needs root): {done.stderr.strip()}")
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)


def _fill(path: Path) -> None:
    """Write ``path`` until the filesystem is full."""
    with open(path, "wb") as fh:
        try:
            while True:
                fh.write(bytes(256 << 10))
                fh.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC


def _read_at_once(tier: LmdbTier, n: int) -> None:
    """``n`` read transactions open at once on ``tier``'s environment: LMDB's reader table
    (``lock.mdb``, mapped, sparse past its first page of ~60 slots) takes a slot for each."""
    import threading

    together = threading.Barrier(n)

    def read() -> None:
        with tier._env.begin():
            together.wait(30)

    threads = [threading.Thread(target=read) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _open(db: Path, how: str) -> LmdbTier:
    if how == "config":  # the YAML path: LmdbTierConfig's defaults (writemap off)
        tier = create_tier(LmdbTierConfig(path=str(db), capacity=1 << 30))
        assert isinstance(tier, LmdbTier)
        return tier
    return LmdbTier(db, capacity_bytes=1 << 30, writemap=how == "writemap")


def fill_the_disk(fs: str, how: str) -> None:
    """Run in a child process (a SIGBUS would end the test run): a 1 GiB tier on a 16 MiB
    tmpfs takes 1 MiB puts until the disk is full, then refuses them with TierError; what it
    wrote still reads; after a file there is deleted, puts work again; reopened on a disk full
    to the last block, it starts and serves (100 readers at once too), and refuses puts (past
    the blocks it had reserved)."""
    db, filler = Path(fs) / "db", Path(fs) / "filler"
    filler.write_bytes(bytes(4 * MIB))  # what the operator deletes
    tier = _open(db, how)
    written: list[int] = []
    with pytest.raises(TierError, match="the disk is full") as failed:
        for i in range(32):  # 32 MiB, twice the filesystem
            tier.put_many([(f"k{i}", _val(i))])
            written.append(i)
    assert str(db) in str(failed.value) and "MiB free" in str(failed.value)
    assert len(written) >= 3, written
    keys = [f"k{i}" for i in written]
    assert tier.get_many(keys) == [_val(i) for i in written]
    with pytest.raises(TierError, match="the disk is full"):  # still full: still refused
        tier.put_many([("more", _val(1))])
    filler.unlink()
    tier.put_many([("after", _val(99))])
    assert tier.get_many(["after", keys[0]]) == [_val(99), _val(written[0])]
    tier.close()
    _fill(filler)  # the disk full again, and the engine restarts
    tier = _open(db, how)
    assert tier.get_many(["after", keys[-1]]) == [_val(99), _val(written[-1])]
    _read_at_once(tier, 100)  # reader slots past lock.mdb's first page: backed too
    with pytest.raises(TierError, match="the disk is full"):  # blocks it had reserved: a few
        for i in range(8):
            tier.put_many([(f"restarted{i}", _val(i))])
    tier.close()


@pytest.mark.parametrize("how", ["writemap", "config", "write_calls"])
def test_a_full_disk_fails_the_puts_past_it_and_the_process_lives(tmp_path: Path, how: str) -> None:
    """The audit: writemap (the default) on a full filesystem was a SIGBUS (the engine core
    died, exit -7, on every restart). ``write_calls``: ``writemap: false``, where LMDB's own
    error said ``Input/output error``."""
    with _small_tmpfs(tmp_path / "fs", "16m") as fs:
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                "from tests.tiers.test_lmdb_files import fill_the_disk\n"
                f"fill_the_disk({str(fs)!r}, {how!r})",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode != -signal.SIGBUS, "SIGBUS: LMDB wrote a page the disk had no block for"
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stderr.count("is more than the disk can give it") == 2  # one per open


def _stored(path: Path, n: int = 300) -> dict[str, bytes]:
    """An environment at ``path`` holding ``n`` small values (several pages of B-tree)."""
    values = {f"k{i}": os.urandom(3000 + i) for i in range(n)}
    tier = LmdbTier(path, capacity_bytes=64 * MIB)
    tier.put_many(list(values.items()))
    tier.close()
    return values


@pytest.mark.parametrize("damage", ["meta", "tree"])
def test_an_unreadable_directory_is_moved_aside_and_the_tier_starts_empty(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    """The audit: ``dd if=/dev/urandom of=data.mdb bs=4096 count=4 conv=notrunc`` (``meta``:
    LMDB's meta pages) stopped the engine from starting, on every restart (TierError
    MDB_INVALID). ``tree``: the meta pages intact, every other page LMDB used zeroed (as a
    lost write leaves it), which LMDB finds while the index is rebuilt (MDB_CORRUPTED)."""
    path = tmp_path / "db"
    _stored(path)
    with open(path / "data.mdb", "r+b") as fh:
        if damage == "meta":
            fh.write(os.urandom(4 * 4096))
            error = "MDB_INVALID"
        else:
            fh.seek(2 * 4096)
            fh.write(bytes(2 * MIB))  # past every page the 300 values took
            error = "MDB_CORRUPTED"
    with caplog.at_level(logging.WARNING, logger="tiers.lmdb_files"):
        tier = LmdbTier(path, capacity_bytes=64 * MIB)
    try:
        aside = list(tmp_path.glob("db.corrupt-*"))
        assert len(aside) == 1 and (aside[0] / "data.mdb").stat().st_size > 0
        moved = [r.getMessage() for r in caplog.records if "moved aside" in r.getMessage()]
        assert len(moved) == 1 and str(path) in moved[0] and str(aside[0]) in moved[0]
        assert error in moved[0]
        assert tier.usage().num_entries == 0 and tier.get_many(["k1"]) == [None]
        tier.put_many([("new", _val(1, 1000))])
        assert tier.get_many(["new"]) == [_val(1, 1000)]
    finally:
        tier.close()
    reopened = LmdbTier(path, capacity_bytes=64 * MIB)  # the fresh one persists, as any
    try:
        assert reopened.get_many(["new"]) == [_val(1, 1000)]
        assert len(list(tmp_path.glob("db.corrupt-*"))) == 1
    finally:
        reopened.close()


def test_an_unreadable_directory_another_process_has_open_stays_a_start_up_error(
    tmp_path: Path,
) -> None:
    """Two engines of one machine share the default directory: one that finds it unreadable
    while the other has it open does not move it from under the other (LMDB's lock on
    ``lock.mdb`` tells), and says so in one line."""
    path = tmp_path / "db"
    _stored(path, 10)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import lmdb, sys\n"
            f"env = lmdb.open({str(path)!r}, max_dbs=3, map_size=1 << 30)\n"
            "print('open', flush=True)\n"
            "sys.stdin.read()\n",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "open\n"
        with open(path / "data.mdb", "r+b") as fh:
            fh.write(os.urandom(4 * 4096))
        with pytest.raises(TierError, match="open by another process") as failed:
            LmdbTier(path, capacity_bytes=64 * MIB)
        assert str(path) in str(failed.value) and "MDB_INVALID" in str(failed.value)
        assert not list(tmp_path.glob("db.corrupt-*")) and (path / "data.mdb").exists()
    finally:
        holder.communicate("", timeout=30)
    tier = LmdbTier(path, capacity_bytes=64 * MIB)  # the other process gone: moved aside
    tier.close()
    assert len(list(tmp_path.glob("db.corrupt-*"))) == 1


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("replaced", [False, True])
def test_a_directory_deleted_under_a_running_tier_is_down(tmp_path: Path, replaced: bool) -> None:
    """The audit: ``rm -rf`` of the directory left the tier writing into the unlinked file,
    /health said ok, and a restart found nothing. Now ``ping`` (the store's idle probe) raises
    TierError naming the path, and every call after it, so the tier stays down until the
    process restarts. ``replaced``: a new directory at the path (another process made it)."""
    path = tmp_path / "db"
    tier = LmdbTier(path, capacity_bytes=64 * MIB)
    clock = _Clock()
    tiers = GuardedTiers([tier], StoreConfig(backoff_initial_s=1.0), clock)
    try:
        tier.put_many([("a", _val(1, 1000))])
        tier.ping()
        shutil.rmtree(path)
        if replaced:
            LmdbTier(path, capacity_bytes=64 * MIB).close()
        with pytest.raises(TierError, match=str(path / "data.mdb")) as lost:
            tier.ping()
        assert ("no longer the file" if replaced else "was deleted") in str(lost.value)
        assert "restart" in str(lost.value)
        with pytest.raises(TierError, match="restart"):
            tier.get_many(["a"])
        with pytest.raises(TierError, match="restart"):
            tier.put_many([("b", _val(2, 1000))])
        assert not tier.holds_hint("a")
        clock.now += 5.0  # the store's view: its idle probe marks the tier down
        assert tiers.probe_idle(5.0) == [0] and tiers.health[0].consecutive_failures == 1
    finally:
        tier.close()


def test_a_put_finds_the_deleted_directory_without_a_probe(tmp_path: Path) -> None:
    """A busy tier is never idle, so never probed: its writer checks the file before each
    write, and a put is the first call to fail."""
    path = tmp_path / "db"
    tier = LmdbTier(path, capacity_bytes=64 * MIB)
    try:
        tier.put_many([("a", _val(1, 1000))])
        shutil.rmtree(path)
        with pytest.raises(TierError, match="was deleted"):
            tier.put_many([("b", _val(2, 1000))])
        with pytest.raises(TierError, match="was deleted"):
            tier.ping()
    finally:
        tier.close()
