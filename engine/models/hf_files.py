"""What an HF model directory says about itself, read without torch: ``config.json``, the dtype
it asks for, its safetensors shards. The API process checks a model with these before the
engine core loads it (``engine.server.startup``), and importing torch there cost ~2 s of every
start; ``engine.models.loader`` builds on them.
"""

from __future__ import annotations

import json
import os

DTYPE_NAMES = ("float32", "float16", "bfloat16")
INDEX_FILE = "model.safetensors.index.json"


def read_hf_config(model_dir: str) -> dict:
    """Parse ``model_dir/config.json``. Raises FileNotFoundError / ValueError with the path."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in model directory {model_dir!r}")
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: invalid JSON ({e})") from e


def dtype_name(dtype: str, hf_config: dict) -> str:
    """``auto`` -> the config's ``dtype``/``torch_dtype`` (float32 if absent); else the name.
    Raises ValueError for a dtype not in ``DTYPE_NAMES``."""
    if dtype == "auto":
        name = hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32"
        if name not in DTYPE_NAMES:
            raise ValueError(f"config.json dtype {name!r} not supported; pass an explicit dtype")
        return str(name)
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be auto or one of {sorted(DTYPE_NAMES)}, got {dtype!r}")
    return dtype


def safetensors_files(model_dir: str) -> list[str]:
    """The weight files in load order: the index's shards if sharded, else every *.safetensors."""
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, s) for s in shards]
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in model directory {model_dir!r}")
    return [os.path.join(model_dir, f) for f in files]
