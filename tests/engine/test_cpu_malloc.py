"""glibc malloc kept from mapping and unmapping activation-sized blocks on CPU
(engine/runner/cpu_threads.py ``configure_cpu_malloc``): a block freed and allocated again
costs no page faults once tuned, the environment's own allocator settings are kept, and the
model runner applies it on CPU. Each case runs in a fresh interpreter: mallopt is process-wide."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)

# A 48 MiB block (above glibc's largest dynamic mmap threshold, 32 MiB), written, freed, ten
# times after ten to warm up: untuned, each one is a fresh mmap whose 12,288 pages fault in
# again; tuned, the heap holds it (after a few grow steps: torch's 64-byte aligned request is
# a little larger than the freed chunk until freed neighbours coalesce).
_CHURN = """
import resource, sys, torch
from engine.runner.cpu_threads import configure_cpu_malloc
first = configure_cpu_malloc() if sys.argv[1] == "tune" else "untouched"
again = configure_cpu_malloc() if sys.argv[1] == "tune" else "untouched"
for _ in range(10):  # the heap grows until a freed block fits the next, aligned request
    torch.empty(12 << 20).fill_(1.0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    torch.empty(12 << 20).fill_(1.0)
print(first, again, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _churn(mode: str, **env: str) -> list[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    full_env.update(env, PYTHONPATH=ROOT)
    out = subprocess.run(
        [sys.executable, "-c", _CHURN, mode],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return out.stdout.split()


def test_tuned_malloc_reuses_freed_blocks_without_faults() -> None:
    first, again, faults = _churn("tune")
    assert (first, again) == ("tuned", "kept")
    assert int(faults) < 1000
    *_, untuned = _churn("plain")
    assert int(untuned) > 10 * 12_000  # the cost it removes: every page, every time


def test_environment_settings_are_kept() -> None:
    first, _, faults = _churn("tune", MALLOC_TRIM_THRESHOLD_="131072")
    assert first == "kept"
    assert int(faults) > 10 * 12_000  # glibc's defaults (the variable alone keeps mmap on)
