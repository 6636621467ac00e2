"""Load a Hugging Face model directory (config.json + *.safetensors, single or sharded) into
the plain-torch models of ``engine/models``, and fingerprint it for the cache key namespace.

No HF modeling code runs here: only ``config.json`` and safetensors files are read.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from engine.models import ModelArchConfig, get_model_class

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: torch.nn.Module  # implements engine.models.base.CausalLM
    arch: ModelArchConfig
    dtype: torch.dtype
    hf_config: dict


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


def resolve_dtype(dtype: str, hf_config: dict) -> torch.dtype:
    """``auto`` -> the config's ``dtype``/``torch_dtype`` (float32 if absent); else the name."""
    if dtype == "auto":
        name = hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32"
        if name not in _DTYPES:
            raise ValueError(f"config.json dtype {name!r} not supported; pass an explicit dtype")
        return _DTYPES[name]
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be auto or one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def safetensors_files(model_dir: str) -> list[str]:
    """The weight files in load order: the index's shards if sharded, else every *.safetensors."""
    index = os.path.join(model_dir, _INDEX_FILE)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, s) for s in shards]
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in model directory {model_dir!r}")
    return [os.path.join(model_dir, f) for f in files]


def iter_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, cpu tensor)`` for every tensor of every shard, one at a time."""
    from safetensors import safe_open

    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_model(
    model_dir: str, dtype: str, device: torch.device | str, max_positions: int | None = None
) -> LoadedModel:
    """Build the model on ``device`` in the resolved dtype and fill every parameter from the
    checkpoint. Raises ValueError if the checkpoint misses a parameter or has an extra one."""
    hf_config = read_hf_config(model_dir)
    arch = ModelArchConfig.from_hf(hf_config)
    torch_dtype = resolve_dtype(dtype, hf_config)
    cls = get_model_class(arch.architecture)
    # Build without allocating or initializing, then materialize once on the target device.
    with torch.device("meta"):
        model = cls(arch, max_positions)
    model = model.to(dtype=torch_dtype).to_empty(device=device)
    loaded = model.load_weights(iter_weights(model_dir))
    missing = sorted(set(dict(model.named_parameters())) - loaded)
    if missing:
        raise ValueError(f"checkpoint in {model_dir!r} lacks parameters: {missing[:8]}")
    return LoadedModel(model=model.eval(), arch=arch, dtype=torch_dtype, hf_config=hf_config)


def _safetensors_header(path: str) -> bytes:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return f.read(n)


def model_fingerprint(model_dir: str, dtype: str | torch.dtype) -> str:
    """A stable identity of (architecture, config, weight layout, dtype) for cache keys.

    Hashes config.json (canonical JSON) and every safetensors header (names, shapes, dtypes,
    byte offsets), not the tensor bytes, so it is cheap even for large models. Identical
    across processes and machines. Returns ``"<Architecture>-<32 hex chars>"``."""
    hf_config = read_hf_config(model_dir)
    if isinstance(dtype, str):
        dtype = resolve_dtype(dtype, hf_config)
    arch = (hf_config.get("architectures") or ["unknown"])[0]
    h = hashlib.sha256()
    h.update(arch.encode())
    h.update(json.dumps(hf_config, sort_keys=True, separators=(",", ":")).encode())
    for path in safetensors_files(model_dir):
        h.update(os.path.basename(path).encode())
        h.update(_safetensors_header(path))
    h.update(str(dtype).encode())
    return f"{arch}-{h.hexdigest()[:32]}"
