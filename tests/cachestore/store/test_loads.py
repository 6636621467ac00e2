"""Prepared loads: ``prepare_load`` says where the host blocks are and the store holds every pin
of the load (claims, located slots, staged slots) until ``complete_load(spec)`` releases them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cachestore.codec import BlockMeta, encode_block, encoded_size
from cachestore.store.hierarchical import HierarchicalStore, StoreConfig
from cachestore.store.loads import HostCheck
from tiers.host import HostTier
from tiers.lmdb import LmdbTier

META = BlockMeta(dtype="uint8", shape=(64,), layout="t", namespace="ns")
SIZE = encoded_size(META, keyed=True)
KEYS = [f"ns/{i}" for i in range(6)]
CHECK = HostCheck.for_meta(META)


def blob(i: int, key: str | None = None) -> bytes:
    return encode_block(bytes([i]) * 64, META, key=key if key is not None else KEYS[i])


@pytest.fixture()
def store(tmp_path: Path) -> Iterator[HierarchicalStore]:
    s = HierarchicalStore(
        [HostTier(4 * SIZE, SIZE), LmdbTier(str(tmp_path / "l"), 1 << 20)],
        StoreConfig(namespace="ns", promote_on_get=False),
    )
    yield s
    s.close()


def host_pins(store: HierarchicalStore) -> dict[str, int]:
    return {k: e.pins for k, e in store.tiers[0]._entries.items() if e.pins}


def test_prepare_load_locates_the_host_run_and_complete_releases_everything(
    store: HierarchicalStore,
) -> None:
    store.put_many([(KEYS[i], blob(i)) for i in (0, 1, 3)])
    store.tiers[1].put_many([(KEYS[2], blob(2))])
    spec = store.prepare_load(KEYS[:4], CHECK)
    # Keys 0, 1 lead in the host tier; 2 is in LMDB only, so the host run stops there.
    assert spec.num_pinned == 4 and len(spec.host_offsets) == 2
    slab = store.host_slab()
    assert slab is not None
    assert slab.locate(KEYS[:2], [CHECK.header_for(k) for k in KEYS[:2]], SIZE) == list(
        spec.host_offsets
    )
    # Claims pin 0, 1, 3 in the host tier and 2 in LMDB; the located run is pinned again.
    assert host_pins(store) == {KEYS[0]: 2, KEYS[1]: 2, KEYS[3]: 1}
    assert store.stats()["load_pins"] == 4
    store.complete_load(spec)
    assert host_pins(store) == {} and store.stats()["load_pins"] == 0
    store.complete_load(spec)  # a completed spec holds nothing: a second call does nothing
    assert host_pins(store) == {}


def test_a_header_mismatch_ends_the_run_and_its_pin_is_not_kept(store: HierarchicalStore) -> None:
    store.put_many([(KEYS[0], blob(0)), (KEYS[1], blob(1, key="ns/other"))])
    spec = store.prepare_load(KEYS[:2], CHECK, claim=False)
    assert spec.num_pinned == 1 and len(spec.host_offsets) == 1
    assert host_pins(store) == {KEYS[0]: 1}
    store.complete_load(spec)
    assert host_pins(store) == {}


def test_a_partial_complete_releases_only_those_keys(store: HierarchicalStore) -> None:
    store.put_many([(KEYS[i], blob(i)) for i in range(3)])
    spec = store.prepare_load(KEYS[:3], CHECK, claim=False)
    assert len(spec.host_offsets) == 3
    store.complete_load(spec, KEYS[1:3])
    assert host_pins(store) == {KEYS[0]: 1}
    store.complete_load(spec)
    assert host_pins(store) == {}


def test_split_load_hands_one_pin_per_listed_key_to_a_spec_of_its_own(
    store: HierarchicalStore,
) -> None:
    store.put_many([(KEYS[i], blob(i)) for i in range(2)])
    spec = store.prepare_load([KEYS[0], KEYS[1], KEYS[0]], CHECK, claim=False)
    assert len(spec.host_offsets) == 3 and host_pins(store) == {KEYS[0]: 2, KEYS[1]: 1}
    lent = store.split_load(spec, [KEYS[0], KEYS[2]])  # KEYS[2]: no pin there to move
    assert lent.num_pinned == 1
    store.complete_load(spec)  # the rest: one pin of KEYS[0], KEYS[1]'s
    assert host_pins(store) == {KEYS[0]: 1}
    store.complete_load(lent)
    assert host_pins(store) == {}
    assert store.split_load(spec, [KEYS[0]]).num_pinned == 0  # a completed spec has none


def test_staged_blocks_are_held_by_the_spec_and_located(store: HierarchicalStore) -> None:
    store.tiers[1].put_many([(KEYS[i], blob(i)) for i in range(2)])
    spec = store.prepare_load(KEYS[:2], claim=False)
    assert spec.num_pinned == 0 and spec.host_offsets == ()
    run = store.stage_load(spec, KEYS[:2], CHECK)
    assert run.num_pinned == 2 and len(run.host_offsets) == 2
    assert host_pins(store) == {KEYS[0]: 2, KEYS[1]: 2}  # staged, then located
    store.complete_load(spec)
    assert host_pins(store) == {}
    # Staging for a spec already completed keeps nothing pinned.
    run = store.stage_load(spec, KEYS[:2], CHECK)
    assert run.num_pinned == 2 and host_pins(store) == {}


def test_read_pinned_releases_its_pins_on_the_way_out(store: HierarchicalStore) -> None:
    store.put_many([(KEYS[0], blob(0))])
    with store.read_pinned(KEYS[:2], decoded=True) as values:
        assert host_pins(store) == {KEYS[0]: 1}
        assert values[0] is not None and bytes(values[0]) == bytes([0]) * 64
        assert values[1] is None
    assert host_pins(store) == {}
