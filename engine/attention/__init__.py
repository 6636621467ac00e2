"""Attention backends behind one interface (base.py), chosen by name.

The factory imports a backend only when chosen, so the optional FlashInfer dependency is
loaded only on a GPU host that asks for it.
"""

from __future__ import annotations

import importlib

from engine.attention.base import AttentionBackend, AttentionMetadata

# name -> (module, class); "flashinfer" is added by the GPU backend's module.
_BACKENDS: dict[str, tuple[str, str]] = {
    "torch": ("engine.attention.torch_backend", "TorchAttentionBackend"),
    "flashinfer": ("engine.attention.flashinfer_backend", "FlashInferAttentionBackend"),
}


def resolve_backend_name(name: str, device_type: str) -> str:
    """``auto`` -> flashinfer on CUDA when importable, else torch. Raises on unknown names."""
    if name == "auto":
        if device_type == "cuda":
            try:
                importlib.import_module(_BACKENDS["flashinfer"][0])
                return "flashinfer"
            except ImportError:
                return "torch"
        return "torch"
    if name not in _BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; choose from auto, {', '.join(_BACKENDS)}"
        )
    return name


def create_attention_backend(
    name: str,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
    graph_decode: str = "auto",
    small_query: str = "flashinfer",
) -> AttentionBackend:
    """Instantiate a resolved backend name (see ``resolve_backend_name``); ``graph_decode``
    and ``small_query`` go to the flashinfer backend (its kernels for CUDA-graph decode steps
    and for eager steps of few new tokens), others ignore them."""
    module_name, cls_name = _BACKENDS[name]
    cls = getattr(importlib.import_module(module_name), cls_name)
    if name == "flashinfer":
        return cls(
            num_heads,
            num_kv_heads,
            head_dim,
            scale,
            graph_decode=graph_decode,
            small_query=small_query,
        )
    return cls(num_heads, num_kv_heads, head_dim, scale)


__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "create_attention_backend",
    "resolve_backend_name",
]
