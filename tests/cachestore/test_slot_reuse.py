"""Host-slot reuse under concurrent put/evict while a get is copying a block out (issue 16,
F1): the interleavings that served another key's block, replayed deterministically.

``InterleavedHost`` is a real ``HostTier`` that runs a hook right after a ``pin_each`` or
``get_many`` call returns: exactly where a concurrent request's put or eviction landed on the
daemon. No mocks: real store, real daemon, real ZMQ client.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import pytest

from cachestore.server import CacheServer, ServerConfig
from cachestore.server_protocol import TokenTable
from cachestore.store import HierarchicalStore, StoreConfig
from tests.cachestore.store_helpers import sized_block
from tiers.base import Value
from tiers.host import HostTier
from tiers.remote import RemoteTier

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
        assert store.prepare_load([key]) == 0  # X: absent
        store.put_many([(key, _block(key))])
        assert store.prepare_load([key]) == 1  # Z: pinned
        (view,) = store.get_many_encoded([key])  # Z reads while pinned
        store.complete_load([key])  # X is done (it pinned nothing)
        assert host.num_pins() == 1  # Z's pin is still there
        store.put_many([(other, _block(other)), (third, _block(third))])  # a full tier
        assert bytes(view) == _block(key)  # K was not evicted under Z
        store.complete_load([key])  # Z is done
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
    srv = CacheServer(ServerConfig(url="tcp://127.0.0.1:0", inline_reads=False), store,
                      TokenTable.parse(TOKENS)).start()
    yield srv, host
    srv.stop()
    store.close()


def test_pool_get_never_serves_a_reused_slot(daemon: tuple[CacheServer, InterleavedHost],
                                             remote: Callable[..., RemoteTier]) -> None:
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
