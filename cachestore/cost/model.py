"""Reload-versus-recompute pricing (DESIGN.md, "Cost model"): pure functions, no state.

``T_reload = sum(hop latencies) + bytes / min(hop bandwidths)``: the hops of one transfer
(e.g. Redis -> host, host -> GPU) are pipelined, so the slowest link sets the rate while every
hop's latency is paid once. ``T_recompute(n | c) = a + b*n + c2*n*(c + n/2)``: a fixed launch
cost, a per-token (linear layers) cost and an attention cost of ``n`` new tokens over ``c``
cached ones plus half of their own causal triangle.

``choose_split`` prices every way to serve a prompt whose leading blocks are cached somewhere
below the GPU: load ``[0, k)`` and recompute the rest, for every ``k``, or compute the head
``[0, m)`` while the tail ``[m, K)`` loads concurrently (Cake, arXiv 2410.03065: computing block
``j`` needs every block before it, loading needs nothing).

A load backlog (``backlog_s``): reads below the host tier run on one load thread, one load
after another, so an option that reads there starts those reads only once the reads already
queued ahead of it are done; its price grows by their time. Recompute and host-only loads
(copied without that thread) are priced as before.

Torch-free, no I/O; every function is pure and thread-safe. Calibration and online (EWMA)
updates build new frozen values on top of these types; nothing here mutates.
"""

from __future__ import annotations

import enum
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass


class Strategy(str, enum.Enum):
    """A reload decision: how a prompt is served past its GPU hit. A ``str``: each member is
    its value, the string that logs, metrics labels and request logs carry (``str``, ``format``,
    JSON and msgpack give the value; it compares and hashes as that string)."""

    RECOMPUTE = "recompute"  # compute everything past the GPU hit
    LOAD_PREFIX = "load_prefix"  # load [0, k) then compute [k, end)
    OVERLAP = "overlap"  # compute [0, m) while [m, K) loads, then compute [K, end)

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, format_spec: str) -> str:
        return format(str(self.value), format_spec)


# The members under their former constant names (importers that predate ``Strategy``).
STRATEGY_RECOMPUTE = Strategy.RECOMPUTE
STRATEGY_LOAD_PREFIX = Strategy.LOAD_PREFIX
STRATEGY_OVERLAP = Strategy.OVERLAP


@dataclass(frozen=True, slots=True)
class TierCost:
    """One hop of a transfer: a fixed latency per transfer and a sustained bandwidth."""

    name: str
    latency_s: float
    bandwidth_bytes_per_s: float

    def __post_init__(self) -> None:
        if self.latency_s < 0:
            raise ValueError(f"tier {self.name!r}: latency_s must be >= 0, got {self.latency_s}")
        if not self.bandwidth_bytes_per_s > 0:
            raise ValueError(
                f"tier {self.name!r}: bandwidth must be > 0, got {self.bandwidth_bytes_per_s}"
            )


@dataclass(frozen=True, slots=True)
class PrefillSample:
    """One measured prefill: ``num_tokens`` new tokens over ``context_tokens`` took ``seconds``."""

    num_tokens: int
    context_tokens: int
    seconds: float


