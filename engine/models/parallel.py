"""Tensor parallelism for the Llama-family decoder: which slice of each weight a rank holds.

A rank ``r`` of ``N`` holds (Megatron-style, as vLLM):
- attention: query heads ``[r*H/N, (r+1)*H/N)`` and KV heads ``[r*K/N, (r+1)*K/N)`` of the
  fused q/k/v projection (column-parallel: rows of ``q_proj``/``k_proj``/``v_proj`` and their
  biases), and the matching input columns of ``o_proj`` (row-parallel);
- MLP: rows ``[r*I/N, (r+1)*I/N)`` of ``gate_proj``/``up_proj`` (column-parallel) and those
  input columns of ``down_proj`` (row-parallel);
- everything else replicated: embeddings, norms, per-head q/k norms, ``lm_head`` (a CPU engine
  gains little from splitting the vocabulary; every rank computes the same hidden states, only
  the driver rank computes logits).

The two row-parallel outputs are partial sums: ``attach_all_reduce`` makes each layer sum them
across ranks (``tp_reduce``). A row-parallel bias is added once: rank 0 loads it, the others
hold zeros. With ``N == 1`` nothing here runs: the model is built and loaded exactly as before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.models.base import ModelArchConfig


@dataclass(frozen=True, slots=True)
class TPShard:
    """This process's place in a tensor-parallel group."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} out of range for size {self.size}")

    def kv_head_range(self, num_kv_heads: int) -> tuple[int, int]:
        """The KV heads ``[lo, hi)`` this rank holds."""
        per = num_kv_heads // self.size
        return self.rank * per, (self.rank + 1) * per


def check_tp_size(arch: ModelArchConfig, size: int) -> None:
    """Raises ValueError unless ``size`` divides the KV heads, the query heads and the MLP's
    intermediate size (every rank then holds whole heads and a GQA group stays on one rank)."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    for what, n in (
        ("KV heads", arch.num_kv_heads),
        ("attention heads", arch.num_heads),
        ("intermediate size", arch.intermediate_size),
    ):
        if n % size:
            raise ValueError(f"tensor_parallel_size {size} does not divide the model's {n} {what}")


def local_arch(arch: ModelArchConfig, tp: TPShard) -> ModelArchConfig:
    """The shapes one rank computes: heads and intermediate size divided by ``tp.size``."""
    check_tp_size(arch, tp.size)
    return dataclasses.replace(
        arch,
        num_heads=arch.num_heads // tp.size,
        num_kv_heads=arch.num_kv_heads // tp.size,
        intermediate_size=arch.intermediate_size // tp.size,
    )


def shard_weight(
    name: str, tensor: torch.Tensor, arch: ModelArchConfig, tp: TPShard
) -> torch.Tensor:
    """This rank's slice of the HF checkpoint tensor ``name`` (``arch``: the full model's).
    Replicated tensors come back unchanged."""
    r, n = tp.rank, tp.size
    if ".q_proj." in name:
        return _rows(tensor, arch.num_heads * arch.head_dim, r, n)
    if ".k_proj." in name or ".v_proj." in name:
        return _rows(tensor, arch.num_kv_heads * arch.head_dim, r, n)
    if ".gate_proj." in name or ".up_proj." in name:
        return _rows(tensor, arch.intermediate_size, r, n)
    if ".o_proj." in name or ".down_proj." in name:
        if name.endswith(".bias"):  # added once, after the sum
            return tensor if r == 0 else torch.zeros_like(tensor)
        per = tensor.shape[1] // n
        return tensor[:, r * per : (r + 1) * per]
    return tensor


def _rows(tensor: torch.Tensor, total: int, rank: int, size: int) -> torch.Tensor:
    if tensor.shape[0] != total:
        raise ValueError(f"cannot split a tensor of {tensor.shape[0]} rows as {total}")
    per = total // size
    return tensor[rank * per : (rank + 1) * per]


def attach_all_reduce(
    model: torch.nn.Module, reduce: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    """Make every decoder layer sum its two row-parallel outputs (``o_proj``, ``down_proj``)
    across ranks with ``reduce`` (in place, returns its argument)."""
    for layer in model.model.layers:  # type: ignore[union-attr]
        layer.self_attn.tp_reduce = reduce
        layer.mlp.tp_reduce = reduce
