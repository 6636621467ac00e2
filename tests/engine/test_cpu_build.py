"""Where the CPU kernels' compiled libraries go: kvtier's one cache directory."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCE = "void add_one(int *x) { *x += 1; }\n"


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no cc")
def test_a_kernel_is_built_under_kvtier_cache_dir_not_home(tmp_path: Path) -> None:
    """With ``KVTIER_CACHE_DIR`` set, a kernel's library lands in its ``cpu_kernels`` and
    nothing under ``$HOME`` (a user who points kvtier's cache elsewhere finds everything
    there); it loads and runs."""
    cache, home = tmp_path / "cache", tmp_path / "home"
    home.mkdir()
    code = (
        "import ctypes\n"
        "from engine.kernels.cpu_build import CKernel\n"
        f"k = CKernel('add_one_test', {SOURCE!r}, 'add_one', [ctypes.POINTER(ctypes.c_int)], 'X')\n"
        "x = ctypes.c_int(41)\n"
        "k.function()(ctypes.byref(x))\n"
        "print(x.value)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "XDG_CACHE_HOME"}
    env.update(KVTIER_CACHE_DIR=str(cache), HOME=str(home), PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "42"
    built = list((cache / "cpu_kernels").glob("add_one_test-*.so"))
    assert len(built) == 1 and ctypes.CDLL(str(built[0]))
    assert not any(home.rglob("*"))
