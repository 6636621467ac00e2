"""Tiny random-weight Hugging Face models for engine tests (no downloads).

``make_tiny_model(tmp_path, "llama"|"qwen2"|"qwen3", seed=0, **overrides)`` builds a config,
instantiates the HF model in float32, overwrites every parameter from a seeded generator with
values large enough that logits differ clearly between tokens (norm weights around 1, biases
non-zero), saves it with ``save_pretrained`` (safetensors) plus the demo tokenizer, and returns
the directory. Same arguments, same weights.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from engine.models.demo_model import TOKENIZER_VOCAB_SIZE, save_demo_tokenizer

_COMMON: dict[str, Any] = dict(
    vocab_size=TOKENIZER_VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)


def tiny_config(arch: str, **overrides: Any):  # -> transformers.PretrainedConfig
    """The transformers config of a tiny model; ``overrides`` win over the defaults."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    kwargs = dict(_COMMON)
    if arch == "llama":
        cls = LlamaConfig
    elif arch == "qwen2":
        cls = Qwen2Config
    elif arch == "qwen3":
        cls = Qwen3Config
        kwargs["head_dim"] = 32  # Qwen3 decouples head_dim from hidden/heads
    else:
        raise ValueError(f"unknown tiny arch {arch!r}; use llama, qwen2 or qwen3")
    kwargs.update(overrides)
    return cls(**kwargs)


def build_tiny_hf_model(arch: str, seed: int = 0, **overrides: Any):  # -> PreTrainedModel
    """The HF model (float32, eval mode) with seeded non-trivial weights, not saved."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.2 * noise)
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(0.5 * noise)
            else:
                p.copy_(noise / (p.shape[-1] ** 0.5))  # unit-variance activations
    return model.eval()


def make_tiny_model(
    tmp_path: str | os.PathLike[str], arch: str, seed: int = 0, **overrides: Any
) -> str:
    """Save a tiny model + tokenizer under ``tmp_path/<arch>-<seed>`` and return that path."""
    out = Path(tmp_path) / f"tiny-{arch}-{seed}"
    n = 0
    while out.exists():  # several variants in one tmp_path
        n += 1
        out = Path(tmp_path) / f"tiny-{arch}-{seed}-{n}"
    model = build_tiny_hf_model(arch, seed, **overrides)
    model.save_pretrained(str(out), safe_serialization=True)
    save_demo_tokenizer(str(out))
    return str(out)
