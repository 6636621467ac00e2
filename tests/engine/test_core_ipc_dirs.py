"""The engine core's socket directories: one left behind by an API process killed unclosed
(``kill -9``) is removed by the next start; nothing else is touched."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from engine.core.launch import IPC_DIR_PREFIX, OWNER_FILE, sweep_stale_ipc_dirs


def _dir(parent: Path, name: str, owner: int | None) -> Path:
    d = parent / f"{IPC_DIR_PREFIX}{name}"
    d.mkdir()
    (d / "requests").write_text("")  # stands for the socket file
    if owner is not None:
        (d / OWNER_FILE).write_text(str(owner))
    return d


def test_only_directories_of_dead_owners_are_removed(tmp_path: Path) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], check=True,
                          capture_output=True, text=True)  # fmt: skip
    dead_pid = int(gone.stdout)  # exited: no such process now (pids are not reused at once)
    dead = _dir(tmp_path, "dead", dead_pid)
    live = _dir(tmp_path, "live", os.getpid())
    unknown = _dir(tmp_path, "unmarked", None)  # an older kvtier's: no owner named
    garbled = _dir(tmp_path, "garbled", None)
    (garbled / OWNER_FILE).write_text("not a pid")
    other = tmp_path / "something-else"
    other.mkdir()
    assert sweep_stale_ipc_dirs(str(tmp_path)) == 1
    assert not dead.exists()
    assert live.exists() and unknown.exists() and garbled.exists() and other.exists()
    assert sweep_stale_ipc_dirs(str(tmp_path)) == 0
    assert sweep_stale_ipc_dirs(str(tmp_path / "missing")) == 0
