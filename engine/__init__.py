"""The kvtier serving engine. ``from engine import LLM, SamplingParams`` for offline use.

Exports resolve lazily so that importing a light submodule (``engine.cli`` for ``kvtier
analyze``) never pulls in torch or transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.llm import LLM
    from engine.outputs import RequestOutput
    from engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "EngineConfig"]

_EXPORTS = {
    "LLM": "engine.llm",
    "SamplingParams": "engine.sampling_params",
    "RequestOutput": "engine.outputs",
    "EngineConfig": "engine.config",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