@dataclass(frozen=True, slots=True)
class PrefillCost:
    """``t(n, c) = fixed_s + per_token_s * n + attention_s * n * (c + n / 2)`` for ``n > 0``."""

    fixed_s: float
    per_token_s: float
    attention_s: float

    def time(self, num_tokens: int, context_tokens: int = 0) -> float:
        """Seconds to prefill ``num_tokens`` after ``context_tokens``; 0 when nothing is new."""
        if num_tokens < 0 or context_tokens < 0:
            raise ValueError(f"token counts must be >= 0, got n={num_tokens}, c={context_tokens}")
        if num_tokens == 0:
            return 0.0
        n = float(num_tokens)
        return self.fixed_s + self.per_token_s * n + self.attention_s * n * (context_tokens + n / 2)

    @classmethod
    def fit(cls, samples: Sequence[PrefillSample]) -> PrefillCost:
        """Least-squares fit of the three coefficients; needs >= 3 independent samples.

        Raises ValueError when the samples do not determine the coefficients.
        """
        rows = [
            (1.0, float(s.num_tokens), s.num_tokens * (s.context_tokens + s.num_tokens / 2))
            for s in samples
        ]
        # Normal equations A^T A x = A^T y, solved by Gaussian elimination with pivoting: three
        # unknowns do not justify numpy, and cachestore stays dependency-light.
        ata = [[sum(r[i] * r[j] for r in rows) for j in range(3)] for i in range(3)]
        aty = [sum(r[i] * s.seconds for r, s in zip(rows, samples, strict=True)) for i in range(3)]
        m = [ata[i] + [aty[i]] for i in range(3)]
        for col in range(3):
            piv = max(range(col, 3), key=lambda r: abs(m[r][col]))
            if abs(m[piv][col]) < 1e-300 or len(samples) < 3:
                raise ValueError("prefill samples do not determine a, b and c2 (need 3 distinct)")
            m[col], m[piv] = m[piv], m[col]
            for r in range(3):
                if r != col:
                    f = m[r][col] / m[col][col]
                    m[r] = [x - f * y for x, y in zip(m[r], m[col], strict=True)]
        a, b, c2 = (m[i][3] / m[i][i] for i in range(3))
        return cls(fixed_s=a, per_token_s=b, attention_s=c2)


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """KV bytes one token occupies across all layers (K and V), and how many layers they span
    (what the lossless format's size depends on; 0: unknown)."""

    name: str
    kv_bytes_per_token: int
    num_layers: int = 0

    def block_bytes(self, block_tokens: int) -> int:
        return self.kv_bytes_per_token * block_tokens


# 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 B; Qwen2.5-7B: 28 x 4 x 128 x 2 x 2;
# Llama-3-70B: 80 x 8 x 128 x 2 x 2.
MODEL_PROFILES: dict[str, ModelProfile] = {
    p.name: p
    for p in (
        ModelProfile("llama-3-8b", 131072, 32),
        ModelProfile("qwen2.5-7b", 57344, 28),
        ModelProfile("llama-3-70b", 327680, 80),
    )
}

# DESIGN.md "Physics": HF prefill of the Llama-3-8B shape on one H200 (bf16, no cache).
LLAMA3_8B_H200_SAMPLES = (
    PrefillSample(1024, 0, 0.031),
    PrefillSample(4096, 0, 0.120),
    PrefillSample(16384, 0, 0.577),
)
LLAMA3_8B_H200_PREFILL = PrefillCost.fit(LLAMA3_8B_H200_SAMPLES)

# The one price table: priors per machine and tier kind until calibration replaces them.
# ``h200``: host is the measured pinned copy (DESIGN.md "Physics"); the others are typical
# figures for a local NVMe behind LMDB, Redis over 25 GbE, an S3-compatible store and a cache
# server over loopback shared memory or TCP, meant to be overridden (``--tier-cost``).
# ``cpu``: a tiny model on a few CPU cores (the embedded demo model, fp32), where the "GPU" is
# host memory and the host hop a memcpy; rough figures from a 2-core CI machine.
# Rows: (tier, latency_s, bandwidth_bytes_per_s).
_PRICES: dict[str, tuple[tuple[str, float, float], ...]] = {
    "h200": (
        ("host", 10e-6, 55.4e9),
        ("lmdb", 100e-6, 3.0e9),
        ("redis", 500e-6, 2.5e9),
        ("s3", 20e-3, 1.0e9),
        ("remote", 200e-6, 5.0e9),
    ),
    "cpu": (
        ("host", 5e-6, 5.0e9),
        ("lmdb", 50e-6, 1.0e9),
        ("redis", 300e-6, 0.5e9),
        ("s3", 10e-3, 0.1e9),
        ("remote", 200e-6, 1.0e9),
    ),
}
TIER_COST_PRIORS: dict[str, dict[str, TierCost]] = {
    machine: {name: TierCost(name, latency, bandwidth) for name, latency, bandwidth in rows}
    for machine, rows in _PRICES.items()
}
# What ``kvtier analyze`` prices with unless told otherwise (callers copy it before editing).
DEFAULT_TIER_COSTS: dict[str, TierCost] = TIER_COST_PRIORS["h200"]


