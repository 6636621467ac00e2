"""Host-slot reuse under concurrent put/evict while a get is copying a block out (issue 16,
F1): the interleavings that served another key's block, replayed deterministically.

``InterleavedHost`` is a real ``HostTier`` that runs a hook right after a ``pin_each`` or
``get_many`` call returns: exactly where a concurrent request's put or eviction landed on the
daemon. No mocks: real store, real daemon, real ZMQ client.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import pytest

from cachestore.server.daemon import CacheServer, ServerConfig
from cachestore.store.hierarchical import HierarchicalStore, StoreConfig
from tests.cachestore.store_helpers import sized_block
from tiers.base import TierError, Value
from tiers.host import HostTier
from tiers.remote.protocol import TokenTable
from tiers.remote.tier import RemoteTier

SLOT = 8 << 10
TOKENS = "tok-alice-0001 alice\ntok-bob-000002 bob\n"
ALICE = "tok-alice-0001"


class InterleavedHost(HostTier):
    """A host tier running ``after_pin_each`` / ``after_get_many`` once (then cleared) right
    after the next such call returns, outside the tier's lock, as another thread would."""

    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots * SLOT, SLOT, pin_memory=False)
        self.after_pin_each: Callable[[], None] | None = None
        self.after_get_many: Callable[[], None] | None = None

    def pin_each(self, keys: Sequence[str]) -> list[bool]:
        out = super().pin_each(keys)
        hook, self.after_pin_each = self.after_pin_each, None
        if hook is not None:
            hook()
        return out

    def get_many(self, keys: Sequence[str]) -> list[Value | None]:
        out = super().get_many(keys)
        hook, self.after_get_many = self.after_get_many, None
        if hook is not None:
            hook()
        return out


def _block(key: str) -> bytes:
    return sized_block(key, 5000)


def test_complete_load_keeps_another_callers_pin() -> None:
    """Caller X's prepare_load finds K absent (no pin), caller Z's finds it present (pin).
    X completing first must not drop Z's pin: before the fix it did, the next put evicted K
    and reused its slot, and Z's view showed another key's block."""
    host = HostTier(2 * SLOT, SLOT, pin_memory=False)
    store = HierarchicalStore([host], StoreConfig())
    try:
        key, other, third = "ns/k", "ns/other", "ns/third"
        x = store.prepare_load([key])
        assert x.num_pinned == 0  # X: absent
        store.put_many([(key, _block(key))])
        z = store.prepare_load([key])
        assert z.num_pinned == 1  # Z: pinned
        (view,) = store.get_many_encoded([key])  # Z reads while pinned
        store.complete_load(x)  # X is done (it pinned nothing)
        assert host.num_pins() == 1  # Z's pin is still there
        store.put_many([(other, _block(other)), (third, _block(third))])  # a full tier
        assert bytes(view) == _block(key)  # K was not evicted under Z
        store.complete_load(z)  # Z is done
        assert host.num_pins() == 0 and store.stats()["load_pins"] == 0
        store.put_many([(f"ns/{i}", _block(f"ns/{i}")) for i in range(2)])
        assert key not in host.lru_keys()  # unpinned now: evictable again
    finally:
        store.close()


def test_get_many_pinned_skips_a_host_entry_it_did_not_pin() -> None:
    """A put lands between the pin and the read: the key is read from the lower tiers (none
    here: a miss), never as an unpinned host view a second put then overwrites."""
    host = InterleavedHost(1)
    store = HierarchicalStore([host], StoreConfig())
    try:
        key, other = "ns/k", "ns/other"
        host.after_pin_each = lambda: host.put_many([(key, _block(key))])
        values, pinned = store.get_many_pinned([key])
        host.put_many([(other, _block(other))])  # evicts K: its slot now holds `other`
        assert values == [None] and pinned == []
        # Present and pinned: a view that stays K's block whatever is written meanwhile.
        host.put_many([(key, _block(key))])
        values, pinned = store.get_many_pinned([key])
        assert pinned == [key]
        host.put_many([(other, _block(other))])  # no free slot, K pinned: skipped
        assert bytes(values[0]) == _block(key)  # type: ignore[arg-type]
        store.unpin_host(pinned)
        assert host.num_pins() == 0
    finally:
        store.close()


@pytest.fixture
def daemon() -> Iterator[tuple[CacheServer, InterleavedHost]]:
    host = InterleavedHost(1)
    store = HierarchicalStore([host], StoreConfig())
    srv = CacheServer(
        ServerConfig(url="tcp://127.0.0.1:0", inline_reads=False), store, TokenTable.parse(TOKENS)
    ).start()
    yield srv, host
    srv.stop()
    store.close()


