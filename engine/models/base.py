"""What every decoder model in ``engine/models`` shares: the parsed architecture config and the
interface the model runner calls.

``ModelArchConfig.from_hf(config_dict)`` turns a Hugging Face ``config.json`` into one frozen
value with everything the plain-torch models need, and rejects what they do not implement
(sliding windows, unknown rope types) with a clear ValueError instead of silently computing
something else.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from engine.attention.base import AttentionBackend
    from engine.kv_cache import KVCache

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool  # bias on q/k/v projections (Qwen2 always, Llama/Qwen3 if attention_bias)
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # per-head RMSNorm of q and k before rotary (Qwen3)

    @property
    def max_context_len(self) -> int:
        """The longest context the model's config supports: ``max_position_embeddings``,
        times the factor for ``linear`` rope scaling (HF configs keep the original length
        there); ``llama3`` configs already state the extended length."""
        if self.rope.rope_type == "linear" and self.rope.factor > 1.0:
            return int(self.max_position_embeddings * self.rope.factor)
        return self.max_position_embeddings

    @staticmethod
    def from_hf(cfg: dict[str, Any]) -> ModelArchConfig:
        """Parse a HF config dict. Raises ValueError on an unsupported feature."""
        archs = cfg.get("architectures") or []
        if len(archs) != 1:
            raise ValueError(f"config.json must name exactly one architecture, got {archs!r}")
        arch = archs[0]
        hidden = int(cfg["hidden_size"])
        num_heads = int(cfg["num_attention_heads"])
        head_dim = cfg.get("head_dim") or hidden // num_heads
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"only hidden_act=silu is supported, got {cfg.get('hidden_act')!r}")
        sliding = cfg.get("sliding_window")
        uses_sliding = cfg.get("use_sliding_window", arch == "MistralForCausalLM")
        if sliding is not None and uses_sliding:
            raise ValueError(f"{arch} with sliding_window={sliding} is not supported")
        attention_bias = bool(cfg.get("attention_bias", False))
        is_qwen2 = arch == "Qwen2ForCausalLM"
        return ModelArchConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rope=_parse_rope(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=True if is_qwen2 else attention_bias,
            o_bias=False if is_qwen2 else attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
        )


def _parse_rope(cfg: dict[str, Any]) -> RopeConfig:
    # transformers 5 writes "rope_parameters" (theta inside); older files "rope_theta" + "rope_scaling".
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope type {rope_type!r} not supported; use one of {SUPPORTED_ROPE_TYPES}"
        )
    if float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


class CausalLM(Protocol):
    """A decoder-only model as the runner sees it. Implementations are ``torch.nn.Module``s."""

    arch: ModelArchConfig

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        """Flat batch ``[T]`` ids and positions -> final hidden states ``[T, hidden]``.

        Writes the new tokens' KV into ``kv_cache`` through ``attn`` (already planned)."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> ``[n, vocab]`` float32 logits."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into parameters; returns the parameter names filled."""
        ...
