"""Model registry: HF ``architectures[0]`` name -> plain-torch implementation.

Modules are imported only when their architecture is requested. Beside the models, where their
weights come from: ``sources`` resolves a model argument to a directory (``gguf`` converts a GGUF
file once, ``demo_model`` builds the embedded random model) and ``loader`` loads it.
"""

from __future__ import annotations

import importlib

from engine.models.base import CausalLM, ModelArchConfig

_REGISTRY: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("engine.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("engine.models.llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("engine.models.qwen", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("engine.models.qwen", "Qwen3ForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def check_architecture(architecture: str) -> None:
    """Raises ValueError if there is no model class for this HF architecture name (imports
    nothing: the API process checks a model without torch)."""
    if architecture not in _REGISTRY:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(supported_architectures())}"
        )


def get_model_class(architecture: str) -> type:
    """The model class for an HF architecture name. Raises ValueError if unsupported."""
    check_architecture(architecture)
    module, cls = _REGISTRY[architecture]
    return getattr(importlib.import_module(module), cls)


__all__ = [
    "CausalLM",
    "ModelArchConfig",
    "check_architecture",
    "get_model_class",
    "supported_architectures",
]
