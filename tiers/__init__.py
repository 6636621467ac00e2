"""Tier registry: ``kind`` -> factory, each factory importing its backend module lazily.

A factory takes the kind's frozen config (``tiers.config``) and returns a ready Tier.
The built-in kinds resolve to these classmethods, so a backend module only needs to exist and
expose its factory under this name (nothing imports it until that kind is configured).
Each factory takes its kind's one config class (``tiers.config``) as is:

    host    tiers.host:HostTier.from_config(HostTierConfig)
    lmdb    tiers.lmdb:LmdbTier.from_config(LmdbTierConfig)
    redis   tiers.redis:RedisTier.from_config(RedisTierConfig)
    s3      tiers.s3:S3Tier.from_config(S3TierConfig)
    remote  tiers.remote.tier:RemoteTier.from_config(RemoteTierConfig)

``build_tiers`` builds a whole configured stack (``tiers.config``) through it.
``register_tier`` adds or replaces a kind (tests, out-of-tree tiers). The registry is mutated
only by ``register_tier``; it is safe to read from several threads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from tiers.base import Evicted, Tier, TierError, TierUsage, Value
from tiers.config import ConfigError, HostTierConfig, TierStackConfig, check_resources

TierFactory = Callable[[Any], Tier]


def _host(config: Any) -> Tier:
    from tiers.host import HostTier

    return HostTier.from_config(config)


def _lmdb(config: Any) -> Tier:
    from tiers.lmdb import LmdbTier

    return LmdbTier.from_config(config)


def _redis(config: Any) -> Tier:
    from tiers.redis import RedisTier

    return RedisTier.from_config(config)


def _s3(config: Any) -> Tier:
    from tiers.s3 import S3Tier

    return S3Tier.from_config(config)


def _remote(config: Any) -> Tier:
    from tiers.remote.tier import RemoteTier

    return RemoteTier.from_config(config)


_FACTORIES: dict[str, TierFactory] = {
    "host": _host,
    "lmdb": _lmdb,
    "redis": _redis,
    "s3": _s3,
    "remote": _remote,
}


def register_tier(kind: str, factory: TierFactory) -> None:
    """Add or replace the factory for ``kind``."""
    _FACTORIES[kind] = factory


def tier_kinds() -> list[str]:
    return sorted(_FACTORIES)


def create_tier(config: Any) -> Tier:
    """Build the tier for ``config`` (any object with a ``kind`` attribute).

    Raises ValueError for an unregistered kind; backend errors propagate.
    """
    kind = getattr(config, "kind", None)
    factory = _FACTORIES.get(kind) if isinstance(kind, str) else None
    if factory is None:
        raise ValueError(f"no tier registered for kind {kind!r}; known: {tier_kinds()}")
    return factory(config)


def build_tiers(config: TierStackConfig, *, host_slot_bytes: int | None = None) -> list[Tier]:
    """Construct every tier of ``config`` through this registry, top first.

    ``host_slot_bytes`` fills in a host tier's ``slot_bytes`` when the YAML leaves it out (the
    engine knows its block size). ``check_resources`` first. On any failure the tiers built so
    far are closed and the error propagates (ConfigError for a missing slot size or a resource
    check, TierError or ImportError from a backend).
    """
    check_resources(config)
    built: list[Tier] = []
    try:
        for cfg in config.tiers:
            if isinstance(cfg, HostTierConfig) and cfg.slot_bytes is None:
                if host_slot_bytes is None:
                    raise ConfigError("host tier: 'slot_bytes' is not set and the engine gave none")
                cfg = dataclasses.replace(cfg, slot_bytes=host_slot_bytes)
            built.append(create_tier(cfg))
    except BaseException:
        for tier in built:
            tier.close()
        raise
    return built


__all__ = [
    "Evicted",
    "Tier",
    "TierError",
    "TierUsage",
    "Value",
    "build_tiers",
    "create_tier",
    "register_tier",
    "tier_kinds",
]