def get_model_profile(name: str) -> ModelProfile:
    try:
        return MODEL_PROFILES[name]
    except KeyError:
        known = sorted(MODEL_PROFILES)
        raise ValueError(f"unknown model profile {name!r}; choose one of {known}") from None


def hops_to_gpu(tier_name: str, costs: dict[str, TierCost]) -> tuple[TierCost, ...]:
    """The hops a block read from ``tier_name`` takes to reach the GPU.

    ``gpu`` needs none, ``host`` one; every other tier stages through pinned host memory.
    Raises ValueError for a tier without a cost entry.
    """
    if tier_name == "gpu":
        return ()
    if tier_name not in costs:
        raise ValueError(f"no cost for tier {tier_name!r}; known: {sorted(costs)} (--tier-cost)")
    if tier_name == "host" or "host" not in costs:
        return (costs[tier_name],)
    return (costs[tier_name], costs["host"])


def reload_time(num_blocks: int, block_bytes: int, hops: Sequence[TierCost]) -> float:
    """Seconds to bring ``num_blocks`` blocks over pipelined ``hops``; 0 for no blocks or hops."""
    if num_blocks < 0 or block_bytes < 0:
        raise ValueError(
            f"num_blocks and block_bytes must be >= 0, got {num_blocks}, {block_bytes}"
        )
    if num_blocks == 0 or not hops:
        return 0.0
    latency = sum(h.latency_s for h in hops)
    return latency + num_blocks * block_bytes / min(h.bandwidth_bytes_per_s for h in hops)


def recompute_time(num_tokens: int, context_tokens: int, prefill: PrefillCost) -> float:
    """Seconds to prefill ``num_tokens`` new tokens after ``context_tokens`` cached ones."""
    return prefill.time(num_tokens, context_tokens)


@dataclass(frozen=True, slots=True)
class Option:
    """One way to serve a prompt: compute ``[0, load_begin)`` (overlapped with the load),
    load blocks ``[load_begin, load_end)``, compute everything from ``load_end`` on."""

    strategy: Strategy
    load_begin: int
    load_end: int
    predicted_s: float

    @property
    def num_load_blocks(self) -> int:
        return self.load_end - self.load_begin


@dataclass(frozen=True, slots=True)
class Decision:
    """The cheapest option and the best of each other family (recompute, load all, ...).
    ``backlog_s``: the seconds of queued lower-tier reads the options were priced behind
    (``choose_split``), kept so that a request log can show why a load lost."""

    best: Option
    alternatives: tuple[Option, ...]
    backlog_s: float = 0.0
    # (strategy, ratio) the options were ranked with: each price times its strategy's
    # measured-to-priced ratio (``cachestore.cost.outcomes``); empty: ranked on raw prices.
    ratios: tuple[tuple[str, float], ...] = ()

    def priced(self) -> tuple[tuple[str, float, float], ...]:
        """(strategy, raw price in seconds, ratio) of the chosen option, then of the best
        of each other family: what a request log shows to say why a plan won."""
        ratio = dict(self.ratios)
        return tuple(
            (str(o.strategy), o.predicted_s, ratio.get(str(o.strategy), 1.0))
            for o in (self.best, *self.alternatives)
        )

    @property
    def predicted_s(self) -> float:
        return self.best.predicted_s


def _run_load_times(
    hops_per_block: Sequence[Sequence[TierCost]], block_bytes: int, reverse: bool
) -> list[float]:
    """``out[i]``: time to load the first (or, reversed, the last) ``i`` blocks.

    Runs of blocks from the same source are one transfer each; different sources are priced
    one after another (conservative: they may share the host->GPU link). O(K), with one
    ``reload_time`` pricing per run.
    """
    order = reversed(hops_per_block) if reverse else hops_per_block
    out = [0.0]
    closed = 0.0
    for hops, run in itertools.groupby(order):
        count = sum(1 for _ in run)
        one = reload_time(1, block_bytes, hops)  # latency + one block's bytes
        per_block = one - reload_time(1, 0, hops) if hops else 0.0
        base = closed + one
        out += [base + n * per_block for n in range(count)]
        closed += reload_time(count, block_bytes, hops)
    return out


