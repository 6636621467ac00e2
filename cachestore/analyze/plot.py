"""``kvtier analyze --plot``: one hit-ratio plot per tier of the stack, the sweep, the reuse CDF.

Each tier's plot varies that tier's capacity with the others as configured (the document's
``tier_curves``) and draws its share of the block references, the cumulative share down to it
and the stack's total, with the configured capacity marked. Axes are in the unit the user gave
the capacity in: GiB for bytes, tokens for tokens, blocks for blocks (an ``inf`` tier borrows
the stack's first unit and is drawn where every block of the trace fits). The sweep gets two
plots: every tier's share and the total against the swept capacity, and net saved seconds.
``build_figure`` returns the matplotlib Figure (tests read its axes: each has a label,
``tier:NAME``, ``sweep:hits``, ``sweep:net_saved`` or ``reuse_cdf``); ``write_plot`` saves it.
matplotlib is imported lazily, with the Agg backend.
"""

from __future__ import annotations

from typing import Any

import numpy as np

GIB = float(1 << 30)
_COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink")


def _unit(own: str, fallback: list[str]) -> str:
    """The axis unit of a capacity written in ``own``; ``inf`` borrows the first bounded one."""
    if own != "inf":
        return own
    return next((u for u in fallback if u != "inf"), "blocks")


def _scale(unit: str, doc: dict[str, Any]) -> tuple[float, str]:
    """Axis units per block, and the axis label's unit text."""
    if unit == "bytes":
        return doc["block_bytes"] / GIB, f"GiB; {doc['block_bytes'] / (1 << 20):g} MiB a block"
    if unit == "tokens":
        return float(doc["block_tokens"]), f"tokens; {doc['block_tokens']} a block"
    return 1.0, f"blocks of {doc['block_tokens']} tokens"


def _x(blocks: int | None, top: int, scale: float) -> float:
    return (top if blocks is None else blocks) * scale


def _tier_axes(ax: Any, doc: dict[str, Any], i: int, units: list[str]) -> None:
    tier, curve = doc["tiers"][i], doc["tier_curves"][i]
    n = len(doc["tiers"])
    top = max(doc["unique_blocks"], 1)
    scale, label = _scale(_unit(tier["capacity_unit"], units), doc)
    xs = [c * scale for c in curve["capacities_blocks"]]
    colour = _COLOURS[i % len(_COLOURS)]
    ax.plot(
        xs,
        [100 * y for y in curve["tier_hit_ratio"]],
        color=colour,
        lw=2,
        label=f"{tier['name']} hits",
    )
    if 0 < i < n - 1:
        names = "+".join(t["name"] for t in doc["tiers"][: i + 1])
        ax.plot(
            xs,
            [100 * y for y in curve["cumulative_hit_ratio"]],
            color=colour,
            linestyle="--",
            label=f"{names} (cumulative)",
        )
    if n > 1:
        ax.plot(
            xs,
            [100 * y for y in curve["total_hit_ratio"]],
            color="black",
            linestyle=":",
            label="whole stack",
        )
    at = _x(tier["capacity_blocks"], top, scale)
    shown = tier["capacity_text"] + (
        " (drawn where all blocks fit)" if tier["capacity_blocks"] is None else ""
    )
    if at > 0:
        ax.axvline(at, color="tab:red", alpha=0.7, label=f"configured {tier['name']}={shown}")
        ax.plot([at], [100 * tier["hit_blocks"] / max(doc["block_refs"], 1)], "o", color="tab:red")
    ax.set_xscale("log")
    ax.set_xlabel(f"{tier['name']} capacity ({label})")
    ax.set_ylabel("hit ratio (% of block references)")
    ax.set_ylim(0, 100)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    others = ", ".join(
        f"{t['name']}={t['capacity_text']}" for j, t in enumerate(doc["tiers"]) if j != i
    )
    ax.set_title(
        f"tier {i + 1}/{n}: {tier['name']} ({tier['policy']})"
        + (f"\nothers fixed: {others}" if others else ""),
        fontsize=10,
    )
    ax.set_label(f"tier:{tier['name']}")


def _sweep_x(doc: dict[str, Any], units: list[str]) -> tuple[list[float], str, list[int]]:
    sw = doc["sweep"]
    swept = next(t for t in doc["tiers"] if t["name"] == sw["tier"])
    written = [
        u
        for u, c in zip(sw["capacities_unit"], sw["capacities_blocks"], strict=True)
        if u != "inf" and c
    ]  # a zero reads the same in every unit
    scale, label = _scale(_unit(written[0] if written else swept["capacity_unit"], units), doc)
    finite = [c for c in sw["capacities_blocks"] if c is not None]
    top = max([doc["unique_blocks"], *finite, 1])
    xs = [_x(c, top, scale) for c in sw["capacities_blocks"]]
    inf_at = [k for k, c in enumerate(sw["capacities_blocks"]) if c is None]
    return xs, f"{sw['tier']} capacity ({label})", inf_at


