"""What a ``ModelRunner`` settles from its config and the loaded model before any step.

The device (``resolve_device``: ``auto`` picks CUDA when present), the EOS token ids the model
declares (``read_eos_token_ids``), whether the fused Triton kernels run
(``resolve_fused_kernels``), and the longest sequence it serves (``resolve_max_model_len``,
checked against the model's rotary table). Each raises ValueError with what to change.
"""

from __future__ import annotations

import json
import logging
import os

import torch

from engine.models.loader import LoadedModel

logger = logging.getLogger(__name__)


def resolve_device(device: str) -> torch.device:
    """``auto`` -> cuda if available else cpu. Raises ValueError for cuda without CUDA."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return dev


def read_eos_token_ids(model_dir: str, hf_config: dict) -> tuple[int, ...]:
    """EOS ids from generation_config.json (preferred, may be a list) and config.json."""
    ids: list[int] = []
    sources = [hf_config]
    gen_path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path, encoding="utf-8") as f:
            sources.insert(0, json.load(f))
    for src in sources:
        eos = src.get("eos_token_id")
        for tok in eos if isinstance(eos, list) else [eos]:
            if tok is not None and int(tok) not in ids:
                ids.append(int(tok))
    return tuple(ids)


def resolve_fused_kernels(
    wanted: bool | None, model: torch.nn.Module, device: torch.device
) -> bool:
    """Decide and apply the fused-kernel switch (see ModelRunner). Raises ValueError when
    ``wanted`` is True and the kernels or the model cannot do it."""
    from engine.kernels import fused_kernels_available

    supported = hasattr(model, "fused_kernels")
    if wanted is False or (wanted is None and not supported):
        enabled = False
    elif not supported:
        raise ValueError(f"{type(model).__name__} has no fused-kernel path")
    else:
        enabled = fused_kernels_available(device)
        if wanted and not enabled:
            raise ValueError(
                f"fused kernels requested but unavailable on {device} (they need CUDA and triton)"
            )
    if supported:
        model.fused_kernels = enabled
    return enabled


def resolve_max_model_len(requested: int | None, loaded: LoadedModel) -> int:
    """``requested`` (``--max-model-len``) or the model config's context length
    (``ModelArchConfig.max_context_len``); the tokenizer's ``model_max_length`` plays no part.
    Raises ValueError when the model's rotary table does not cover it (every position a step
    may hold is checked against ``max_model_len``, so the table bounds every gather)."""
    derived = loaded.arch.max_context_len
    max_len = requested or derived
    if max_len < 1:
        raise ValueError(f"max_model_len must be >= 1, got {max_len}")
    if requested and requested > derived:
        logger.warning(
            "max_model_len %d exceeds the model's context length %d (config.json); positions past "
            "it were never trained",
            requested,
            derived,
        )
    table = getattr(getattr(loaded.model, "_rotary", None), "max_positions", None)
    if table is not None and table < max_len:
        raise ValueError(
            f"the model's rotary table holds {table} positions, fewer than max_model_len {max_len}"
        )
    return max_len
