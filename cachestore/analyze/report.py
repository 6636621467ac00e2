"""Writers for an analysis document: terminal table, JSON, Markdown and a PNG plot.

Each writer takes the dict from ``summary.analyze`` and only formats it. matplotlib is imported
lazily (Agg backend) by ``write_plot`` alone. Writers create or overwrite their file; none is
thread-safe with another writer on the same path.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

GIB = float(1 << 30)


def _cap(blocks: object) -> str:
    return "inf" if blocks is None else f"{blocks:,}"


def _pct(x: object) -> str:
    return f"{100.0 * float(x):.2f}%"  # type: ignore[arg-type]


def format_table(doc: dict) -> str:
    """A fixed-width summary for the terminal."""
    rd = doc["reuse_distance"]
    inf = doc["infinite_capacity"]
    lines = [
        f"requests {doc['requests']:,}  block refs {doc['block_refs']:,}  unique blocks "
        f"{doc['unique_blocks']:,}  block {doc['block_tokens']} tokens  "
        f"({doc['format']}, {doc['method']})",
        f"hit ratio: blocks {_pct(doc['block_hit_ratio'])}  tokens {_pct(doc['token_hit_ratio'])}"
        f"   (infinite capacity: {_pct(inf['block_hit_ratio'])} / {_pct(inf['token_hit_ratio'])})",
        f"reuse distance (blocks): p50 {rd['p50']}  p90 {rd['p90']}  p99 {rd['p99']}"
        f"  ({rd['reuse_refs']:,} reuses, {rd['cold_refs']:,} first references)",
        "",
        f"{'tier':<10}{'policy':<8}{'capacity':>14}{'hit blocks':>13}{'hit %':>9}"
        f"{'read GiB':>11}{'write GiB':>11}{'evicted':>12}",
    ]
    for t in doc["tiers"]:
        share = t["hit_blocks"] / max(doc["block_refs"], 1)
        lines.append(
            f"{t['name']:<10}{t['policy']:<8}{_cap(t['capacity_blocks']):>14}"
            f"{t['hit_blocks']:>13,}{_pct(share):>9}{t['read_bytes'] / GIB:>11.2f}"
            f"{t['write_bytes'] / GIB:>11.2f}{t['evicted_blocks']:>12,}"
        )
    lines += [
        "",
        f"prefill without cache {doc['baseline_prefill_seconds']:.1f} s; saved "
        f"{doc['saved_prefill_seconds']:.1f} s, restore {doc['restore_seconds']:.1f} s, "
        f"net saved {doc['net_saved_seconds']:.1f} s "
        f"({doc['model_profile'] or str(doc['kv_bytes_per_token']) + ' B/token'}"
        + (f", {doc['kv_compression']} blocks" if doc.get("kv_compression", "none") != "none"
           else "") + ")",
    ]
    if "sweep" in doc:
        sw = doc["sweep"]
        lines += ["", f"sweep of tier {sw['tier']} ({sw['method']}): capacity -> block / token hit"]
        for c, b, t in zip(sw["capacities_blocks"], sw["block_hit_ratio"], sw["token_hit_ratio"], strict=True):
            lines.append(f"  {_cap(c):>14}  {_pct(b):>8}  {_pct(t):>8}")
    return "\n".join(lines)


def _public(doc: dict) -> dict:
    return {k: v for k, v in doc.items() if not k.startswith("_")}


def write_json(doc: dict, target: str) -> None:
    """Write the document as JSON to ``target`` (a path, or ``-`` for stdout)."""
    text = json.dumps(_public(doc), indent=2)
    if target == "-":
        sys.stdout.write(text + "\n")
    else:
        Path(target).write_text(text + "\n", encoding="utf-8")


def write_markdown(doc: dict, path: str, plot_path: str | None = None,
                   title: str = "kvtier analyze") -> None:
    """A Markdown report: the summary table, per-tier rows, savings and the sweep."""
    rd = doc["reuse_distance"]
    out = [f"# {title}", "", "| metric | value |", "| --- | --- |"]
    for key in ("format", "requests", "block_refs", "unique_blocks", "block_tokens",
                "input_tokens", "hit_blocks", "hit_tokens"):
        out.append(f"| {key} | {doc[key]:,} |" if isinstance(doc[key], int)
                   else f"| {key} | {doc[key]} |")
    out += [
        f"| block_hit_ratio | {_pct(doc['block_hit_ratio'])} |",
        f"| token_hit_ratio | {_pct(doc['token_hit_ratio'])} |",
        f"| infinite-capacity token hit ratio | {_pct(doc['infinite_capacity']['token_hit_ratio'])} |",
        f"| reuse distance p50 / p90 / p99 (blocks) | {rd['p50']} / {rd['p90']} / {rd['p99']} |",
        f"| saved prefill (s) | {doc['saved_prefill_seconds']:.2f} |",
        f"| restore (s) | {doc['restore_seconds']:.2f} |",
        f"| net saved (s) | {doc['net_saved_seconds']:.2f} |",
        "", "## Tiers", "",
        "| tier | policy | capacity (blocks) | hit blocks | read GiB | write GiB | evicted |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for t in doc["tiers"]:
        out.append(f"| {t['name']} | {t['policy']} | {_cap(t['capacity_blocks'])} | "
                   f"{t['hit_blocks']:,} | {t['read_bytes'] / GIB:.2f} | "
                   f"{t['write_bytes'] / GIB:.2f} | {t['evicted_blocks']:,} |")
    if "sweep" in doc:
        sw = doc["sweep"]
        out += ["", f"## Sweep of tier `{sw['tier']}` ({sw['method']})", "",
                "| capacity (blocks) | block hit | token hit |", "| ---: | ---: | ---: |"]
        for c, b, t in zip(sw["capacities_blocks"], sw["block_hit_ratio"], sw["token_hit_ratio"], strict=True):
            out.append(f"| {_cap(c)} | {_pct(b)} | {_pct(t)} |")
    if plot_path:
        out += ["", f"![hit ratio and reuse distance]({Path(plot_path).name})"]
    Path(path).write_text("\n".join(out) + "\n", encoding="utf-8")


def write_plot(doc: dict, path: str) -> None:
    """Hit ratio against capacity (sweep points over the LRU curve) and the reuse-distance CDF."""
    import matplotlib  # lazy: optional dependency (the `analyze` extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    curve = doc["lru_curve"]
    ax1.plot(curve["capacities_blocks"], [100 * x for x in curve["token_hit_ratio"]],
             label="LRU, token hit", color="tab:blue")
    ax1.plot(curve["capacities_blocks"], [100 * x for x in curve["block_hit_ratio"]],
             label="LRU, block hit", color="tab:blue", linestyle="--")
    if "sweep" in doc:
        sw = doc["sweep"]
        # Placed at the hierarchy's total capacity, where an LRU hierarchy meets the curve.
        pts = [(c, t) for c, t in zip(sw["total_capacity_blocks"], sw["token_hit_ratio"], strict=True)
               if c is not None and c > 0]
        if pts:
            ax1.plot([p[0] for p in pts], [100 * p[1] for p in pts], "o", color="tab:red",
                     label=f"sweep {sw['tier']} (token hit, at total capacity)")
    ax1.set_xscale("log")
    ax1.set_xlabel(f"cache capacity (blocks of {doc['block_tokens']} tokens)")
    ax1.set_ylabel("hit ratio (%)")
    ax1.set_ylim(0, 100)
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(loc="upper left")
    ax1.set_title("Hit ratio against capacity")
    reuse = np.asarray(doc.get("_reuse_distances", []))
    if len(reuse):
        ax2.plot(reuse, np.arange(1, len(reuse) + 1) / len(reuse) * 100, color="tab:green")
        ax2.set_xscale("log")
    ax2.set_xlabel("LRU stack distance at lookup (blocks)")
    ax2.set_ylabel("reuses at or below (%)")
    ax2.set_ylim(0, 100)
    ax2.grid(True, which="both", alpha=0.3)
    ax2.set_title(f"Reuse-distance CDF ({doc['reuse_distance']['reuse_refs']:,} reuses)")
    fig.suptitle(f"kvtier analyze: {doc['requests']:,} requests, {doc['block_refs']:,} block refs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
