"""Layers shared by the Llama-family models: RMSNorm, rotary embedding, SwiGLU MLP.

All numerics follow the reference recipe the checkpoints were trained with: RMSNorm in
float32 then cast back, rotary cos/sin computed in float32 and applied in the activation
dtype, the "rotate half" (non-interleaved) convention of HF checkpoints.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import reference
from engine.models.base import RopeConfig


class RMSNorm(nn.Module):
    """``weight * x / rms(x)`` over the last dim, the reduction in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and x.device.type == "cpu":
            return cpu_rms_norm(x, self.weight, self.eps)
        # torch's fused rms_norm: float32 statistics, the weight applied before the one
        # rounding to x's dtype (the reference rounds once more, before the weight: at most
        # one bf16 ulp apart). One kernel instead of eight elementwise ones on a GPU, which
        # is most of a decode step's launch overhead and a third of a long prefill's norms.
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def cpu_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm for float32 on the CPU in three passes over ``x``: torch's ``rms_norm`` there is
    its decomposition (pow, mean, add, rsqrt, mul, mul: a 1,024 x 576 activation 0.4-0.7 ms
    against 0.2, 61 of them per forward). The HF order: ``(x * rsqrt(mean(x^2) + eps)) * w``;
    the sum of squares as ``vector_norm``'s square (one reduction pass, where ``vecdot`` is a
    multiply into a temporary then a sum: 0.07 against 0.15 ms), within 1e-6 of float64."""
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    rstd = norm.square_().div_(x.shape[-1]).add_(eps).rsqrt_()
    return torch.mul(x, rstd).mul_(weight)


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Per-pair inverse frequencies ``[head_dim // 2]`` (float32, CPU), scaling applied."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        # Llama 3.1 scaling: long wavelengths are slowed by `factor`, short ones kept, and the
        # band in between blends the two linearly in 1/wavelength.
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        blend = (old_len / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        blended = (1 - blend) * scaled / rope.factor + blend * scaled
        in_band = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(in_band, blended, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Rotary position embedding for q ``[T, Hq, D]`` and k ``[T, Hkv, D]``.

    The cos/sin table is computed in float32 once and kept per (device, dtype), cast like the
    reference (float32 then the activation dtype). It is a plain attribute, not a buffer, so
    that a model built on the meta device keeps it. ``cos_sin(positions, dtype)`` gathers one
    step's rows once for all layers; ``apply`` rotates with them (3 kernels per tensor)."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, rope)
        pos = torch.arange(max_positions, dtype=torch.int64, device="cpu").float()
        freqs = torch.outer(pos, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos = emb.cos()
        # rotate_half(x) * sin == cat(x2, x1) * cat(-sin1, sin2): the sign lives in the table.
        half = head_dim // 2
        self._sin_signed = torch.cat((-emb[:, :half].sin(), emb[:, half:].sin()), dim=-1)
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        self.max_positions = max_positions

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, signed sin)``, each ``[T, 1, D]`` in ``dtype`` on ``positions.device``."""
        key = (positions.device, dtype)
        table = self._tables.get(key)
        if table is None:
            table = (
                self._cos.to(device=positions.device, dtype=dtype),
                self._sin_signed.to(device=positions.device, dtype=dtype),
            )
            self._tables[key] = table
        return table[0][positions].unsqueeze(1), table[1][positions].unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """``x * cos + rotate_half(x) * sin`` for ``x [T, H, D]``; returns a new tensor
        (``engine.kernels.reference.rotary``: the fused kernels are checked against it). On
        the CPU the halves are multiplied straight into the output, without the rotated
        copy (``cat``): a 1,024-token prefill of SmolLM2, 0.6 against 1.4 ms a layer."""
        if x.device.type != "cpu":
            return reference.rotary(x, cos, sin_signed)
        half = x.shape[-1] // 2
        out = torch.empty(x.shape, dtype=x.dtype)
        torch.mul(x[..., half:], sin_signed[..., :half], out=out[..., :half])
        torch.mul(x[..., :half], sin_signed[..., half:], out=out[..., half:])
        return out.addcmul_(x, cos)  # one rounding apart from the reference's order

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin(positions, q.dtype)
        return self.apply(q, cos, sin), self.apply(k, cos, sin)


class SwiGLUMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int, bias: bool) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        # Tensor parallel: sums down_proj's partial outputs across ranks (None: one rank).
        self.tp_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        out = self.down_proj(F.silu(gate).mul_(up))  # in place: one activation less
        return out if self.tp_reduce is None else self.tp_reduce(out)