def test_pool_get_never_serves_a_reused_slot(
    daemon: tuple[CacheServer, InterleavedHost], remote: Callable[..., RemoteTier]
) -> None:
    """The daemon's pool-path get: the requested key appears in the host tier after the
    get's pins were taken (a concurrent put), and a second put evicts it and reuses its slot
    for another key (bob's, here) before the reply is copied out. Before the fix the client
    got bob's block for alice's key (it passes the codec checks: same namespace)."""
    srv, host = daemon
    key, bobs = "aaaa/" + "0" * 31 + "1", "aaaa/" + "0" * 31 + "2"
    ikey, ibobs = f"alice/{key}", f"bob/{bobs}"
    tier = remote(srv.bound_url, token=ALICE, use_shm=False, use_stream=False)
    host.after_pin_each = lambda: host.put_many([(ikey, _block(key))])
    host.after_get_many = lambda: host.put_many([(ibobs, _block(bobs))])
    got = tier.get_many([key])
    assert got[0] is None or bytes(got[0]) == _block(key)
    assert host.num_pins() == 0
    # And a get of a present key, with the same interleaving, is the key's block.
    host.put_many([(ikey, _block(key))])
    host.after_get_many = lambda: host.put_many([(ibobs, _block(bobs))])
    assert bytes(tier.get_many([key])[0]) == _block(key)  # type: ignore[arg-type]
    assert host.num_pins() == 0


def _keyed(key: str, n: int = 5000) -> bytes:
    from cachestore.codec import BlockMeta, encode_block

    return encode_block(bytes(n), BlockMeta("uint8", (n,), "test", key.split("/", 1)[0]), key=key)


def _wrong_key(store: HierarchicalStore) -> int:
    return sum(row["wrong_key"] for row in store.stats()["tiers"])


def test_store_read_of_a_block_under_another_key_is_a_counted_miss() -> None:
    """Defence in depth: whatever put a keyed block under the wrong key (a slot-reuse race,
    a backend bug), a read is a miss counted ``wrong_key`` (and ``corrupt``), the entry is
    dropped, and a keyless (codec version 1) block still reads."""
    host = HostTier(4 * SLOT, SLOT, pin_memory=False)
    store = HierarchicalStore([host], StoreConfig())
    try:
        store.put_many(
            [("ns/a", _keyed("ns/b")), ("ns/c", _keyed("ns/c")), ("ns/d", _block("ns/d"))]
        )
        got = store.get_many_encoded(["ns/a", "ns/c", "ns/d"])
        assert got[0] is None and bytes(got[1]) == _keyed("ns/c")  # type: ignore[arg-type]
        assert bytes(got[2]) == _block("ns/d")  # type: ignore[arg-type]
        row = store.stats()["tiers"][0]
        assert row["wrong_key"] == 1 and row["corrupt"] == 1
        assert "ns/a" not in host.lru_keys()
        values, pinned = store.get_many_pinned(["ns/c"])
        assert bytes(values[0]) == _keyed("ns/c") and pinned == ["ns/c"]  # type: ignore[arg-type]
        store.unpin_host(pinned)
    finally:
        store.close()


@pytest.mark.parametrize("inline,transport", [(True, "zmq"), (False, "zmq"), (True, "doorbell")])
def test_daemon_never_serves_a_block_under_another_key(
    inline: bool, transport: str, remote: Callable[..., RemoteTier]
) -> None:
    """The daemon's reads of a host slot holding another key's block (bob's block for
    alice's key, as the F1 race served): a miss on every path (the inline header check names
    the key; the pool path's decode counts it ``wrong_key``). Its puts of a block under
    another key are refused."""
    from tests.cachestore.wire_helpers import tenant_daemon

    srv, store = tenant_daemon(TOKENS, 8 * SLOT, SLOT, inline_reads=inline)
    try:
        key, bobs = "aaaa/" + "0" * 31 + "1", "aaaa/" + "0" * 31 + "2"
        tier = remote(srv.bound_url, token=ALICE, use_shm=transport == "doorbell", use_stream=False)
        tier.put_many([(bobs, _keyed(bobs))])  # learns the namespace's header (hint)
        assert bytes(tier.get_many([bobs])[0]) == _keyed(bobs)  # type: ignore[arg-type]
        assert tier.transport().startswith(transport)
        store.tiers[0].put_many([(f"alice/{key}", _keyed(f"{bobs}"))])  # the wrong block
        assert tier.get_many([key]) == [None]
        assert _wrong_key(store) == 1
        with pytest.raises(TierError, match="BAD_BLOCK"):
            tier.put_many([(key, _keyed(bobs))])  # a client putting another key's block
        assert tier.get_many([key]) == [None]
    finally:
        srv.stop()
        store.close()
