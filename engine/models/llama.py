"""The Llama-family decoder in plain torch: Llama 2/3, Mistral (no sliding window), and, by
config flags, Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm).

Projections are fused (qkv, gate+up) for fewer, larger matmuls; ``load_weights`` maps the
HF checkpoint names (``q_proj``, ``k_proj``, ...) onto the fused shards. Attention itself is
delegated to the step's ``AttentionBackend``, which owns the paged KV cache access.

``fused_kernels`` (set by the runner, default False) switches the decoder to the fused path:
the residual stream is carried beside the hidden state, each norm is one Triton kernel that
also adds the residual (``engine.kernels.fused_add_rms_norm``), and the MLP's SiLU * up is one
kernel (``silu_and_mul``), and q/k rotary is one kernel (``rotary``; not with per-head q/k
norms). Same math, one rounding apart; the torch path is the fallback.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.kernels import linear
from engine.models.base import ModelArchConfig
from engine.models.layers import RMSNorm, RotaryEmbedding, SwiGLUMLP
from engine.models.parallel import TPShard, local_arch, shard_weight

if TYPE_CHECKING:
    from engine.attention.base import AttentionBackend
    from engine.kv_cache import KVCache

# HF name fragment -> (our fused parameter fragment, shard index)
_FUSED = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


class Attention(nn.Module):
    def __init__(self, arch: ModelArchConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (
            arch.num_heads,
            arch.num_kv_heads,
            arch.head_dim,
        )
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self.qkv_proj = nn.Linear(
            arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=arch.o_bias)
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.rotary = rotary  # shared by all layers; not a submodule weight
        # Tensor parallel: sums o_proj's partial outputs across ranks (engine/models/parallel.py).
        self.tp_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def shard_sizes(self) -> list[int]:
        return [self.q_size, self.kv_size, self.kv_size]

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        x: torch.Tensor,
        attn: AttentionBackend,
        kv_cache: KVCache,
        fused: bool = False,
    ) -> torch.Tensor:
        """``rope`` = this step's ``(cos, signed sin)`` rows (RotaryEmbedding.cos_sin);
        ``fused``: rotate q and k with one Triton kernel (engine.kernels.rotary; on CUDA, once
        the backend is planned, ``rotary_and_cache``, which also stores the new K/V)."""
        cos, sin = rope
        qkv = linear(x, self.qkv_proj) if fused else self.qkv_proj(x)
        num_tokens = qkv.shape[0]
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        kv_layer = kv_cache.attention_view(self.layer_idx)  # waits for a layer still loading
        kv_written = False
        if self.q_norm is not None and self.k_norm is not None:
            q, k, _ = qkv.split(self.shard_sizes(), dim=-1)
            q = self.q_norm(q.reshape(num_tokens, self.num_heads, self.head_dim))
            k = self.k_norm(k.reshape(num_tokens, self.num_kv_heads, self.head_dim))
            q, k = RotaryEmbedding.apply(q, cos, sin), RotaryEmbedding.apply(k, cos, sin)
        else:
            if fused and attn.slot_mapping is not None and x.is_cuda:
                # One kernel: rotary on q and k, and the new K/V stored at the step's slots.
                from engine.kernels import rotary_and_cache

                qk = rotary_and_cache(
                    qkv, cos, sin, self.num_heads, self.num_kv_heads, kv_layer, attn.slot_mapping
                )
                kv_written = True
            else:
                # q and k are adjacent in the fused output: rotate both with one set of kernels.
                qk = qkv[:, : self.q_size + self.kv_size].view(
                    num_tokens, self.num_heads + self.num_kv_heads, self.head_dim
                )
                if fused:
                    from engine.kernels import rotary

                    qk = rotary(qk, cos, sin)
                else:
                    qk = RotaryEmbedding.apply(qk, cos, sin)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        out = attn.forward(self.layer_idx, q, k, v, kv_layer, kv_written=kv_written)
        out = linear(out, self.o_proj) if fused else self.o_proj(out)
        return out if self.tp_reduce is None else self.tp_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArchConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = Attention(arch, layer_idx, rotary)
        self.mlp = SwiGLUMLP(arch.hidden_size, arch.intermediate_size, arch.mlp_bias)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        x: torch.Tensor,
        attn: AttentionBackend,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        x = x + self.self_attn(rope, self.input_layernorm(x), attn, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        h: torch.Tensor,
        residual: torch.Tensor | None,
        attn: AttentionBackend,
        kv_cache: KVCache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused path: ``(h, residual)`` in, ``(mlp output, residual stream)`` out; the
        residual stream before this layer is ``h + residual`` (``h`` alone at layer 0)."""
        from engine.kernels import fused_add_rms_norm, silu_and_mul

        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            ln = self.input_layernorm
            h, residual = fused_add_rms_norm(h, residual, ln.weight, ln.eps)
        h = self.self_attn(rope, h, attn, kv_cache, fused=True)
        ln = self.post_attention_layernorm
        h, residual = fused_add_rms_norm(h, residual, ln.weight, ln.eps)
        h = linear(silu_and_mul(linear(h, self.mlp.gate_up_proj)), self.mlp.down_proj)
        return (h if self.mlp.tp_reduce is None else self.mlp.tp_reduce(h)), residual


