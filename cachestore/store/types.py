"""The hierarchical store's config and result types, and what it needs of a pin-capable tier.

``StoreConfig`` is the store's one frozen config (with a ``WritePolicy`` per tier, read from the
tier stack's config by ``write_policies``; the policy names are ``tiers.config``'s);
``LookupResult`` (with a ``TierLookup`` per
tier) is what ``HierarchicalStore.lookup`` answers. ``PinningTier`` is the structural protocol
the store checks to pin keys between ``prepare_load`` and ``complete_load`` (host, lmdb).
Immutable values, safe to share between threads. Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from tiers.config import WRITE_BACK, WRITE_POLICIES, HostTierConfig, TierStackConfig


@dataclass(frozen=True, slots=True)
class WritePolicy:
    """When a block saved to the top tier reaches one lower tier (``cachestore.store.write_through``).

    ``hits``: for ``write_through_selective``, the hit (a read of the block from the store) at
    which it is queued. ``queue_blocks``: bound of the tier's write-through queue, in blocks;
    a block that does not fit is not copied (counted ``write_queue_dropped``)."""

    policy: str = WRITE_BACK
    hits: int = 2
    queue_blocks: int = 1024

    def __post_init__(self) -> None:
        if self.policy not in WRITE_POLICIES:
            raise ValueError(f"write policy {self.policy!r}; choose one of {WRITE_POLICIES}")
        if self.hits <= 0 or self.queue_blocks <= 0:
            raise ValueError("write policy: hits and queue_blocks must be positive")

    @property
    def copies_down(self) -> bool:
        """True for the write-through policies (queued copies), False for write-back."""
        return self.policy != WRITE_BACK


def write_policies(config: TierStackConfig) -> tuple[WritePolicy, ...]:
    """Each tier's ``WritePolicy``, top first (a host tier's is write-back: saves land there)."""
    return tuple(
        WritePolicy()
        if isinstance(c, HostTierConfig)
        else WritePolicy(c.write_policy, c.write_through_hits, c.write_queue_blocks)
        for c in config.tiers
    )


@dataclass(frozen=True, slots=True)
class StoreConfig:
    namespace: str | None = None  # expected ``Namespace.key_prefix()`` of every block; None: any
    queue_batches: int = 64  # per-tier demotion / promotion queue bound, in batches
    promote_on_get: bool = True
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 60.0
    ewma_alpha: float = 0.2
    # Index of a tier ``put_many`` also writes synchronously (a durable one, e.g. LMDB), so an
    # acknowledged put survives a crash of the process. None: the top tier only.
    write_through_to: int | None = None
    # Leading ``/`` components of a store key that are not part of the key its blocks carry
    # (``codec.block_key_of``): 0 for the engine (store key == block key), 1 for the cache
    # daemon (``tenant/`` + the client's key). Every read checks a keyed block against it.
    block_key_skip: int = 0
    # Asynchronous write policy of each tier, top first (the top's own is ignored: saves land
    # there). Shorter than the tier list: the rest are write-back (the store's old behaviour).
    write_policies: tuple[WritePolicy, ...] = ()
    # Every this many seconds, a tier no call reached meanwhile is pinged (``Tier.ping``), so an
    # idle store's tier health (``/health``, ``consecutive_failures``) follows its backend.
    # 0: never (health then changes only when the tiers are used).
    probe_interval_s: float = 5.0

    def __post_init__(self) -> None:
        if self.write_through_to is not None and self.write_through_to < 0:
            raise ValueError("write_through_to must be a tier index >= 0 or None")
        if self.queue_batches <= 0 or not 0 < self.ewma_alpha <= 1:
            raise ValueError("queue_batches must be positive and ewma_alpha in (0, 1]")
        if not 0 < self.backoff_initial_s <= self.backoff_max_s:
            raise ValueError("need 0 < backoff_initial_s <= backoff_max_s")
        if self.block_key_skip < 0:
            raise ValueError("block_key_skip must be >= 0")
        if self.probe_interval_s < 0:
            raise ValueError("probe_interval_s must be >= 0 (0: no idle probes)")


@dataclass(frozen=True, slots=True)
class TierLookup:
    name: str
    num_leading: int  # leading keys this tier holds (0 when it failed or is backing off)


@dataclass(frozen=True, slots=True)
class LookupResult:
    per_tier: tuple[TierLookup, ...]
    served_by: tuple[int, ...]  # tier index serving each block of the available prefix

    @property
    def num_blocks(self) -> int:
        """Length of the longest prefix available across all tiers."""
        return len(self.served_by)

    def runs(self) -> list[tuple[int, int, int]]:
        """``(tier_index, start, count)`` for each stretch of blocks served by one tier."""
        out: list[tuple[int, int, int]] = []
        for i, tier in enumerate(self.served_by):
            if out and out[-1][0] == tier:
                out[-1] = (tier, out[-1][1], out[-1][2] + 1)
            else:
                out.append((tier, i, 1))
        return out


@runtime_checkable
class PinningTier(Protocol):
    """A tier that can keep entries from eviction (host, lmdb). Pins are counted per key."""

    def pin_each(self, keys: Sequence[str]) -> list[bool]:
        """Pin every present key of ``keys`` (past a missing one too) in one call; True where
        pinned. A key given twice is pinned twice. Raises TierError on a backend failure."""
        ...

    def unpin(self, keys: Sequence[str]) -> None:
        """Undo one pin per key; absent or unpinned keys are ignored."""
        ...


@runtime_checkable
class SlabTier(Protocol):
    """A tier over one fixed memory slab (the host tier): in-place reads and writes for the
    store's host fast path (``HierarchicalStore.prepare_load`` with a host check,
    ``reserve_host``)."""

    def locate(
        self,
        keys: Sequence[str],
        header: bytes | Sequence[bytes],
        nbytes: int,
        *,
        pin: bool = False,
    ) -> list[int | None]:
        """Slab offset of each committed entry of size ``nbytes`` starting with ``header``;
        ``pin``: pin each hit too."""
        ...

    def reserve(self, key: str, nbytes: int) -> Any:
        """A slot to write in place (with ``offset`` and ``evicted``), or None."""
        ...

    slot_bytes: int

    def commit(self, key: str, nbytes: int | None = None, *, pin: bool = False) -> bool:
        """Make a reserved slot visible (``nbytes``: the block's size when it differs from
        the reservation's; ``pin``: pinned as it becomes visible)."""
        ...

    def abort(self, key: str) -> None:
        """Free a reserved slot."""
        ...

    def slab_tensor(self) -> Any:
        """The slab as a uint8 torch tensor (None without torch)."""
        ...

    def available_slots(self) -> int:
        """Slots a write could take now (free, or evictable)."""
        ...
