"""The remote tier against a real daemon: Tier contract semantics, pipelining, threads,
server down -> fast TierError (a miss to the store), then recovery on the same port."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachestore.server.daemon import CacheServer, ServerConfig
from cachestore.store.hierarchical import HierarchicalStore, StoreConfig
from tests.cachestore.store_helpers import sized_block
from tests.servers import free_port
from tiers import create_tier
from tiers.base import TierError
from tiers.config import parse_tier_entry
from tiers.lmdb import LmdbTier
from tiers.remote.protocol import ServerLimits, TokenTable
from tiers.remote.tier import RemoteTier


def _serve(path: Path, port: int) -> tuple[CacheServer, HierarchicalStore]:
    backend = HierarchicalStore([LmdbTier(path, 64 << 20)], StoreConfig())
    limits = ServerLimits(max_keys_per_request=16)
    server = CacheServer(ServerConfig(url=f"tcp://127.0.0.1:{port}", limits=limits), backend)
    return server.start(), backend


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[CacheServer, int]]:
    port = free_port()
    server, backend = _serve(tmp_path / "lmdb", port)
    yield server, port
    server.stop()
    backend.close()


@pytest.mark.parametrize("use_shm", [False, True])
def test_contract_round_trip(served: tuple[CacheServer, int], use_shm: bool) -> None:
    _, port = served
    tier = RemoteTier(f"tcp://127.0.0.1:{port}", use_shm=use_shm, batch_keys=5)
    keys = [f"abcd/{i:040x}" for i in range(50)]  # 10 requests in flight, server cap 16 keys
    values = [sized_block(k, 100 + i * 1000) for i, k in enumerate(keys)]
    assert tier.lookup(keys) == 0 and tier.get_many(keys[:3]) == [None, None, None]
    tier.put_many(list(zip(keys[:20], values[:20], strict=True)))
    assert tier.lookup(keys) == 20
    assert tier.lookup([keys[0], keys[30], keys[1]]) == 1
    assert tier.contains(keys[19]) and not tier.contains(keys[20])
    tier.put_many(list(zip(keys[20:], values[20:], strict=True)))
    assert tier.lookup(keys) == 50
    got = tier.get_many(list(reversed(keys)))
    assert [bytes(v) for v in got] == list(reversed(values))  # ordered like keys
    tier.put_many([(keys[0], sized_block(keys[0], 99))])
    assert bytes(tier.get_many([keys[0]])[0]) == sized_block(keys[0], 99)
    assert tier.delete_many(keys[:10] + keys[:2]) == 10
    assert tier.lookup(keys) == 0 and tier.lookup(keys[10:]) == 40
    # Per key, past gaps: one single-key lookup request a key, batch_keys of them a call.
    flags = tier.contains_many(keys[5:45] + keys[:3])
    assert flags == [False] * 5 + [True] * 35 + [False] * 3
    assert tier.usage().num_entries == 40
    tier.close()
    tier.close()  # idempotent
    with pytest.raises(TierError):
        tier.lookup(keys)


def test_threads_share_one_tier(served: tuple[CacheServer, int]) -> None:
    _, port = served
    tier = RemoteTier(f"tcp://127.0.0.1:{port}")
    errors: list[str] = []

    def work(t: int) -> None:
        keys = [f"t{t}/{i:04x}" for i in range(40)]
        for _ in range(5):
            tier.put_many([(k, sized_block(k, 3000)) for k in keys])
            got = tier.get_many(keys)
            if [None if v is None else bytes(v) for v in got] != [
                sized_block(k, 3000) for k in keys
            ]:
                errors.append(f"thread {t}: wrong values")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert errors == []
    tier.close()


def test_server_down_is_fast_error_then_recovery(tmp_path: Path) -> None:
    port = free_port()
    server, backend = _serve(tmp_path / "lmdb", port)
    tier = RemoteTier(f"tcp://127.0.0.1:{port}", timeout_s=0.5, retry_interval_s=0.3)
    tier.put_many([("ns/01", sized_block("ns/01", 120))])
    server.stop()
    backend.close()
    t0 = time.monotonic()
    with pytest.raises(TierError):
        tier.get_many(["ns/01"])
    assert time.monotonic() - t0 < 1.5  # bounded by timeout_s, never a hang
    t0 = time.monotonic()
    with pytest.raises(TierError, match="unavailable"):
        tier.lookup(["ns/01"])  # within retry_interval_s: fails without waiting
    assert time.monotonic() - t0 < 0.1
    server, backend = _serve(tmp_path / "lmdb", port)  # same port, same LMDB
    time.sleep(0.4)
    assert bytes(tier.get_many(["ns/01"])[0]) == sized_block("ns/01", 120)
    tier.close()
    server.stop()
    backend.close()


def test_daemon_restart_renegotiates_shm(tmp_path: Path) -> None:
    port = free_port()
    server, backend = _serve(tmp_path / "lmdb", port)
    tier = RemoteTier(f"tcp://127.0.0.1:{port}", use_shm=True, timeout_s=2)
    tier.put_many([("ns/02", sized_block("ns/02", 5000))])
    server.stop()
    backend.close()
    server, backend = _serve(tmp_path / "lmdb", port)
    deadline = time.monotonic() + 10
    while True:  # ZMQ reconnects in the background; the first call may race it
        try:
            got = tier.get_many(["ns/02"])
            break
        except TierError:
            assert time.monotonic() < deadline
            time.sleep(0.2)
    assert bytes(got[0]) == sized_block(
        "ns/02", 5000
    )  # the daemon forgot the segment: hello again, retried
    tier.close()
    server.stop()
    backend.close()


def test_built_from_tier_config(served: tuple[CacheServer, int]) -> None:
    _, port = served
    cfg = parse_tier_entry({"kind": "remote", "url": f"tcp://127.0.0.1:{port}", "token": "t0k3n-x"})
    tier = create_tier(cfg)
    assert isinstance(tier, RemoteTier) and "t0k3n" not in repr(tier)
    tier.put_many([("ns/03", sized_block("ns/03", 80))])
    assert bytes(tier.get_many(["ns/03"])[0]) == sized_block("ns/03", 80)
    tier.close()
    with pytest.raises(ValueError, match="tcp://"):
        RemoteTier("http://example.com")


def test_token_file_and_timeout_ms_reach_the_tier(tmp_path: Path) -> None:
    store = HierarchicalStore([LmdbTier(tmp_path / "lmdb", 16 << 20)], StoreConfig())
    server = CacheServer(
        ServerConfig(url="tcp://127.0.0.1:0"), store, TokenTable.parse("tok-from-file-1 team\n")
    ).start()
    try:
        (tmp_path / "token").write_text("  tok-from-file-1\n")
        cfg = parse_tier_entry(
            {
                "kind": "remote",
                "url": server.bound_url,
                "token_file": str(tmp_path / "token"),
                "timeout_ms": 1500,
            }
        )
        tier = create_tier(cfg)
        assert isinstance(tier, RemoteTier) and tier.timeout_s == 1.5
        tier.put_many([("ns/04", sized_block("ns/04", 90))])  # accepted: the file's token is valid
        assert tier.usage().num_entries == 1 and "tok-from" not in repr(tier)
        tier.close()
        (tmp_path / "empty").write_text("\n")
        for path, needle in ((tmp_path / "empty", "is empty"), (tmp_path / "nope", "cannot read")):
            bad = parse_tier_entry(
                {"kind": "remote", "url": server.bound_url, "token_file": str(path)}
            )
            with pytest.raises(TierError, match=needle):
                create_tier(bad)
    finally:
        server.stop()
        store.close()


def test_zmq_replies_are_spun_for_only_after_small_messages(
    served: tuple[CacheServer, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loopback ZMQ call polls before it blocks, but not while a large message crosses:
    not after sending large put frames, and not for a get whose last reply was large."""
    from tiers.remote import conn as remote_conn

    _, port = served
    tier = RemoteTier(f"tcp://127.0.0.1:{port}", use_shm=False, use_stream=False)
    spins: list[bool] = []
    wait_in = remote_conn.Connections._wait_in

    def spy(self: remote_conn.Connections, sock: object, deadline: float, spin: bool) -> bool:
        spins.append(spin)
        return wait_in(self, sock, deadline, spin)  # type: ignore[arg-type]

    monkeypatch.setattr(remote_conn.Connections, "_wait_in", spy)
    small, big = "abcd/" + "1" * 40, "abcd/" + "2" * 40
    limit = remote_conn.SPIN_MAX_BYTES
    try:
        tier.put_many([(small, sized_block(small, 1000))])  # (a hello first: small too)
        tier.put_many([(big, sized_block(big, limit + 1))])
        assert spins == [True, True, False]
        spins.clear()
        tier.get_many([small])  # no get reply seen yet: spins
        tier.get_many([big])  # the last get reply was small: spins
        tier.get_many([small])  # the last get reply was large: blocks
        tier.get_many([small])
        tier.lookup([big])  # another op: its own history
        assert spins == [True, True, False, True, True]
    finally:
        tier.close()
