"""The daemon's inline read path (host-tier gets/lookups on the loop thread): same answers as
the worker pool, same refusals (tokens, key prefixes, malformed frames), and a block whose
stored header is damaged is never served inline (the pool's checksummed read makes it a miss).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cachestore.server.daemon import CacheServer, ServerConfig
from cachestore.store.hierarchical import HierarchicalStore, StoreConfig
from tests.cachestore.store_helpers import sized_block
from tests.cachestore.wire_helpers import zmq_ask
from tiers.base import TierError
from tiers.host import HostTier
from tiers.lmdb import LmdbTier
from tiers.remote.protocol import ErrorCode, TokenTable
from tiers.remote.tier import RemoteTier

TOKENS = "tok-alice-0001 alice\ntok-bob-000002 bob\ntok-carol-0003 carol aaaa\n"
ALICE, BOB, CAROL = "tok-alice-0001", "tok-bob-000002", "tok-carol-0003"


def _daemon(tmp_path: Path, inline: bool) -> tuple[CacheServer, HierarchicalStore, HostTier]:
    host = HostTier(4 << 20, 128 << 10, pin_memory=False)
    store = HierarchicalStore(
        [host, LmdbTier(tmp_path / "lmdb", 64 << 20)], StoreConfig(write_through_to=1)
    )
    srv = CacheServer(
        ServerConfig(url="tcp://127.0.0.1:0", inline_reads=inline), store, TokenTable.parse(TOKENS)
    ).start()
    return srv, store, host


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[tuple[CacheServer, HierarchicalStore, HostTier]]:
    srv, store, host = _daemon(tmp_path, inline=True)
    yield srv, store, host
    srv.stop()
    store.close()


_ask = zmq_ask


KEYS = [f"aaaa/{i:032x}" for i in range(6)]
BLOCKS = [sized_block(k, 3000 + 100 * i) for i, k in enumerate(KEYS)]


@pytest.mark.parametrize("use_shm", [False, True])
def test_gets_and_lookups_of_host_blocks_are_served_inline(
    daemon: tuple[CacheServer, HierarchicalStore, HostTier],
    use_shm: bool,
    remote: Callable[..., RemoteTier],
) -> None:
    srv, _, _ = daemon
    alice = remote(srv.bound_url, token=ALICE, use_shm=use_shm)
    alice.put_many(list(zip(KEYS[:1], BLOCKS[:1], strict=True)))
    before = srv.handler.num_inline
    got = alice.get_many(KEYS[:1])
    assert [bytes(v) for v in got if v is not None] == BLOCKS[:1]
    assert alice.lookup(KEYS[:1]) == 1
    assert srv.handler.num_inline == before + 2
    # A key the host tier lacks goes to the pool and is a miss there: nothing inline.
    assert alice.get_many([KEYS[0], KEYS[5]])[1] is None
    assert alice.lookup([KEYS[0], KEYS[5]]) == 1
    assert srv.handler.num_inline == before + 2
    alice.close()


def test_inline_path_keeps_tenants_and_refusals(
    daemon: tuple[CacheServer, HierarchicalStore, HostTier], remote: Callable[..., RemoteTier]
) -> None:
    srv, _, _ = daemon
    alice = remote(srv.bound_url, token=ALICE)
    alice.put_many([(KEYS[0], BLOCKS[0])])
    alice.get_many([KEYS[0]])  # the header is known: the next host hit is inline
    before = srv.handler.num_inline
    bob = remote(srv.bound_url, token=BOB)
    assert bob.get_many([KEYS[0]]) == [None] and bob.lookup([KEYS[0]]) == 0  # alice's block
    carol = _ask(srv.bound_url, CAROL, op="get", keys=["bbbb/01"])
    assert carol["code"] == ErrorCode.FORBIDDEN_KEY
    assert _ask(srv.bound_url, "tok-mallory-9", ALICE, op="get", keys=[KEYS[0]])["code"] == (
        ErrorCode.UNAUTHORIZED
    )
    assert _ask(srv.bound_url, ALICE, op="get", keys=KEYS[0])["code"] == ErrorCode.BAD_HEADER
    assert srv.handler.num_inline == before
    assert [bytes(v) for v in alice.get_many([KEYS[0]]) if v] == [BLOCKS[0]]  # still serving
    assert srv.handler.num_inline == before + 1
    for tier in (alice, bob):
        tier.close()


def test_damaged_header_is_not_served_inline_and_is_a_miss(
    daemon: tuple[CacheServer, HierarchicalStore, HostTier], remote: Callable[..., RemoteTier]
) -> None:
    srv, store, host = daemon
    alice = remote(srv.bound_url, token=ALICE)
    alice.put_many([(KEYS[1], BLOCKS[1])])
    (view,) = host.get_many([f"alice/{KEYS[1]}"])
    assert view is not None
    view[12] ^= 0xFF  # the payload length field: the block no longer matches its header
    before = srv.handler.num_inline
    # The pool's checksummed read finds the host copy corrupt; LMDB (write-through) serves it.
    assert [bytes(v) for v in alice.get_many([KEYS[1]]) if v] == [BLOCKS[1]]
    assert srv.handler.num_inline == before
    store.flush()  # the corrupt host copy was deleted, LMDB's promoted in its place
    assert [bytes(v) for v in host.get_many([f"alice/{KEYS[1]}"]) if v] == [BLOCKS[1]]
    assert [bytes(v) for v in alice.get_many([KEYS[1]]) if v] == [BLOCKS[1]]
    assert srv.handler.num_inline == before + 1
    alice.close()


def test_blocks_promoted_from_lmdb_are_learned_then_inline(
    daemon: tuple[CacheServer, HierarchicalStore, HostTier], remote: Callable[..., RemoteTier]
) -> None:
    srv, store, host = daemon
    ikey = f"alice/{KEYS[2]}"
    store.tiers[1].put_many([(ikey, BLOCKS[2])])  # as a previous run left it on disk
    alice = remote(srv.bound_url, token=ALICE)
    before = srv.handler.num_inline
    assert [bytes(v) for v in alice.get_many([KEYS[2]]) if v] == [BLOCKS[2]]  # pool, promoted
    store.flush()
    assert host.lookup([ikey]) == 1
    assert [bytes(v) for v in alice.get_many([KEYS[2]]) if v] == [BLOCKS[2]]
    assert srv.handler.num_inline == before + 1
    alice.close()


def test_inline_reads_off_gives_the_same_answers(
    tmp_path: Path, remote: Callable[..., RemoteTier]
) -> None:
    srv, store, _ = _daemon(tmp_path, inline=False)
    try:
        alice = remote(srv.bound_url, token=ALICE)
        alice.put_many(list(zip(KEYS, BLOCKS, strict=True)))
        got = alice.get_many(KEYS + ["aaaa/ff"])
        assert [bytes(v) if v is not None else None for v in got] == [*BLOCKS, None]
        assert alice.lookup(KEYS) == len(KEYS) and srv.handler.num_inline == 0
        with pytest.raises(TierError, match="FORBIDDEN_KEY"):
            remote(srv.bound_url, token=CAROL).get_many(["bbbb/01"])
        alice.close()
    finally:
        srv.stop()
        store.close()


BIG_KEYS = [f"aaaa/{i:032x}" for i in range(100, 103)]
BIG = [sized_block(k, 96 << 10) for k in BIG_KEYS]  # lent once MIN_LENT_BYTES is lowered


def _pins(host: HostTier, ikeys: list[str]) -> list[int]:
    return [host._entries[k].pins for k in ikeys]  # white-box: pins are not public


def test_tcp_inline_gets_lend_host_blocks_and_unpin_after_the_send(
    daemon: tuple[CacheServer, HierarchicalStore, HostTier], remote: Callable[..., RemoteTier]
) -> None:
    """Over ZMQ frames, inline host hits leave zero copy: lent (pinned) while ZMQ holds them,
    unpinned once sent; the client gets the exact bytes, also for a key asked twice."""
    srv, _, host = daemon
    alice = remote(srv.bound_url, token=ALICE, use_shm=False, use_stream=False)
    alice.put_many(list(zip(BIG_KEYS, BIG, strict=True)))
    alice.get_many(BIG_KEYS[:1])  # learns the namespace's header: the next hits are inline
    reads = srv.handler._fast  # white-box: the lent-bytes gauge and count
    assert reads is not None
    reads.MIN_LENT_BYTES = 64 << 10  # instance attribute: lend this test's 96 KiB blocks
    before, lent = srv.handler.num_inline, reads.num_lent
    keys = [BIG_KEYS[0], BIG_KEYS[2], BIG_KEYS[0]]
    got = alice.get_many(keys)
    assert [bytes(v) for v in got if v is not None] == [BIG[0], BIG[2], BIG[0]]
    assert srv.handler.num_inline == before + 1 and reads.num_lent == lent + 3
    deadline = time.monotonic() + 5
    while reads.lent_bytes and time.monotonic() < deadline:  # pyzmq releases on its own thread
        time.sleep(0.01)
    assert reads.lent_bytes == 0
    assert _pins(host, [f"alice/{k}" for k in BIG_KEYS]) == [0, 0, 0]
    alice.close()


def test_lend_pins_until_the_view_goes_and_respects_its_budget(
    daemon: tuple[CacheServer, HierarchicalStore, HostTier], remote: Callable[..., RemoteTier]
) -> None:
    srv, store, host = daemon
    alice = remote(srv.bound_url, token=ALICE, use_shm=False)
    alice.put_many(list(zip(BIG_KEYS, BIG, strict=True)))
    alice.get_many(BIG_KEYS[:1])
    reads = srv.handler._fast
    assert reads is not None
    ikeys = [f"alice/{k}" for k in BIG_KEYS[:2]]
    # The loop thread unpins after the reply left: the client may see it first.
    deadline = time.monotonic() + 5
    while host.num_pins() and time.monotonic() < deadline:
        time.sleep(0.01)
    pinned = reads.pinned_views("alice", BIG_KEYS[:2], ikeys)
    assert pinned is not None and _pins(host, ikeys[:2]) == [1, 1]
    views, spec = pinned.views, pinned.spec
    # Instance attributes: first too small to lend, then 96 KiB blocks lent, one at a time.
    reads.MIN_LENT_BYTES = len(BIG[0]) + 1
    assert reads.lend(spec, ikeys, views, views) == [False, False] and reads.lent_bytes == 0
    reads.MIN_LENT_BYTES = 64 << 10
    reads.MAX_LENT_BYTES = len(BIG[0]) + 1
    assert reads.lend(spec, ikeys[1:], views[1:], []) == [False]  # not a frame: never lent
    # Both views are frames here, but the budget takes one.
    assert reads.lend(spec, ikeys, views, [views[1], views[0]]) == [True, False]
    assert reads.lent_bytes == len(BIG[0])
    store.complete_load(spec)  # the caller's share: what was not lent
    assert _pins(host, ikeys[:2]) == [1, 0]
    # A lent block survives a flood of puts that evicts everything else.
    flood = [(f"aaaa/{i:032x}", sized_block(f"aaaa/{i:032x}", 96 << 10)) for i in range(200, 260)]
    alice.put_many(flood)
    assert host.lookup(ikeys[:1]) == 1 and host.lookup(ikeys[1:2]) == 0
    del views, pinned
    assert reads.lent_bytes == 0 and _pins(host, ikeys[:1]) == [0]
    alice.close()
