"""Zero-copy same-host gets (cachestore.server.leases): a doorbell client reads the daemon's host slab
in place; leases pin the blocks until the client's next call, its close or its death; only one
namespace's slab is ever mapped; over TCP nothing changes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

from cachestore.server.daemon import CacheServer, ServerConfig
from cachestore.store.hierarchical import HierarchicalStore, StoreConfig
from tests.cachestore.server.daemon_procs import ROOT, start_daemon
from tests.cachestore.store_helpers import sized_block
from tiers import host_memfd
from tiers.host import HostTier
from tiers.remote import shm
from tiers.remote.protocol import TokenTable
from tiers.remote.tier import RemoteTier

pytestmark = pytest.mark.skipif(
    not (shm.available() and host_memfd.available()), reason="no /dev/shm or memfd seals"
)
SLOT = 64 << 10
SIZE = 60_000  # every block of these tests: one namespace, one size
KEYS = [f"aaaa/{i:032x}" for i in range(6)]
BLOCKS = [sized_block(k, SIZE) for k in KEYS]
TWO_TENANTS = "tok-alice-0001 alice\ntok-bob-000002 bob\n"


class Daemon:
    """A daemon thread over a shared-slab host tier of ``slots`` slots."""

    def __init__(
        self,
        slots: int = 32,
        tokens: str | None = None,
        url: str = "tcp://127.0.0.1:0",
        **config: Any,
    ) -> None:
        self.host = HostTier(slots * SLOT, SLOT, shared=True)
        self.store = HierarchicalStore([self.host], StoreConfig())
        self.srv = CacheServer(
            ServerConfig(url=url, **config),
            self.store,
            TokenTable.parse(tokens) if tokens else None,
        ).start()
        self.url = self.srv.bound_url

    def held_bytes(self) -> int:
        offer = self.srv.leases
        return offer.budget.held_bytes if offer is not None else 0

    def granted(self) -> int:
        offer = self.srv.leases
        return offer.budget.num_granted if offer is not None else 0

    def wait_released(self, timeout_s: float = 5.0) -> None:
        deadline = time.monotonic() + timeout_s
        while (self.held_bytes() or self.host.num_pins()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (self.held_bytes(), self.host.num_pins()) == (0, 0)

    def pins_settle(self, timeout_s: float = 5.0) -> int:
        """Host pins once the copy path's are gone: it unpins after its reply left, so the
        client may see the reply first. Leases stay pinned (they are what is counted)."""
        deadline = time.monotonic() + timeout_s
        while self.host.num_pins() > self.held_bytes() // SIZE and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.host.num_pins()

    def close(self) -> None:
        self.srv.stop()
        self.store.close()


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    d = Daemon()
    yield d
    d.close()


def _fill(tier: RemoteTier) -> None:
    tier.put_many(list(zip(KEYS, BLOCKS, strict=True)))


def test_in_place_gets_return_the_right_bytes(
    daemon: Daemon, remote: Callable[..., RemoteTier]
) -> None:
    tier = remote(daemon.url, batch_keys=2)  # 3 pipelined requests per 6-key get
    _fill(tier)
    assert tier.transport() == "doorbell+slab"
    got = tier.get_many(list(reversed(KEYS)))
    assert [bytes(v) for v in got] == list(reversed(BLOCKS))
    assert all(v.readonly for v in got)  # views of the read-only mapping, no copy
    assert tier.num_in_place == 6 and daemon.granted() == 6
    assert daemon.held_bytes() == 6 * SIZE and daemon.host.num_pins() == 6
    from cachestore.server.admin import _LiveCollector

    gauges = {
        m.samples[0].name: m.samples[0].value
        for m in _LiveCollector(lambda: daemon.srv).collect()
        if m.name.startswith("kvtier_server_leased")
    }
    assert gauges == {
        "kvtier_server_leased_bytes": 6 * SIZE,
        "kvtier_server_leased_blocks_total": 6,
    }
    # A request with a miss takes the copy path (whole request), the others stay leased.
    missing = "aaaa/" + "f" * 32
    got = tier.get_many([KEYS[0], KEYS[1], KEYS[2], missing])
    assert [None if v is None else bytes(v) for v in got] == [*BLOCKS[:3], None]
    assert tier.num_in_place == 8 and daemon.pins_settle() == 2  # chunk 1 leased, 2 copied


def test_leases_are_released_on_the_next_call_and_on_close(
    daemon: Daemon, remote: Callable[..., RemoteTier]
) -> None:
    tier = remote(daemon.url)
    _fill(tier)
    tier.get_many(KEYS[:4])
    assert daemon.host.num_pins() == 4 and daemon.held_bytes() == 4 * SIZE
    tier.get_many(KEYS[4:])  # the next call gives the first lease back
    assert daemon.host.num_pins() == 2 and daemon.held_bytes() == 2 * SIZE
    assert tier.lookup(KEYS) == 6  # any call does
    assert daemon.host.num_pins() == 0 and daemon.held_bytes() == 0
    tier.get_many(KEYS)
    assert daemon.host.num_pins() == 6
    tier.close()
    daemon.wait_released()


def test_a_leased_view_stays_intact_while_other_clients_churn(
    remote: Callable[..., RemoteTier],
) -> None:
    d = Daemon(slots=8)
    try:
        reader = remote(d.url)
        _fill(reader)
        views = reader.get_many(KEYS[:2])
        errors: list[BaseException] = []

        def churn(c: int) -> None:  # 2 writers x 24 blocks through 8 slots, 2 of them leased
            try:
                writer = RemoteTier(d.url)
                for i in range(24):
                    key = f"aaaa/{c + 16:02x}{i:030x}"  # never one of KEYS
                    writer.put_many([(key, sized_block(key, SIZE))])
                writer.close()
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=churn, args=(c,)) for c in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        assert [bytes(v) for v in views] == BLOCKS[:2]
        assert d.host.lru_keys()[:2] == [f"default/{k}" for k in KEYS[:2]]  # pinned: kept
        assert d.host.num_full_skipped == 0  # the writers always found a slot
        # Released by the reader's next call, the same churn evicts them and reuses their
        # slots: what the lease prevented (the stale views now show other bytes).
        assert reader.lookup(KEYS[:1]) == 1
        churn(2)
        assert reader.lookup(KEYS[:2]) == 0
        assert bytes(views[0]) != BLOCKS[0] and bytes(views[1]) != BLOCKS[1]
        d.host.check_integrity()
    finally:
        d.close()


def test_caps_fall_back_to_copies(remote: Callable[..., RemoteTier]) -> None:
    d = Daemon(slots=16, max_leased_conn_bytes=3 * SIZE)
    try:
        # The overall budget is at most a quarter of the slab (16 slots: 4 of these blocks).
        assert d.srv.leases is not None and d.srv.leases.budget.max_bytes == 4 * SLOT
        tier = remote(d.url)
        _fill(tier)
        got = tier.get_many(KEYS[:4])  # over the connection's cap: copied
        assert [bytes(v) for v in got] == BLOCKS[:4] and not any(v.readonly for v in got)
        assert tier.num_in_place == 0 and d.pins_settle() == 0
        got = tier.get_many(KEYS[:3])
        assert [bytes(v) for v in got] == BLOCKS[:3] and tier.num_in_place == 3
        other = remote(d.url)  # within its own cap, but 3 + 2 blocks are over the budget
        got = other.get_many(KEYS[3:5])
        assert [bytes(v) for v in got] == BLOCKS[3:5] and other.num_in_place == 0
        got = other.get_many(KEYS[3:4])
        assert bytes(got[0]) == BLOCKS[3] and other.num_in_place == 1
        assert d.held_bytes() == 4 * SIZE and d.pins_settle() == 4
    finally:
        d.close()


def test_a_killed_client_gives_its_leases_back(
    daemon: Daemon, remote: Callable[..., RemoteTier]
) -> None:
    _fill(remote(daemon.url))
    script = textwrap.dedent(f"""
        import sys, time
        from tiers.remote.tier import RemoteTier
        tier = RemoteTier({daemon.url!r})
        views = tier.get_many({KEYS!r})
        print(tier.num_in_place, sum(len(v) for v in views), flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen(
        [sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().split() == ["6", str(6 * SIZE)]
        assert daemon.host.num_pins() == 6 and daemon.held_bytes() == 6 * SIZE
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        daemon.wait_released()
    finally:
        proc.kill()
        proc.wait(10)
    assert daemon.store.put_many([("default/x/y", b"z")]) == 1  # the daemon serves on


def _attach_reply(url: str, token: str) -> tuple[dict[str, Any], list[int]]:
    """A raw hello + doorbell attach asking for the slab: the reply and the fds it carried."""
    import zmq

    from tiers.remote.protocol import PROTOCOL_VERSION, pack
    from tiers.remote.zap import secure_client

    segment = shm.ShmSegment.create(1 << 16)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    secure_client(sock, token)
    sock.connect(url)
    try:
        sock.send(
            pack(
                {
                    "v": PROTOCOL_VERSION,
                    "id": 1,
                    "op": "hello",
                    "token": token,
                    "host_id": shm.host_id(),
                    "shm": segment.name,
                    "doorbell": True,
                }
            )
        )
        assert sock.poll(5000)
        hello = msgpack.unpackb(sock.recv_multipart()[0])
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as bell:
            bell.settimeout(5)
            bell.connect(hello["doorbell"])
            from tiers.remote.bell_framing import send_message

            send_message(
                bell,
                pack(
                    {
                        "v": PROTOCOL_VERSION,
                        "id": 2,
                        "op": "attach",
                        "secret": hello["doorbell_secret"],
                        "lease": True,
                    }
                ),
            )
            data, fds, _, _ = socket.recv_fds(bell, 1 << 16, 4)
        return msgpack.unpackb(data[8:]), fds
    finally:
        sock.close()
        segment.close()


def test_two_tenants_never_see_the_slab(remote: Callable[..., RemoteTier]) -> None:
    d = Daemon(tokens=TWO_TENANTS)
    try:
        assert d.srv.leases is None
        reply, fds = _attach_reply(d.url, "tok-alice-0001")
        assert reply["code"] == 0 and "slab" not in reply and fds == []
        alice = remote(d.url, token="tok-alice-0001")
        bob = remote(d.url, token="tok-bob-000002")
        _fill(alice)
        assert bob.get_many(KEYS[:1]) == [None]
        got = alice.get_many(KEYS)
        assert [bytes(v) for v in got] == BLOCKS
        assert alice.transport() == "doorbell" and alice.num_in_place == 0
        assert d.pins_settle() == 0  # copied into alice's segment, nothing held
    finally:
        d.close()


@pytest.mark.parametrize(
    "tokens, offered",
    [
        ("tok-alice-0001 alice\ntok-alice-0002 alice\n", True),  # one tenant, two tokens
        ("tok-alice-0001 alice aaaa\n", False),  # one tenant, but restricted key prefixes
    ],
)
def test_one_namespace_rule(tokens: str, offered: bool) -> None:
    d = Daemon(tokens=tokens)
    try:
        assert (d.srv.leases is not None) is offered
        reply, fds = _attach_reply(d.url, "tok-alice-0001")
        assert reply.get("slab", False) is offered and len(fds) == int(offered)
        for fd in fds:  # what a client gets can only be mapped read-only
            mapping = host_memfd.map_readonly(os.dup(fd))
            with pytest.raises(PermissionError):
                import mmap

                mmap.mmap(fd, len(mapping))
            os.close(fd)
    finally:
        d.close()


def test_over_tcp_nothing_changes(daemon: Daemon, remote: Callable[..., RemoteTier]) -> None:
    tier = remote(daemon.url, use_shm=False)
    _fill(tier)
    got = tier.get_many(KEYS)
    assert [bytes(v) for v in got] == BLOCKS and tier.transport() == "stream"
    assert tier.num_in_place == 0 and daemon.granted() == 0 and daemon.pins_settle() == 0
    no_lease = remote(daemon.url, use_leases=False)  # a doorbell client that does not ask
    assert [bytes(v) for v in no_lease.get_many(KEYS)] == BLOCKS
    assert no_lease.transport() == "doorbell" and daemon.granted() == 0


def _cli(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen[str], str]:
    from tests.servers import free_port

    port = free_port()
    proc = start_daemon(
        *("--port", str(port), "--admin-port", "-1"),
        *("--host-capacity", "512KiB", "--host-slot-bytes", "64KiB", *extra),
        stderr=False,
    )
    return proc, f"tcp://127.0.0.1:{port}"


@pytest.mark.parametrize("tokens", [None, TWO_TENANTS])
def test_cli_daemon(tmp_path: Path, remote: Callable[..., RemoteTier], tokens: str | None) -> None:
    """``kvtier cache-server``: a shared slab, leased gets and churn in open mode; copies
    only with two tenants."""
    extra: list[str] = []
    if tokens:
        (tmp_path / "tokens").write_text(tokens)
        extra = ["--tokens", str(tmp_path / "tokens")]
    proc, url = _cli(tmp_path, *extra)
    try:
        tier = remote(url, token="tok-alice-0001" if tokens else None)
        _fill(tier)
        views = tier.get_many(KEYS[:2])
        writer = remote(url, token="tok-alice-0001" if tokens else None)
        for i in range(24):  # 3x the 8 slots
            key = f"aaaa/{i + 16:032x}"  # never one of KEYS
            writer.put_many([(key, sized_block(key, SIZE))])
        assert [bytes(v) for v in views] == BLOCKS[:2]
        assert tier.num_in_place == (0 if tokens else 2)
        assert tier.transport() == ("doorbell" if tokens else "doorbell+slab")
        assert tier.lookup(KEYS[:2]) == (0 if tokens else 2)  # leased blocks stayed in memory
    finally:
        proc.terminate()
        proc.wait(10)


def test_daemon_restart_is_misses_then_hits_in_place(remote: Callable[..., RemoteTier]) -> None:
    from tests.servers import free_port

    url = f"tcp://127.0.0.1:{free_port()}"
    d = Daemon(url=url)
    tier = remote(url, timeout_s=5)
    _fill(tier)
    views = tier.get_many(KEYS[:2])
    d.close()
    d = Daemon(url=url)  # memory only: the blocks are gone, a new slab
    try:
        assert tier.get_many(KEYS[:1]) == [None]  # a miss, not an error
        assert [bytes(v) for v in views] == BLOCKS[:2]  # the old mapping lives while viewed
        _fill(tier)
        assert [bytes(v) for v in tier.get_many(KEYS)] == BLOCKS
        assert tier.num_in_place == 8 and tier.transport() == "doorbell+slab"
    finally:
        d.close()


def test_concurrent_readers_and_writers_never_see_wrong_bytes(
    remote: Callable[..., RemoteTier],
) -> None:
    """Four threads for ~2 s over a 12-slot slab: each reads a random batch (leased where the
    blocks are host hits, copied otherwise), checks every byte before its next call, and
    writes new blocks that keep evicting. No wrong byte, no error; the pins all come back."""
    import random

    d = Daemon(slots=12)
    keys = [f"aaaa/{i:032x}" for i in range(40)]
    blocks = {k: sized_block(k, SIZE) for k in keys}
    errors: list[str] = []
    in_place = [0] * 4

    def client(c: int) -> None:
        rng = random.Random(c)
        tier = RemoteTier(d.url, batch_keys=2)
        try:
            end = time.monotonic() + 2.0
            while time.monotonic() < end:
                batch = rng.sample(keys, rng.randint(1, 3))
                if rng.random() < 0.5:
                    tier.put_many([(k, blocks[k]) for k in batch])
                for k, v in zip(batch, tier.get_many(batch), strict=True):
                    if v is not None and bytes(v) != blocks[k]:
                        errors.append(f"client {c}: wrong bytes for {k}")
            in_place[c] = tier.num_in_place
        except Exception as exc:
            errors.append(f"client {c}: {exc!r}")
        finally:
            tier.close()

    try:
        threads = [threading.Thread(target=client, args=(c,)) for c in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert sum(in_place) > 0  # the leased path was exercised
        d.wait_released()
        d.host.check_integrity()
    finally:
        d.close()
