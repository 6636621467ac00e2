"""Blocks a lower tier holds are saved into the top tier again only while that pays: a host
tier that evicts such re-saved blocks unread (smaller than the span between two uses, the QA
client over a 2 GiB host tier and LMDB) stops taking them; one that reads them back, or has
room for them, keeps taking them. Blocks no lower tier holds are always saved."""

from __future__ import annotations

from pathlib import Path

from cachestore.hashing import block_key, hash_request_tokens
from cachestore.store import resave
from cachestore.store.resave import ResaveGate
from tests.cachestore.store_helpers import NS, block, counters, make_store

MANY = [block_key(NS, h) for h in hash_request_tokens(NS, list(range(16 * 400)))]


def _in_lmdb(tmp_path: Path, n: int, host_blocks: int):
    """A store whose LMDB holds ``MANY[:n]`` (and whose host tier holds none of them)."""
    store = make_store(tmp_path, host_blocks=host_blocks, lmdb_blocks=n + 8)
    store.put_many([(k, block(i % 256)) for i, k in enumerate(MANY[:n])])
    store.flush()
    host, lmdb = store.tiers
    store.delete_many([k for k in host.lru_keys()])  # the host's copies go; LMDB keeps its own
    for k in MANY[:n]:
        if k not in lmdb._index:  # what the host held never went down: put it there
            lmdb.put_many([(k, block(MANY.index(k) % 256))])
    assert all(k in lmdb._index for k in MANY[:n]) and not host.lru_keys()
    return store


def _offer(store, keys: list[str], read: bool) -> int:
    """Offer each key for saving, as the engine does when it frees a block; save what the
    store wants, and read it back from the host tier at once when ``read``. Returns how many
    it wanted."""
    host = store.tiers[0]
    kept = 0
    for k in keys:
        if store.worth_saving([k]) == [k]:
            kept += 1
            store.put_many([(k, block(MANY.index(k) % 256))])
            if read:
                assert host.get_many([k])[0] is not None
    return kept


def test_re_saves_evicted_unread_stop_and_fresh_blocks_still_go_in(tmp_path: Path) -> None:
    store = _in_lmdb(tmp_path, 200, host_blocks=8)
    # 8 slots, 200 re-saves, each evicted unread: the gate turns off once a window of
    # evictions is in (after WINDOW + 8 saves); from then on only the probes go in.
    first = _offer(store, MANY[:200], read=False)
    opened = resave.WINDOW + 8
    assert first == opened + (200 - opened) // resave.PROBE
    evicted, unread = store.tiers[0].resave_outcomes()
    assert evicted == unread == first - 8
    again = _offer(store, MANY[:200], read=False)
    assert again == 200 // resave.PROBE
    assert counters(store, "resave_bypassed")[0] == 400 - first - again
    fresh = MANY[300:310]  # no lower tier holds these: saved whatever the gate says
    assert store.worth_saving(fresh) == fresh
    store.close()


def test_re_saves_read_back_keep_going_in(tmp_path: Path) -> None:
    store = _in_lmdb(tmp_path, 200, host_blocks=8)
    assert _offer(store, MANY[:200] * 2, read=True) == 400
    assert store.tiers[0].resave_outcomes() == (392, 0)
    assert counters(store, "resave_bypassed")[0] == 0
    store.close()


def test_a_host_tier_with_room_takes_every_re_save(tmp_path: Path) -> None:
    store = _in_lmdb(tmp_path, 200, host_blocks=256)
    assert _offer(store, MANY[:200] * 2, read=False) == 400
    assert store.tiers[0].resave_outcomes() == (0, 0)
    store.close()


def test_the_gate_decides_per_window_and_turns_back_on() -> None:
    counts = [0, 0]
    gate = ResaveGate(lambda: (counts[0], counts[1]))
    held = lambda k: k.startswith("held")  # noqa: E731
    keys = [f"held{i}" for i in range(16)] + ["fresh"]
    counts[:] = [resave.WINDOW - 1, resave.WINDOW - 1]  # not a whole window yet
    assert gate.filter(keys, held) == keys and not gate.off
    counts[:] = [resave.WINDOW, resave.WINDOW]  # a window, all unread: off
    kept = gate.filter(keys, held)
    assert gate.off and "fresh" in kept and len(kept) == 1 + 16 // resave.PROBE
    # The next window: a fifth of the re-saves were read before eviction: back on.
    counts[:] = [2 * resave.WINDOW, resave.WINDOW + int(0.8 * resave.WINDOW)]
    assert gate.filter(keys, held) == keys and not gate.off


def test_a_block_a_load_stages_from_lmdb_is_not_a_re_save(tmp_path: Path) -> None:
    """A load placing LMDB's blocks in the host slab commits them pinned: they count neither
    as re-saves nor, once evicted, against re-saving."""
    store = _in_lmdb(tmp_path, 40, host_blocks=8)
    host = store.tiers[0]
    for k in MANY[:40]:
        res = host.reserve(k, len(block(0)))
        res.view[:] = block(MANY.index(k) % 256)
        assert host.commit(k, pin=True)
        host.unpin([k])
    assert host.resave_outcomes() == (0, 0)
    store.close()
