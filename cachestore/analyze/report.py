"""Writers for an analysis document: terminal table, JSON, Markdown and a PNG plot.

Each writer takes the dict from ``summary.analyze`` and only formats it; capacities are shown
as the user wrote them (``capacity_text``) beside their blocks. matplotlib is imported lazily
(Agg backend) by ``write_plot`` alone (plot.py). Writers create or overwrite their file; none is
thread-safe with another writer on the same path.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any

GIB = float(1 << 30)


def _cap(blocks: object) -> str:
    return "inf" if blocks is None else f"{blocks:,}"


def _pct(x: object) -> str:
    return f"{100.0 * float(x):.2f}%"  # type: ignore[arg-type]


def _others(doc: dict[str, Any], name: str) -> str:
    return ", ".join(f"{t['name']}={t['capacity_text']}" for t in doc["tiers"] if t["name"] != name)


def _sweep_rows(doc: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The sweep as a header and rows of cells: capacity as written, each tier's share of the
    block references, the totals and the seconds."""
    sw = doc["sweep"]
    names = [t["name"] for t in doc["tiers"]]
    head = [
        "capacity",
        "blocks",
        *(f"{n} hit" for n in names),
        "total blocks",
        "total tokens",
        "net saved s",
    ]
    rows = []
    for k, c in enumerate(sw["capacities_blocks"]):
        rows.append(
            [
                sw["capacities_text"][k],
                _cap(c),
                *(_pct(sw["tier_hit_ratio"][n][k]) for n in names),
                _pct(sw["block_hit_ratio"][k]),
                _pct(sw["token_hit_ratio"][k]),
                f"{sw['net_saved_seconds'][k]:.1f}",
            ]
        )
    return head, rows


def format_table(doc: dict[str, Any]) -> str:
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
        f"{'tier':<10}{'policy':<8}{'capacity':>12}{'blocks':>11}{'hit blocks':>12}{'hit %':>9}"
        f"{'read GiB':>11}{'write GiB':>11}{'evicted':>11}",
    ]
    for t in doc["tiers"]:
        share = t["hit_blocks"] / max(doc["block_refs"], 1)
        lines.append(
            f"{t['name']:<10}{t['policy']:<8}{t['capacity_text']:>12}"
            f"{_cap(t['capacity_blocks']):>11}{t['hit_blocks']:>12,}{_pct(share):>9}"
            f"{t['read_bytes'] / GIB:>11.2f}{t['write_bytes'] / GIB:>11.2f}"
            f"{t['evicted_blocks']:>11,}"
        )
    lines += [
        "",
        f"prefill without cache {doc['baseline_prefill_seconds']:.1f} s; saved "
        f"{doc['saved_prefill_seconds']:.1f} s, restore {doc['restore_seconds']:.1f} s, "
        f"net saved {doc['net_saved_seconds']:.1f} s "
        f"({doc['model_profile'] or str(doc['kv_bytes_per_token']) + ' B/token'}"
        + (
            f", {doc['kv_compression']} blocks"
            if doc.get("kv_compression", "none") != "none"
            else ""
        )
        + ")",
        *textwrap.wrap(doc["net_saved_definition"] + ".", 100),
    ]
    if "sweep" in doc:
        sw = doc["sweep"]
        others = _others(doc, sw["tier"])
        head, rows = _sweep_rows(doc)
        widths = [max(len(x) for x in col) + 2 for col in zip(head, *rows, strict=True)]
        lines += [
            "",
            f"sweep of tier {sw['tier']} ({sw['method']})"
            + (f", others fixed: {others}" if others else "")
            + "; hit = % of block references",
        ]
        for row in [head, *rows]:
            lines.append("".join(f"{x:>{w}}" for x, w in zip(row, widths, strict=True)))
    return "\n".join(lines)


def _public(doc: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in doc.items() if not k.startswith("_")}


def write_json(doc: dict[str, Any], target: str) -> None:
    """Write the document as JSON to ``target`` (a path, or ``-`` for stdout)."""
    text = json.dumps(_public(doc), indent=2)
    if target == "-":
        sys.stdout.write(text + "\n")
    else:
        Path(target).write_text(text + "\n", encoding="utf-8")


def write_markdown(
    doc: dict[str, Any], path: str, plot_path: str | None = None, title: str = "kvtier analyze"
) -> None:
    """A Markdown report: the summary table, per-tier rows, savings and the sweep."""
    rd = doc["reuse_distance"]
    out = [f"# {title}", "", "| metric | value |", "| --- | --- |"]
    for key in (
        "format",
        "requests",
        "block_refs",
        "unique_blocks",
        "block_tokens",
        "input_tokens",
        "hit_blocks",
        "hit_tokens",
    ):
        out.append(
            f"| {key} | {doc[key]:,} |" if isinstance(doc[key], int) else f"| {key} | {doc[key]} |"
        )
    out += [
        f"| block_hit_ratio | {_pct(doc['block_hit_ratio'])} |",
        f"| token_hit_ratio | {_pct(doc['token_hit_ratio'])} |",
        f"| infinite-capacity token hit ratio | {_pct(doc['infinite_capacity']['token_hit_ratio'])} |",
        f"| reuse distance p50 / p90 / p99 (blocks) | {rd['p50']} / {rd['p90']} / {rd['p99']} |",
        f"| saved prefill (s) | {doc['saved_prefill_seconds']:.2f} |",
        f"| restore (s) | {doc['restore_seconds']:.2f} |",
        f"| net saved (s) | {doc['net_saved_seconds']:.2f} |",
        "",
        f"Definition: {doc['net_saved_definition']}.",
        "",
        "## Tiers",
        "",
        "| tier | policy | capacity | blocks | hit blocks | hit % | read GiB | write GiB | evicted |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for t in doc["tiers"]:
        share = t["hit_blocks"] / max(doc["block_refs"], 1)
        out.append(
            f"| {t['name']} | {t['policy']} | {t['capacity_text']} | "
            f"{_cap(t['capacity_blocks'])} | {t['hit_blocks']:,} | {_pct(share)} | "
            f"{t['read_bytes'] / GIB:.2f} | {t['write_bytes'] / GIB:.2f} | "
            f"{t['evicted_blocks']:,} |"
        )
    if "sweep" in doc:
        out += _sweep_section(doc)
    if plot_path:
        out += ["", f"![hit ratio per tier, sweep and reuse distance]({Path(plot_path).name})"]
    Path(path).write_text("\n".join(out) + "\n", encoding="utf-8")


def _sweep_section(doc: dict[str, Any]) -> list[str]:
    """The Markdown report's sweep: one row per capacity of the swept tier."""
    sw = doc["sweep"]
    others = _others(doc, sw["tier"])
    head, rows = _sweep_rows(doc)
    return [
        "",
        f"## Sweep of tier `{sw['tier']}` ({sw['method']})",
        "",
        f"The other tiers fixed ({others or 'none'}); a tier's hit is its share of the "
        "block references, net saved as defined above.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + " ---: |" * len(head),
        *("| " + " | ".join(r) + " |" for r in rows),
    ]


def write_plot(doc: dict[str, Any], path: str) -> None:
    """One hit-ratio plot per tier, the sweep and the reuse CDF (``plot.write_plot``)."""
    from cachestore.analyze.plot import write_plot as _write

    _write(doc, path)