def choose_split(
    hops_per_block: Sequence[Sequence[TierCost]],
    block_tokens: int,
    block_bytes: int,
    prompt_tokens: int,
    prefill: PrefillCost,
    computed_tokens: int = 0,
    pipelined_blocks: int = 0,
    num_layers: int = 1,
    overlap_margin: float = 0.0,
    overlap: bool = True,
    backlog_s: float = 0.0,
    queued: Sequence[bool] | None = None,
) -> Decision:
    """Price every load/compute split of a prompt and return the cheapest.

    ``hops_per_block[i]`` are the hops from the source tier of the ``i``-th leading cached block
    (counted after the ``computed_tokens`` already on the GPU) to the GPU. Options: load
    ``[0, k)`` then compute the rest, for every ``k`` in ``0..K``; and, for ``0 < m < K``,
    compute ``[0, m)`` while ``[m, K)`` loads, then compute the rest. Ties go to the option
    that moves fewer blocks. Pure; O(K). Raises ValueError on inconsistent sizes.

    ``pipelined_blocks``: loads of up to that many leading blocks land layer by layer while
    the rest is computed (the engine's in-step host loads over ``num_layers`` layers), so
    ``load [0, k)`` costs ``max(load, rest) + min(load, rest) / num_layers`` instead of
    ``load + rest`` for ``k <= pipelined_blocks``.

    ``overlap_margin``: an overlap option is chosen only when it beats the best other option
    by at least this fraction. An overlap plan runs in more engine steps than the others and
    leans on two predictions at once (the head's compute and the tail's load); on the H200
    its measured time came out well above the prediction while the prediction's gain over
    loading everything was a few percent (docs/offload.md). ``overlap`` False: no overlap
    option is priced (the engine's step is shared with other prefills: the head's compute
    would not run at the modelled rate).

    ``backlog_s``: seconds of reads already queued on the load thread (other requests' loads
    from tiers below the host, not yet done). ``queued[i]``: block ``i`` is read through that
    thread (it sits below the host tier; None: every block is). A load that reads any queued
    block cannot start those reads before the backlog is read, so ``load [0, k)`` costs
    ``backlog_s`` more when ``[0, k)`` holds a queued block, and an overlap's tail ``[m, K)``
    lands ``backlog_s`` later when it holds one. Recomputing is unaffected. With
    ``backlog_s`` 0 every price is the same as without it.
    """
    num_cached = len(hops_per_block)
    _check_prompt(num_cached, block_tokens, prompt_tokens, computed_tokens)
    _check_overlap(pipelined_blocks, num_layers, overlap_margin)
    first_q, last_q = _queued_span(num_cached, backlog_s, queued)
    c0, bt = computed_tokens, block_tokens
    head_load = _run_load_times(hops_per_block, block_bytes, reverse=False)
    tail_load = _run_load_times(hops_per_block, block_bytes, reverse=True)
    # Times first, Options only for the few that are returned: K is 1024 for a 16K prompt and
    # this runs on the scheduler's path (2K dataclasses and rank calls cost ~2 ms there). The
    # prefill times are ``PrefillCost.time``'s formula written out (same operations, same
    # results), a call per option being most of the rest.
    f, pt, at = prefill.fixed_s, prefill.per_token_s, prefill.attention_s
    if type(prefill) is PrefillCost:
        rests = [
            f + pt * n + at * n * (d + n / 2) if n else 0.0
            for d, n in (
                (d, float(prompt_tokens - d)) for d in range(c0, c0 + (num_cached + 1) * bt, bt)
            )
        ]
    else:  # a subclass may price otherwise
        rests = [
            prefill.time(prompt_tokens - d, d) for d in range(c0, c0 + (num_cached + 1) * bt, bt)
        ]
    prefix_t = [load + compute for load, compute in zip(head_load, rests, strict=True)]
    for k in range(1, min(pipelined_blocks, num_cached) + 1):
        load, compute = head_load[k], rests[k]
        prefix_t[k] = max(load, compute) + min(load, compute) / num_layers
    if backlog_s > 0:  # [0, k) holds a queued block for every k past the first one
        for k in range(first_q + 1, num_cached + 1):
            prefix_t[k] += backlog_s
    tail_rest = rests[num_cached]
    last = num_cached if overlap else 1
    if type(prefill) is PrefillCost:
        heads = [f + pt * n + at * n * (c0 + n / 2) for n in map(float, range(bt, last * bt, bt))]
    else:
        heads = [prefill.time(m * bt, c0) for m in range(1, last)]
    overlap_t = [
        max(head, tail_load[num_cached - m] + (backlog_s if m < last_q else 0.0)) + tail_rest
        for m, head in enumerate(heads, start=1)
    ]
    return _cheapest(prefix_t, overlap_t, overlap_margin, backlog_s)


