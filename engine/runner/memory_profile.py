"""The GPU KV-cache budget at start-up, measured the way vLLM does it.

``measure_kv_budget`` runs a caller-supplied profiling step (a forward pass of
``max_num_batched_tokens`` tokens plus sampling, on a throw-away KV cache) and reads the
allocator's peak. The budget is then

    gpu_memory_utilization * total device memory
      - memory the process holds outside torch's allocator (CUDA context, cuBLAS, other users)
      - weights and other persistent allocations (everything allocated before the step)
      - the step's peak activation memory (peak minus persistent minus the throw-away cache)
      - a reserve for the CUDA-graph memory pool (captured later, after the cache exists)

divided by the bytes of one block (all layers). ``kv_budget_from`` is the arithmetic alone, so
it can be tested without a GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

GRAPH_POOL_BASE_BYTES = 64 << 20  # per-graph bookkeeping and allocator rounding


@dataclass(frozen=True, slots=True)
class MemoryProfile:
    """What one profiling step measured on the device (bytes)."""

    total_bytes: int
    non_torch_bytes: int
    persistent_bytes: int  # weights, workspaces: allocated before the step and after it
    peak_activation_bytes: int
    num_profile_tokens: int


@dataclass(frozen=True, slots=True)
class KVBudget:
    total_bytes: int
    utilization: float
    non_torch_bytes: int
    persistent_bytes: int
    peak_activation_bytes: int
    cuda_graph_reserve_bytes: int
    kv_bytes: int
    bytes_per_block: int
    num_blocks: int

    def summary(self) -> str:
        gib = 1 << 30
        return (
            f"KV cache: {self.num_blocks} blocks ({self.kv_bytes / gib:.2f} GiB) = "
            f"{self.utilization:.2f} x {self.total_bytes / gib:.2f} GiB - weights/persistent "
            f"{self.persistent_bytes / gib:.2f} - activations {self.peak_activation_bytes / gib:.2f}"
            f" - non-torch {self.non_torch_bytes / gib:.2f} - cuda graphs "
            f"{self.cuda_graph_reserve_bytes / gib:.2f} GiB; {self.bytes_per_block} B/block"
        )


def cuda_graph_reserve(profile: MemoryProfile, max_capture_size: int) -> int:
    """Bytes set aside for the graph pool: the decode activations of the largest captured
    batch (scaled from the profiled per-token peak; smaller graphs share the pool), plus a
    fixed base. 0 when no graph is captured."""
    if max_capture_size <= 0:
        return 0
    per_token = profile.peak_activation_bytes / max(1, profile.num_profile_tokens)
    return int(per_token * max_capture_size) + GRAPH_POOL_BASE_BYTES


def kv_budget_from(
    profile: MemoryProfile, utilization: float, bytes_per_block: int, max_capture_size: int
) -> KVBudget:
    """The arithmetic of the module docstring. Raises ValueError if no block fits."""
    reserve = cuda_graph_reserve(profile, max_capture_size)
    kv_bytes = (
        int(profile.total_bytes * utilization)
        - profile.non_torch_bytes
        - profile.persistent_bytes
        - profile.peak_activation_bytes
        - reserve
    )
    num_blocks = kv_bytes // bytes_per_block
    if num_blocks < 1:
        raise ValueError(
            f"no room for a KV block of {bytes_per_block} bytes: {utilization} of "
            f"{profile.total_bytes} bytes minus weights {profile.persistent_bytes}, activations "
            f"{profile.peak_activation_bytes}, non-torch {profile.non_torch_bytes} and graphs "
            f"{reserve} leaves {kv_bytes}; raise gpu_memory_utilization or lower "
            "max_num_batched_tokens"
        )
    return KVBudget(
        total_bytes=profile.total_bytes,
        utilization=utilization,
        non_torch_bytes=profile.non_torch_bytes,
        persistent_bytes=profile.persistent_bytes,
        peak_activation_bytes=profile.peak_activation_bytes,
        cuda_graph_reserve_bytes=reserve,
        kv_bytes=num_blocks * bytes_per_block,
        bytes_per_block=bytes_per_block,
        num_blocks=num_blocks,
    )


def measure_profile(
    device: torch.device, run_step: Callable[[], int], num_profile_tokens: int
) -> MemoryProfile:
    """Run ``run_step`` once and measure it. ``run_step`` allocates its own throw-away KV cache,
    runs the step, frees the cache and returns the cache's size in bytes (subtracted from the
    peak). Synchronizes the device; call at start-up only."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    persistent = torch.cuda.memory_allocated(device)
    scratch_cache_bytes = run_step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(0, (total - free) - torch.cuda.memory_reserved(device))
    return MemoryProfile(
        total_bytes=total,
        non_torch_bytes=non_torch,
        persistent_bytes=persistent,
        peak_activation_bytes=max(0, peak - persistent - scratch_cache_bytes),
        num_profile_tokens=num_profile_tokens,
    )


def log_budget(budget: KVBudget) -> None:
    logger.info("%s", budget.summary())
