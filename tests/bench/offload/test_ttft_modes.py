"""``python -m bench.offload --sections ttft`` runs the modes it is asked for (recompute always,
as the yardstick) with the asked-for question after the reloaded prefix, and refuses unknown
modes: the H200 call that measures them has a fixed time limit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.offload.main import main


def test_only_the_chosen_modes_run_with_the_chosen_suffix(tmp_path: Path) -> None:
    argv = ["--tiny", "--sections", "ttft", "--ttft-modes", "host", "--lengths", "256"]
    rc = main([*argv, "--suffix-tokens", "160", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "offload.json").read_text())
    assert rc == 0, res["ttft"]
    modes = res["ttft"]["modes"]
    assert list(modes) == ["recompute", "host"]
    # the whole 256-token prefix reloads; the 160 new tokens are computed (the pool has room for them too)
    assert modes["host"]["256"]["cached_tokens"] == 256
    assert modes["recompute"]["256"]["cached_tokens"] == 0
    assert "host_256" in res["ttft"]["speedup_vs_recompute"]


@pytest.mark.parametrize("bad", [["--ttft-modes", "host,nope"], ["--suffix-tokens", "0"]])
def test_bad_flags_are_refused(bad: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--tiny", "--sections", "ttft", *bad])
    assert "error:" in capsys.readouterr().err