def _queued_span(
    num_cached: int, backlog_s: float, queued: Sequence[bool] | None
) -> tuple[int, int]:
    """``(first, last)``: the index of the first block read through the load thread and one
    past the last (``(K, 0)`` when none is). A prefix ``[0, k)`` reads one of them when
    ``k > first``, a tail ``[m, K)`` when ``m < last``. Raises ValueError for a negative
    ``backlog_s`` or a ``queued`` whose length is not the number of cached blocks."""
    if not (backlog_s >= 0.0 and math.isfinite(backlog_s)):
        raise ValueError(f"backlog_s must be finite and >= 0, got {backlog_s}")
    if queued is None:
        return 0, num_cached
    if len(queued) != num_cached:
        raise ValueError(f"queued has {len(queued)} entries for {num_cached} cached blocks")
    first = next((i for i, q in enumerate(queued) if q), num_cached)
    last = next((num_cached - i for i, q in enumerate(reversed(queued)) if q), 0)
    return first, last


def _check_prompt(
    num_cached: int, block_tokens: int, prompt_tokens: int, computed_tokens: int
) -> None:
    """The cached blocks fit in the prompt after the computed tokens, or ValueError."""
    if block_tokens <= 0 or computed_tokens < 0:
        raise ValueError(f"bad block_tokens={block_tokens} or computed_tokens={computed_tokens}")
    if computed_tokens + num_cached * block_tokens > prompt_tokens:
        raise ValueError(
            f"{num_cached} cached blocks of {block_tokens} after {computed_tokens} tokens exceed "
            f"the prompt ({prompt_tokens} tokens)"
        )


def _check_overlap(pipelined_blocks: int, num_layers: int, overlap_margin: float) -> None:
    """``choose_split``'s pipelining and overlap arguments are in range, or ValueError."""
    if num_layers < 1 or pipelined_blocks < 0:
        raise ValueError(f"bad num_layers={num_layers} or pipelined_blocks={pipelined_blocks}")
    if not 0.0 <= overlap_margin < 1.0:
        raise ValueError(f"overlap_margin must be in [0, 1), got {overlap_margin}")


def _cheapest(
    prefix_t: list[float], overlap_t: list[float], overlap_margin: float, backlog_s: float = 0.0
) -> Decision:
    """The cheapest of the priced options: ``prefix_t[k]`` loads ``[0, k)`` then computes the
    rest (k = 0..K), ``overlap_t[m - 1]`` computes ``[0, m)`` while ``[m, K)`` loads. Ties go
    to fewer loaded blocks: (time, blocks) pairs order exactly that way. The alternatives:
    recompute, load all, the best prefix and the best overlap, less the chosen one."""
    num_cached = len(prefix_t) - 1

    def prefix_option(k: int) -> Option:
        return Option(Strategy.RECOMPUTE if k == 0 else Strategy.LOAD_PREFIX, 0, k, prefix_t[k])

    best_prefix = prefix_option(min(zip(prefix_t, range(num_cached + 1), strict=True))[1])
    best = best_prefix
    families = [prefix_option(0), prefix_option(num_cached), best_prefix]
    if overlap_t:  # (time, loaded blocks = K - m) for m = 1..K-1
        t, loaded = min(zip(overlap_t, range(num_cached - 1, 0, -1), strict=True))
        best_overlap = Option(Strategy.OVERLAP, num_cached - loaded, num_cached, t)
        if (t, loaded) < (best.predicted_s, best.num_load_blocks) and t <= (
            1.0 - overlap_margin
        ) * best.predicted_s:
            best = best_overlap
        families.append(best_overlap)
    alternatives = tuple(dict.fromkeys(o for o in families if o != best))
    return Decision(best=best, alternatives=alternatives, backlog_s=backlog_s)
