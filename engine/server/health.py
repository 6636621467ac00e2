"""The ``GET /health`` body: whether the engine serves, and the state of each KV offload tier.

A tier is ``down`` while its last call failed (``consecutive_failures`` > 0 in the store's
per-tier row: ``cachestore.store.guarded_tiers`` backs it off and probes it again later) and
``up`` otherwise. A down tier does not stop the engine, which answers its lookups as misses
and recomputes, so the status is then ``degraded`` with HTTP 200: a load balancer keeps the
replica, a person or an alert reads the body. States come from the engine's stats snapshot
(refreshed after each step, a second after the engine goes idle and every 5 s while idle); an
idle store pings each tier nothing used for ``health_probe_s`` (5 s; cachestore/store/prober.py),
so a tier that dies or comes back while no request runs shows within about 10 s. Nothing is
probed for this request.

Body: ``{"status": "ok" | "degraded", "tiers": [{"name", "state"}, ...]}`` (``tiers`` empty
without ``--kv-offload``); ``?verbose=1`` adds each tier's counters (``errors``, ``skipped``,
``consecutive_failures``, ``hits``, ``misses``, ``write_queue_depth``) and the model.
"""

from __future__ import annotations

from typing import Any

from engine.core.base import EngineStats

TIER_DETAILS = ("consecutive_failures", "errors", "skipped", "hits", "misses", "write_queue_depth")


def tier_rows(stats: EngineStats) -> list[dict[str, Any]]:
    """The store's per-tier rows in an engine stats snapshot (none without offload)."""
    kv = stats.get("kv")
    store = kv.get("store") if isinstance(kv, dict) else None
    rows = store.get("tiers") if isinstance(store, dict) else None
    return [r for r in rows or [] if isinstance(r, dict) and "name" in r]


def health_body(
    stats: EngineStats, *, verbose: bool = False, model: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The JSON body for a running engine (see the module docstring). Pure."""
    tiers = []
    for row in tier_rows(stats):
        state = "down" if row.get("consecutive_failures", 0) else "up"
        entry: dict[str, Any] = {"name": row["name"], "state": state}
        if verbose:
            entry.update({k: row[k] for k in TIER_DETAILS if k in row})
        tiers.append(entry)
    degraded = any(t["state"] != "up" for t in tiers)
    body: dict[str, Any] = {"status": "degraded" if degraded else "ok", "tiers": tiers}
    if verbose and model is not None:
        body["model"] = model
    return body


def is_verbose(value: str | None) -> bool:
    """``?verbose``, ``?verbose=1``, ``=true``, ``=yes`` -> True; absent, ``0``, ``false`` -> False."""
    if value is None:
        return False
    return value.strip().lower() not in ("0", "false", "no", "off")
