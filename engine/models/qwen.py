"""Qwen2 and Qwen3: the Llama decoder with config-driven differences.

Qwen2 adds a bias to the q/k/v projections; Qwen3 drops it and normalizes q and k per head
(RMSNorm over head_dim) before rotary, with a head_dim independent of hidden/heads. Both are
expressed as ``ModelArchConfig`` flags (``qkv_bias``, ``qk_norm``) parsed from config.json,
so the classes only name the architectures for the registry.
"""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama + q/k/v bias (``arch.qkv_bias``)."""


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Llama + per-head q/k RMSNorm (``arch.qk_norm``), explicit head_dim."""
