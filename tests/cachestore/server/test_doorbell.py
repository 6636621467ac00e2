"""The same-host doorbell (cachestore.server.doorbell): requests over the daemon's Unix socket, bound
to the tenant whose hello issued the one-time secret; ZMQ whenever the doorbell is missing,
refused or broken; a daemon restart is misses, then hits, never an error."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cachestore.server.daemon import CacheServer
from cachestore.store.hierarchical import HierarchicalStore
from tests.cachestore.store_helpers import sized_block
from tests.cachestore.wire_helpers import (
    RawFramed,
    attach_checked,
    check_restart,
    served,
    tenant_daemon,
    zmq_ask,
)
from tests.servers import free_port
from tiers.remote import shm
from tiers.remote.protocol import ErrorCode
from tiers.remote.tier import RemoteTier

pytestmark = pytest.mark.skipif(not shm.available(), reason="no /dev/shm")
TOKENS = "tok-alice-0001 alice\ntok-bob-000002 bob\n"
ALICE, BOB = "tok-alice-0001", "tok-bob-000002"
KEYS = [f"aaaa/{i:032x}" for i in range(5)]
BLOCKS = [sized_block(k, 5000 + 300 * i) for i, k in enumerate(KEYS)]


def _daemon(url: str = "tcp://127.0.0.1:0", **config: Any) -> tuple[CacheServer, HierarchicalStore]:
    return tenant_daemon(TOKENS, 8 << 20, 64 << 10, url, **config)


@pytest.fixture
def daemon() -> Iterator[CacheServer]:
    yield from served(_daemon())


def _offer(
    url: str, token: str, segment: shm.ShmSegment, host_id: str | None = None
) -> dict[str, Any]:
    """A raw ZMQ hello that attaches ``segment`` and asks for the doorbell."""
    return zmq_ask(
        url, token, op="hello", host_id=host_id or shm.host_id(), shm=segment.name, doorbell=True
    )


RawBell = RawFramed  # a bare doorbell connection (its socket path)


def test_round_trip_goes_through_the_doorbell(
    daemon: CacheServer, remote: Callable[..., RemoteTier]
) -> None:
    bell = daemon.doorbell
    assert bell is not None and bell.path is not None
    mode = os.stat(bell.path).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(bell.path)).st_mode) == 0o700
    tier = remote(daemon.bound_url, token=ALICE, batch_keys=2)
    assert tier.transport() == "none"
    tier.put_many(list(zip(KEYS, BLOCKS, strict=True)))  # hello over ZMQ, then 3 puts
    assert tier.transport() == "doorbell"
    before = bell.num_requests
    assert tier.lookup(KEYS) == 5  # 3 requests (2 keys each)
    got = tier.get_many(list(reversed(KEYS)))  # 3 requests, pipelined
    assert [bytes(v) for v in got] == list(reversed(BLOCKS))
    assert tier.get_many(["aaaa/" + "f" * 32]) == [None]
    assert tier.delete_many(KEYS[:2]) == 2 and tier.lookup(KEYS) == 0
    assert tier.usage().num_entries == 3
    # lookup 3, get 3, get 1, delete 1, lookup 3 (every chunk is sent), stats 1
    assert bell.num_requests - before == 12
    assert daemon.handler.num_inline >= 4  # host-tier lookups/gets/puts still served inline


def test_tenants_are_bound_to_their_connection(
    daemon: CacheServer, remote: Callable[..., RemoteTier]
) -> None:
    alice = remote(daemon.bound_url, token=ALICE)
    alice.put_many([(KEYS[0], BLOCKS[0])])
    bob = remote(daemon.bound_url, token=BOB)
    assert bob.get_many([KEYS[0]]) == [None] and bob.lookup(KEYS[:1]) == 0
    assert alice.transport() == bob.transport() == "doorbell"
    segment = shm.ShmSegment.create(1 << 16)
    try:
        offer = _offer(daemon.bound_url, ALICE, segment)
        path, secret = offer["doorbell"], offer["doorbell_secret"]
        assert offer["shm"] is True and len(secret) == 32
        raw = attach_checked(path, secret, ALICE, KEYS[:1])
        got = raw.ask(op="get", token=ALICE, keys=KEYS[:1], shm=segment.name)
        assert got["code"] == ErrorCode.OK and got["sizes"] == [len(BLOCKS[0])]
        assert bytes(segment.buf[: len(BLOCKS[0])]) == BLOCKS[0]
        # Bob's token on Alice's connection is refused, and so is no token at all.
        for token in (BOB, ""):
            reply = raw.ask(op="get", token=token, keys=KEYS[:1])
            assert reply["code"] == ErrorCode.UNAUTHORIZED
        assert raw.ask(op="lookup", token=ALICE, keys=KEYS[:1])["count"] == 1  # still serving
        # The secret worked once.
        again = RawBell(path)
        assert again.ask(op="attach", secret=secret)["code"] == ErrorCode.UNAUTHORIZED
        # A hello whose segment is not attached (another host) is offered no doorbell.
        other = _offer(daemon.bound_url, ALICE, segment, host_id="elsewhere")
        assert other["shm"] is False and "doorbell" not in other
    finally:
        segment.close()


@pytest.mark.parametrize(
    "garbage",
    [
        b"\xff\xff\xff\x7f\x00\x00\x00\x00",  # a header length over the limit
        b"\x03\x00\x00\x00\x00\x00\x00\x00\xc1\xc1\xc1",  # not msgpack
        b"\x01\x00\x00\x00\x00\x00\x00\x00\x07",  # msgpack, not a map
    ],
)
def test_garbage_on_the_doorbell_drops_the_connection_only(
    daemon: CacheServer, remote: Callable[..., RemoteTier], garbage: bytes
) -> None:
    bell = daemon.doorbell
    assert bell is not None and bell.path is not None
    raw = RawBell(bell.path)
    raw.sock.sendall(garbage)
    assert raw.closed_by_peer()
    tier = remote(daemon.bound_url, token=ALICE)
    tier.put_many([(KEYS[3], BLOCKS[3])])
    assert bytes(tier.get_many(KEYS[3:4])[0]) == BLOCKS[3] and tier.transport() == "doorbell"


def test_falls_back_to_zmq_without_a_doorbell(remote: Callable[..., RemoteTier]) -> None:
    srv, store = _daemon(doorbell=False)
    try:
        tier = remote(srv.bound_url, token=ALICE)
        tier.put_many([(KEYS[0], BLOCKS[0])])
        assert bytes(tier.get_many(KEYS[:1])[0]) == BLOCKS[0]
        assert tier.transport() == "zmq" and srv.doorbell is None
    finally:
        srv.stop()
        store.close()


def test_broken_doorbell_falls_back_to_zmq_transparently(
    daemon: CacheServer, remote: Callable[..., RemoteTier]
) -> None:
    tier = remote(daemon.bound_url, token=ALICE)
    tier.put_many([(KEYS[1], BLOCKS[1])])
    assert tier.transport() == "doorbell"
    bell = daemon.doorbell
    assert bell is not None
    bell.stop()  # the socket goes away; the ZMQ side keeps serving
    assert bytes(tier.get_many(KEYS[1:2])[0]) == BLOCKS[1]  # no error, same answer
    assert tier.transport() == "zmq"
    assert tier.lookup(KEYS[1:2]) == 1


def test_daemon_restart_is_misses_then_hits(remote: Callable[..., RemoteTier]) -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    tier = remote(url, token=ALICE, timeout_s=5)
    bell = check_restart(url, _daemon, tier, KEYS[2], BLOCKS[2], "doorbell")
    assert bell is not None and bell.num_requests >= 2


def test_doorbell_socket_is_removed_on_stop(tmp_path: Path) -> None:
    srv, store = _daemon(doorbell_dir=str(tmp_path))
    bell = srv.doorbell
    assert bell is not None and bell.path is not None
    assert Path(bell.path).parent.parent == tmp_path
    srv.stop()
    store.close()
    assert list(tmp_path.iterdir()) == []