class DecoderStack(nn.Module):
    """HF's ``model.*`` submodule: embeddings, layers, final norm."""

    def __init__(self, arch: ModelArchConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, i, rotary) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Implements ``engine.models.base.CausalLM``. Holds no per-request state."""

    def __init__(
        self, arch: ModelArchConfig, max_positions: int | None = None, tp: TPShard | None = None
    ) -> None:
        """``tp``: build one tensor-parallel rank's slice (``engine.models.parallel``);
        ``arch`` stays the full model's (``full_arch``), ``self.arch`` is what this rank holds."""
        super().__init__()
        self.full_arch = arch
        self.tp = tp if tp is not None and tp.size > 1 else None
        if self.tp is not None:
            arch = local_arch(arch, self.tp)
        self.arch = arch
        n_pos = max(max_positions or 0, arch.max_context_len)
        # Built outside the module tree so a meta-device build still gets a real table.
        self._rotary = RotaryEmbedding(arch.head_dim, n_pos, arch.rope)
        self.model = DecoderStack(arch, self._rotary)
        if arch.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.fused_kernels = False  # see the module docstring; CUDA + Triton only
        # The output head as a oneDNN-packed linear on CPU (engine/models/cpu_linear.py).
        self._packed_head: nn.Module | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        rope = self._rotary.cos_sin(positions, x.dtype)  # gathered once for every layer
        if self.fused_kernels:
            return self._forward_fused(rope, x, attn, kv_cache)
        for layer in self.model.layers:
            x = layer(rope, x, attn, kv_cache)
        return self.model.norm(x)

    def _forward_fused(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        x: torch.Tensor,
        attn: AttentionBackend,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        from engine.kernels import fused_add_rms_norm

        residual: torch.Tensor | None = None
        for layer in self.model.layers:
            x, residual = layer.forward_fused(rope, x, residual, attn, kv_cache)
        if residual is None:  # a model without layers
            return self.model.norm(x)
        norm = self.model.norm
        return fused_add_rms_norm(x, residual, norm.weight, norm.eps)[0]

    def pack_output_head(self, row_copy: bool = False) -> None:
        """Called by ``engine.models.cpu_linear.pack_cpu_linears`` once the linears are
        packed: an untied ``lm_head`` already is; a tied head packs a copy of the embedding
        table (the lookups keep the table), with ``row_copy`` as ``PackedLinear``'s."""
        from engine.models.cpu_linear import PackedLinear

        if self.lm_head is None:
            self._packed_head = PackedLinear(self.model.embed_tokens.weight, None, row_copy)
        else:
            self._packed_head = self.lm_head

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._packed_head is not None:
            return self._packed_head(hidden).float()
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        if self.fused_kernels:  # a batch-1 row through the gemv
            return linear(hidden, head).float()
        return torch.matmul(hidden, head.weight.t()).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors in (casting dtype/device). Raises ValueError on an unknown
        name or a shape mismatch; ignores rotary buffers and a tied ``lm_head``."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb" in name or (self.lm_head is None and name.startswith("lm_head.")):
                continue
            if self.tp is not None:
                tensor = shard_weight(name, tensor, self.full_arch, self.tp)
            shard = None
            for hf_part, (ours, idx) in _FUSED.items():
                if hf_part in name:
                    name, shard = name.replace(hf_part, ours), idx
                    break
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter")
            param = params[name]
            target = param.data
            if shard is not None:
                sizes = self._shard_sizes(name)
                target = target.narrow(0, sum(sizes[:shard]), sizes[shard])
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(target.shape)}"
                )
            with torch.no_grad():
                target.copy_(tensor)
            loaded.add(name)
        return loaded

    def _shard_sizes(self, fused_name: str) -> list[int]:
        if ".qkv_proj." in fused_name:
            return self.model.layers[0].self_attn.shard_sizes()
        return [self.arch.intermediate_size, self.arch.intermediate_size]


class MistralForCausalLM(LlamaForCausalLM):
    """Same weights and math as Llama; sliding windows are rejected by ModelArchConfig."""
