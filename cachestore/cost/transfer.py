"""Timing one hop: a copy callback, a real tier, or a whole transfer path -> a ``TierCost``.

- ``calibrate_copy(copy_blocks, block_bytes)`` fits a ``TierCost`` to the time
  ``copy_blocks(n)`` takes for 1 and for ``num_blocks`` blocks: two sizes separate the fixed
  latency from the bandwidth. The host -> GPU hop is measured this way with a torch callback.
- ``calibrate_tier(tier, block_bytes)`` does the same through the read a load makes from a real
  tier (``get_many_into`` into rows allocated once, over ``readers`` threads, each block
  checksummed) on blocks it first writes with ``put_many`` under a private key prefix, and
  deletes them after.
- ``calibrate_transfer(load_blocks, block_bytes, name, sizes)`` times a whole caller-supplied
  transfer path (e.g. a lower tier -> host slab -> device load) at realistic batch sizes and
  fits latency + bandwidth by least squares over them (``fit_transfer``), so per-block costs
  (Python, page faults, checksums) show up in the bandwidth rather than vanishing in a small
  batch.

Torch-free (the callbacks do any device work). ``cachestore.cost.calibration`` runs these at
start-up and re-exports them.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import xxhash

from cachestore.cost.model import TierCost
from tiers.base import Tier


def calibrate_copy(
    copy_blocks: Callable[[int], float],
    block_bytes: int,
    name: str,
    *,
    num_blocks: int = 32,
    repeats: int = 3,
) -> TierCost:
    """Fit one hop from ``copy_blocks(n)`` (moves ``n`` blocks, returns seconds; the fastest of
    ``repeats`` counts) at ``n = 1`` and ``n = num_blocks``: ``B = (N-1)*b / (t_N - t_1)``,
    ``L = t_1 - b/B`` clamped at 0. When noise makes ``t_N <= t_1`` the bandwidth is taken as
    ``N*b / t_N``. Raises ValueError for ``num_blocks < 2`` or a non-positive time."""
    if num_blocks < 2 or block_bytes <= 0:
        raise ValueError(
            f"need num_blocks >= 2 and block_bytes > 0, got {num_blocks}, {block_bytes}"
        )
    copy_blocks(1)  # warm-up
    t1 = min(copy_blocks(1) for _ in range(repeats))
    tn = min(copy_blocks(num_blocks) for _ in range(repeats))
    if not (t1 > 0 and tn > 0):
        raise ValueError(f"{name}: copy times must be > 0, got {t1}, {tn}")
    if tn > t1:
        bandwidth = (num_blocks - 1) * block_bytes / (tn - t1)
    else:
        bandwidth = num_blocks * block_bytes / tn
    return TierCost(name, max(t1 - block_bytes / bandwidth, 0.0), bandwidth)


def calibrate_tier(
    tier: Tier, block_bytes: int, num_blocks: int = 32, *, repeats: int = 3, readers: int = 1
) -> TierCost:
    """Time the read a load makes through ``tier`` (see ``calibrate_copy``): ``get_many_into``
    of real blocks into rows allocated once, the keys split over ``readers`` threads as the
    load pipeline splits a chunk, each block checksummed (xxh3) as the store checks it. Writes
    ``num_blocks`` random blocks under a private prefix first and deletes them in any case.
    Raises TierError when the tier fails, ValueError when it did not keep the blocks.

    Why this read and not ``get_many``: a tier priced below what its loads achieve is never
    loaded from, so the online model never sees a sample that would correct it. Timing
    ``get_many`` plus a copy of each value out (two copies, a fresh allocation each) priced a
    page-cached LMDB at 3.06 GB/s on one H200, under the break-even of recompute, where the
    tier alone reads into pinned memory at 6.4 GB/s (``bench/lmdb_first_read.py``)."""
    if readers < 1:
        raise ValueError(f"readers must be >= 1, got {readers}")
    prefix = f"kvtier-calibration-{uuid.uuid4().hex}/"
    keys = [f"{prefix}{i:08x}" for i in range(num_blocks)]
    payload = os.urandom(block_bytes)
    staging = memoryview(bytearray(num_blocks * block_bytes))
    rows = [staging[i * block_bytes : (i + 1) * block_bytes] for i in range(num_blocks)]
    pool = (
        ThreadPoolExecutor(readers, thread_name_prefix="kvtier-calibrate") if readers > 1 else None
    )
    try:
        tier.put_many([(k, payload) for k in keys])
        if tier.lookup(keys) != num_blocks:
            raise ValueError(
                f"tier {tier.name!r} kept fewer than {num_blocks} blocks of "
                f"{block_bytes} bytes; give it more capacity or fewer blocks"
            )

        def read_part(lo: int, hi: int) -> None:
            lengths = tier.get_many_into(keys[lo:hi], rows[lo:hi])
            for n, row in zip(lengths, rows[lo:hi], strict=True):
                if n != block_bytes:
                    raise ValueError(f"tier {tier.name!r} lost a calibration block")
                xxhash.xxh3_64_intdigest(row)

        def read(n: int) -> float:
            step = -(-n // readers)
            t0 = time.perf_counter()
            if pool is None or step >= n:
                read_part(0, n)
            else:
                for part in [
                    pool.submit(read_part, lo, min(lo + step, n)) for lo in range(0, n, step)
                ]:
                    part.result()
            return time.perf_counter() - t0

        return calibrate_copy(read, block_bytes, tier.name, num_blocks=num_blocks, repeats=repeats)
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
        tier.delete_many(keys)


@dataclass(frozen=True, slots=True)
class TransferSample:
    """``num_blocks`` blocks moved in ``seconds`` (the fastest of a size's repeats)."""

    num_blocks: int
    seconds: float


@dataclass(frozen=True, slots=True)
class TransferFit:
    """A fitted transfer path and the samples it was fitted to."""

    cost: TierCost
    samples: tuple[TransferSample, ...]

    def predict(self, num_blocks: int, block_bytes: int) -> float:
        """Seconds the fit gives for ``num_blocks`` blocks of ``block_bytes``."""
        return self.cost.latency_s + num_blocks * block_bytes / self.cost.bandwidth_bytes_per_s


def fit_transfer(samples: Sequence[TransferSample], block_bytes: int, name: str) -> TierCost:
    """Least squares of ``t = L + n * block_bytes / B`` with ``L >= 0``, ``B > 0``: a free fit;
    a negative intercept refits through the origin; a slope <= 0 (noise, or a fixed cost that
    dwarfs the bytes) takes ``B`` from the largest size alone and ``L`` from the smallest, as
    ``calibrate_copy`` does. Pure. Raises ValueError with fewer than 2 distinct sizes, a size
    < 1, a time <= 0 or ``block_bytes <= 0``."""
    if block_bytes <= 0 or len({s.num_blocks for s in samples}) < 2:
        raise ValueError(
            f"need block_bytes > 0 and >= 2 distinct sizes, got {block_bytes}, "
            f"{[s.num_blocks for s in samples]}"
        )
    if any(s.num_blocks < 1 or not s.seconds > 0 for s in samples):
        raise ValueError(f"{name}: sizes must be >= 1 and times > 0, got {list(samples)}")
    ns = [float(s.num_blocks) for s in samples]
    ts = [s.seconds for s in samples]
    n_mean, t_mean = sum(ns) / len(ns), sum(ts) / len(ts)
    slope = sum((n - n_mean) * (t - t_mean) for n, t in zip(ns, ts, strict=True)) / sum(
        (n - n_mean) ** 2 for n in ns
    )  # seconds per block
    latency = t_mean - slope * n_mean
    if slope > 0 and latency < 0:
        slope, latency = (
            sum(n * t for n, t in zip(ns, ts, strict=True)) / sum(n * n for n in ns),
            0.0,
        )
    if not slope > 0:
        big = max(samples, key=lambda s: s.num_blocks)
        small = min(samples, key=lambda s: s.num_blocks)
        slope = big.seconds / big.num_blocks
        latency = max(small.seconds - small.num_blocks * slope, 0.0)
    return TierCost(name, latency, block_bytes / slope)


def calibrate_transfer(
    load_blocks: Callable[[int], float],
    block_bytes: int,
    name: str,
    *,
    sizes: Sequence[int] = (16, 128),
    repeats: int = 2,
) -> TransferFit:
    """Fit one whole transfer path from ``load_blocks(n)`` (moves ``n`` blocks the way the
    caller's real loads do and returns the seconds; each call must start from the same state,
    e.g. cold: that reset is the callback's job and is not timed). One warm-up call at the
    smallest size, then the fastest of ``repeats`` per size; ``fit_transfer`` over them.
    Raises ValueError for ``repeats < 1`` or what ``fit_transfer`` refuses."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    load_blocks(min(sizes))  # warm-up: first-call allocations, imports, page mappings
    samples = tuple(
        TransferSample(n, min(float(load_blocks(n)) for _ in range(repeats)))
        for n in sorted(set(sizes))
    )
    return TransferFit(fit_transfer(samples, block_bytes, name), samples)