def _xscale(ax: Any, xs: list[float]) -> None:
    positive = [x for x in xs if x > 0]
    if positive and len(positive) < len(xs):
        ax.set_xscale("symlog", linthresh=min(positive))
    elif positive:
        ax.set_xscale("log")


def _mark_inf(ax: Any, xs: list[float], ys: list[float], inf_at: list[int]) -> None:
    for k in inf_at:
        ax.annotate("inf", (xs[k], ys[k]), textcoords="offset points", xytext=(4, 4), fontsize=8)


def _sweep_axes(ax_hits: Any, ax_net: Any, doc: dict[str, Any], units: list[str]) -> None:
    sw = doc["sweep"]
    xs, xlabel, inf_at = _sweep_x(doc, units)
    for i, t in enumerate(doc["tiers"]):
        ax_hits.plot(
            xs,
            [100 * y for y in sw["tier_hit_ratio"][t["name"]]],
            "o-",
            color=_COLOURS[i % len(_COLOURS)],
            label=f"{t['name']} hits",
        )
    total = [100 * y for y in sw["block_hit_ratio"]]
    ax_hits.plot(xs, total, "s-", color="black", label="total (blocks)")
    ax_hits.plot(
        xs, [100 * y for y in sw["token_hit_ratio"]], "s--", color="grey", label="total (tokens)"
    )
    _mark_inf(ax_hits, xs, total, inf_at)
    others = ", ".join(
        f"{t['name']}={t['capacity_text']}" for t in doc["tiers"] if t["name"] != sw["tier"]
    )
    ax_hits.set_title(
        f"sweep of {sw['tier']}" + (f" (fixed: {others})" if others else ""), fontsize=10
    )
    ax_hits.set_ylabel("hit ratio (% of block references)")
    ax_hits.set_ylim(0, 100)
    ax_hits.legend(loc="upper left", fontsize=8)
    ax_hits.set_label("sweep:hits")
    net = sw["net_saved_seconds"]
    ax_net.plot(xs, net, "o-", color="tab:red", label="net saved")
    ax_net.plot(xs, sw["saved_prefill_seconds"], "^--", color="tab:green", label="prefill saved")
    _mark_inf(ax_net, xs, net, inf_at)
    ax_net.set_title(
        f"net saved against {sw['tier']} capacity\n(per request max(saved - reload, 0), summed)",
        fontsize=10,
    )
    ax_net.set_ylabel("seconds (cost model)")
    ax_net.set_ylim(bottom=0)
    ax_net.legend(loc="upper left", fontsize=8)
    ax_net.set_label("sweep:net_saved")
    for ax in (ax_hits, ax_net):
        _xscale(ax, xs)
        ax.set_xticks(xs, labels=sw["capacities_text"])  # the points as the user wrote them
        ax.set_xticks([], minor=True)
        ax.margins(x=0.08)
        ax.set_xlabel(xlabel)
        ax.grid(True, which="both", alpha=0.3)


def _reuse_axes(ax: Any, doc: dict[str, Any]) -> None:
    reuse = np.asarray(doc.get("_reuse_distances", []))
    if len(reuse):
        ax.plot(reuse, np.arange(1, len(reuse) + 1) / len(reuse) * 100, color="tab:green")
        ax.set_xscale("log")
    ax.set_xlabel("LRU stack distance at lookup (blocks)")
    ax.set_ylabel("reuses at or below (%)")
    ax.set_ylim(0, 100)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(
        f"reuse-distance CDF ({doc['reuse_distance']['reuse_refs']:,} reuses)", fontsize=10
    )
    ax.set_label("reuse_cdf")


def build_figure(doc: dict[str, Any]) -> Any:
    """The Figure for ``doc`` (needs ``tier_curves``: ``analyze(..., curves=True)``). Raises
    KeyError without it."""
    import matplotlib  # lazy: optional dependency (the `analyze` extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(doc["tiers"])
    lower = 3 if "sweep" in doc else 1
    cols = max(n, lower)
    fig = plt.figure(figsize=(5.2 * cols, 9.5))
    grid = fig.add_gridspec(2, cols)
    units = [t["capacity_unit"] for t in doc["tiers"]]
    for i in range(n):
        _tier_axes(fig.add_subplot(grid[0, i]), doc, i, units)
    if "sweep" in doc:
        _sweep_axes(fig.add_subplot(grid[1, 0]), fig.add_subplot(grid[1, 1]), doc, units)
    _reuse_axes(fig.add_subplot(grid[1, lower - 1]), doc)
    fig.suptitle(
        f"kvtier analyze: {doc['requests']:,} requests, {doc['block_refs']:,} block "
        f"refs, blocks of {doc['block_tokens']} tokens"
    )
    fig.tight_layout()
    return fig


def write_plot(doc: dict[str, Any], path: str) -> None:
    """Save ``build_figure(doc)`` as a PNG at ``path`` (created or overwritten)."""
    fig = build_figure(doc)
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=100)
    plt.close(fig)
