"""The scheduler process's view of the tier stack: every tier below the host tier. Torch-free.

The worker process owns the store (host tier on top, the lower tiers under it, write policy
and all). The scheduler, in the engine-core process, only asks which leading blocks exist: it
builds the same lower tiers itself (Redis, S3 and the cache server are shared services anyway)
except LMDB, which it reads through ``LmdbReadView`` (the worker's ``LmdbTier`` is the one
writer). A block still only in the worker's host tier is not seen (it is computed again, and
its write-through copy makes it visible a moment later); a block seen here but gone by the
time the worker loads it is a load error, recomputed. Errors: what ``tiers.build_tiers`` raises.
"""

from __future__ import annotations

from cachestore.store.hierarchical import HierarchicalStore
from cachestore.store.types import StoreConfig
from connectors.vllm.lmdb_view import LmdbReadView
from tiers import Tier, build_tiers
from tiers.config import HostTierConfig, LmdbTierConfig, TierStackConfig


def build_lookup_store(stack: TierStackConfig, namespace_prefix: str) -> HierarchicalStore:
    """A store over the non-host tiers of ``stack`` for ``lookup`` only (nothing is written,
    nothing promoted). Raises ConfigError/TierError from the tiers; closes what it built then."""
    configs = [c for c in stack.tiers if not isinstance(c, HostTierConfig)]
    tiers: list[Tier] = []
    try:
        for cfg in configs:
            if isinstance(cfg, LmdbTierConfig):
                tiers.append(LmdbReadView(cfg.path))
            else:
                tiers.extend(build_tiers(TierStackConfig(tiers=(cfg,))))
    except BaseException:
        for tier in tiers:
            tier.close()
        raise
    return HierarchicalStore(tiers, StoreConfig(namespace=namespace_prefix, promote_on_get=False))
