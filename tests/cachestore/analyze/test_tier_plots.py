"""Issue 20, point 9: the sweep and the plots follow the configured tiers.

A four-request trace whose numbers follow by hand from the simulation (docs/analyze.md):
r0 = [a, b], r1 = [c, d], r2 = [a, b], r3 = [c, d]. At r2's lookup the LRU stack is d, c, b, a,
so a is at depth 4 and b at depth 3; at r3's, after r2 touched a and b, c is at 4 and d at 3.
With ``s3=inf`` under the host every one of those four reuses hits (total 4 of 8 block refs,
whatever the host's size); the host serves the ones at depth <= its capacity: none at 1 block,
b and d at 3 blocks, all four at 4.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from cachestore.analyze.sweeps import NET_SAVED_DEFINITION
from engine.cli import main as kvtier

ROWS = [["a", "b"], ["c", "d"], ["a", "b"], ["c", "d"]]
IDS = {"a": 1, "b": 2, "c": 3, "d": 4}


def _trace(tmp_path: Path) -> Path:
    path = tmp_path / "four.jsonl"
    path.write_text(
        "".join(
            json.dumps(
                {
                    "timestamp": i,
                    "input_length": 1024,
                    "output_length": 1,
                    "hash_ids": [IDS[k] for k in row],
                }
            )
            + "\n"
            for i, row in enumerate(ROWS)
        )
    )
    return path


def _analyze(tmp_path: Path, *flags: str) -> dict:
    out = tmp_path / "doc.json"
    assert (
        kvtier(
            [
                "analyze",
                str(_trace(tmp_path)),
                "--model-profile",
                "llama-3-8b",
                "--json",
                str(out),
                "--quiet",
                *flags,
            ]
        )
        == 0
    )
    return json.loads(out.read_text())


@pytest.mark.parametrize("replay", [False, True])
def test_sweep_over_host_with_s3_inf_moves_the_host_share_not_the_total(
    tmp_path: Path, replay: bool
) -> None:
    doc = _analyze(
        tmp_path,
        "--tier",
        "host=4blocks",
        "--tier",
        "s3=inf",
        "--sweep",
        "host=1blocks,3blocks,4blocks",
        *(["--replay"] if replay else []),
    )
    sw = doc["sweep"]
    assert sw["method"] == ("replay" if replay else "mattson")
    assert sw["capacities_blocks"] == [1, 3, 4]
    assert sw["capacities_text"] == ["1blocks", "3blocks", "4blocks"]
    assert sw["tier_hit_ratio"] == {"host": [0.0, 0.25, 0.5], "s3": [0.5, 0.25, 0.0]}
    assert sw["block_hit_ratio"] == [0.5, 0.5, 0.5]
    assert sw["token_hit_ratio"] == [0.5, 0.5, 0.5]
    assert sw["total_capacity_blocks"] == [None, None, None]
    # An S3 reload of a 64 MiB block is slower than prefilling its 512 tokens, so a request
    # with any block in S3 is recomputed (0 saved); only at 4 blocks do both reuses reload from
    # host, and that point is the run's own figure. The prefill the hits would save is flat.
    net = sw["net_saved_seconds"]
    assert net[:2] == [0.0, 0.0] and net[2] > 0
    assert net[2] == pytest.approx(doc["net_saved_seconds"])
    assert len(set(sw["saved_prefill_seconds"])) == 1
    assert sw["saved_prefill_seconds"][0] == pytest.approx(doc["saved_prefill_seconds"])


def test_report_and_table_define_net_saved(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    md = tmp_path / "r.md"
    _analyze(
        tmp_path,
        "--tier",
        "host=3blocks",
        "--tier",
        "s3=inf",
        "--sweep",
        "host=1blocks,4blocks",
        "--report",
        str(md),
    )
    report = md.read_text()
    assert f"Definition: {NET_SAVED_DEFINITION}." in report
    assert NET_SAVED_DEFINITION.startswith("net saved = sum over requests of max(saved - restore")
    assert (
        "| capacity | blocks | host hit | s3 hit | total blocks | total tokens | net saved s |"
        in report
    )
    assert "| 1blocks | 1 | 0.00% | 50.00% | 50.00% | 50.00% |" in report
    assert "| 4blocks | 4 | 50.00% | 0.00% | 50.00% | 50.00% |" in report
    table = " ".join(capsys.readouterr().out.split())  # the terminal wraps the definition
    assert NET_SAVED_DEFINITION in table
    assert "sweep of tier host (mattson), others fixed: s3=inf" in table


def test_plot_has_one_axes_per_tier_marked_in_the_units_given(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from cachestore.analyze.cli import add_arguments, build_config
    from cachestore.analyze.plot import build_figure
    from cachestore.analyze.summary import analyze
    from cachestore.analyze.traces import read_trace

    png = tmp_path / "p.png"
    # 64 MiB a block (512 tokens x 128 KiB): host 128MiB = 2 blocks, lmdb 1024 tokens = 2.
    doc = _analyze(
        tmp_path,
        "--tier",
        "host=128MiB",
        "--tier",
        "lmdb=1024tok",
        "--tier",
        "s3=inf",
        "--sweep",
        "host=64MiB,256MiB,inf",
        "--plot",
        str(png),
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [c["tier"] for c in doc["tier_curves"]] == ["host", "lmdb", "s3"]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            str(tmp_path / "four.jsonl"),
            "--tier",
            "host=128MiB",
            "--tier",
            "lmdb=1024tok",
            "--tier",
            "s3=inf",
            "--model-profile",
            "llama-3-8b",
            "--sweep",
            "host=64MiB,inf",
        ]
    )
    trace = read_trace(args.trace)
    full = analyze(trace, build_config(args, trace), keep_distances=True, curves=True)
    fig = build_figure(full)
    axes = {ax.get_label(): ax for ax in fig.axes}
    assert sorted(axes) == [
        "reuse_cdf",
        "sweep:hits",
        "sweep:net_saved",
        "tier:host",
        "tier:lmdb",
        "tier:s3",
    ]
    host, lmdb, s3 = axes["tier:host"], axes["tier:lmdb"], axes["tier:s3"]
    assert "GiB" in host.get_xlabel() and "tokens" in lmdb.get_xlabel()
    assert "GiB" in s3.get_xlabel()  # inf borrows the stack's first unit

    def marked(ax: object) -> tuple[float, str]:
        line = next(ln for ln in ax.get_lines() if ln.get_label().startswith("configured"))
        return float(line.get_xdata()[0]), line.get_label()

    assert marked(host) == (pytest.approx(0.125), "configured host=128MiB")  # GiB
    assert marked(lmdb) == (pytest.approx(1024.0), "configured lmdb=1024tok")  # tokens
    assert marked(s3)[1].startswith("configured s3=inf")
    # Each tier's curve is its own share with the others fixed; the sweep's ticks as written.
    curve = full["tier_curves"][0]
    own = next(ln for ln in host.get_lines() if ln.get_label() == "host hits")
    assert list(own.get_ydata()) == [100 * y for y in curve["tier_hit_ratio"]]
    ticks = [t.get_text() for t in axes["sweep:hits"].get_xticklabels()]
    assert ticks == ["64MiB", "inf"]
    assert {ln.get_label() for ln in axes["sweep:hits"].get_lines()} == {
        "host hits",
        "lmdb hits",
        "s3 hits",
        "total (blocks)",
        "total (tokens)",
    }
