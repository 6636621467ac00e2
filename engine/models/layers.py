"""Layers shared by the Llama-family models: RMSNorm, rotary embedding, SwiGLU MLP.

All numerics follow the reference recipe the checkpoints were trained with: RMSNorm in
float32 then cast back, rotary cos/sin computed in float32 and applied in the activation
dtype, the "rotate half" (non-interleaved) convention of HF checkpoints.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.base import RopeConfig


class RMSNorm(nn.Module):
    """``weight * x / rms(x)`` over the last dim, the reduction in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


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
    """Applies rotary position embedding to q ``[T, Hq, D]`` and k ``[T, Hkv, D]``.

    The cos/sin table is a plain attribute (not a buffer) so that a model built on the meta
    device keeps it; it moves to the activations' device on first use."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, rope)
        pos = torch.arange(max_positions, dtype=torch.int64, device="cpu").float()
        freqs = torch.outer(pos, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos = emb.cos()
        self._sin = emb.sin()
        self.max_positions = max_positions

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cos.device != positions.device:
            self._cos = self._cos.to(positions.device)
            self._sin = self._sin.to(positions.device)
        cos = self._cos[positions].to(q.dtype).unsqueeze(1)  # [T, 1, D]
        sin = self._sin[positions].to(q.dtype).unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class SwiGLUMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int, bias: bool) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)
