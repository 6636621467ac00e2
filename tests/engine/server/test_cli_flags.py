"""The ``kvtier`` command line as a user meets it: every flag of every subcommand has help
text and ``--help`` shows its default; a bad flag or value is one line under the
subcommand's own usage, exit code 2, no traceback (``--port 70000``, an unknown flag,
``analyze --plot`` into a missing directory)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine.cli import build_parser, subcommand_parser
from tests.servers import python_env

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[3]
TRACE = ROOT / "tests" / "data" / "traces" / "conversation_trace.jsonl.gz"


def _kvtier(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "engine.cli", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=90,
        env=python_env(),
    )


@pytest.mark.parametrize("name", ["serve", "cache-server", "analyze", "demo"])
def test_every_flag_has_help(name: str) -> None:
    parser = subcommand_parser(build_parser([name]), name)
    missing = [a.option_strings or a.dest for a in parser._actions if not a.help]
    assert missing == []


def test_help_shows_the_defaults() -> None:
    flat = " ".join(_kvtier("serve", "--help").stdout.split())
    for text in (
        "HTTP port (1..65535) (default: 8000)",
        "(default: 2048)",
        "(default: 64)",
        "(default: 127.0.0.1)",
        "(default: auto)",
        "(default: info)",
        "(docs/offload.md) (default: 10)",
        "(docs/offload.md) (default: 120)",
    ):
        assert text in flat, text
    flat = " ".join(_kvtier("analyze", "--help").stdout.split())
    assert "(default: llama-3-8b, unless --kv-bytes-per-token is given)" in flat
    assert "(default: lru)" in flat


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (
            ["serve", "--port", "70000"],
            "kvtier serve: error: argument --port: invalid port 70000: a number 1..65535",
        ),
        (["serve", "--bogus"], "kvtier serve: error: unrecognized arguments: --bogus"),
        (
            ["serve", "--shutdown-timeout", "-1"],
            "kvtier serve: error: argument --shutdown-timeout: invalid seconds -1: a whole "
            "number >= 0",
        ),
        (
            ["serve", "--engine-stall-timeout", "2.5"],
            "kvtier serve: error: argument --engine-stall-timeout: invalid seconds '2.5': a "
            "whole number >= 0",
        ),
        (
            ["cache-server", "--admin-port", "99999"],
            "kvtier cache-server: error: argument --admin-port: invalid port 99999: a number 0..65535",
        ),
        (
            ["analyze", str(TRACE), "--nope"],
            "kvtier analyze: error: unrecognized arguments: --nope",
        ),
    ],
)
def test_bad_flags_are_one_line_under_the_subcommand(argv: list[str], line: str) -> None:
    result = _kvtier(*argv)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1] == line
    assert lines[0].startswith(f"usage: kvtier {argv[0]} ")


def test_analyze_output_into_a_missing_directory(tmp_path: Path) -> None:
    result = _kvtier(
        "analyze",
        str(TRACE),
        "--tier",
        "host=64GiB",
        "--quiet",
        "--plot",
        str(tmp_path / "missing" / "x.png"),
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"kvtier analyze: --plot {tmp_path / 'missing' / 'x.png'}: no such directory "
        f"{tmp_path / 'missing'}"
    ]
