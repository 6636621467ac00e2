"""Load a Hugging Face model directory (config.json + *.safetensors, single or sharded) into
the plain-torch models of ``engine/models``, and fingerprint it for the cache key namespace.

No HF modeling code runs here: only ``config.json`` and safetensors files are read. Loading
reports progress (``WeightProgress``): a tqdm bar on a terminal's stderr, else one INFO line
per weight file and a closing line with the time taken.

The model is built on the meta device with ``torch.nn.init`` switched off (``_no_init``): every
parameter comes from the checkpoint, and initialising meta tensors would run torch's reference
implementations, whose first call imports ``torch._dynamo`` and with it Triton, which on a
CPU-only run leaks its nanobind objects at exit (~30 lines of ``nanobind: leaked ...``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import struct
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from engine.models import ModelArchConfig, get_model_class
from engine.models.hf_files import DTYPE_NAMES, dtype_name, read_hf_config, safetensors_files
from engine.models.parallel import TPShard
from tiers.sizes import approx_size

logger = logging.getLogger(__name__)
_DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: torch.nn.Module  # implements engine.models.base.CausalLM
    arch: ModelArchConfig
    dtype: torch.dtype
    hf_config: dict


def resolve_dtype(dtype: str, hf_config: dict) -> torch.dtype:
    """``auto`` -> the config's ``dtype``/``torch_dtype`` (float32 if absent); else the name."""
    return _DTYPES[dtype_name(dtype, hf_config)]


def iter_weights(
    model_dir: str, progress: WeightProgress | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, cpu tensor)`` for every tensor of every shard, one at a time;
    ``progress`` hears of each tensor and each finished file."""
    from safetensors import safe_open

    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                if progress is not None:
                    progress.tensor(tensor.numel() * tensor.element_size())
                yield name, tensor
        if progress is not None:
            progress.file_done(path)


class WeightProgress:
    """Progress of one weight load over ``files``: a tqdm bar of bytes on ``stream`` (default
    stderr) when it is a terminal, else INFO log lines: one at the start, one per finished
    file when there are several, and ``done``'s summary. Not thread-safe (the loading thread
    only)."""

    def __init__(self, files: list[str], stream: Any = None) -> None:
        self._files = files
        self._total = sum(os.path.getsize(f) for f in files)
        self._done_files = 0
        self._bytes = 0
        self._t0 = time.perf_counter()
        stream = sys.stderr if stream is None else stream
        self._bar = None
        if getattr(stream, "isatty", lambda: False)():
            from tqdm import tqdm

            self._bar = tqdm(
                total=self._total,
                unit="B",
                unit_scale=True,
                file=stream,
                desc="loading weights",
                leave=False,
            )
        elif files:
            logger.info(
                "loading weights from %s: %d file(s), %s",
                os.path.dirname(files[0]),
                len(files),
                approx_size(self._total),
            )

    def tensor(self, nbytes: int) -> None:
        self._bytes += nbytes
        if self._bar is not None:
            self._bar.update(nbytes)

    def file_done(self, path: str) -> None:
        self._done_files += 1
        if self._bar is None and len(self._files) > 1:
            logger.info(
                "loading weights: file %d/%d %s done (%s of %s, %.1f s)",
                self._done_files,
                len(self._files),
                os.path.basename(path),
                approx_size(self._bytes),
                approx_size(self._total),
                time.perf_counter() - self._t0,
            )

    def done(self) -> None:
        if self._bar is not None:
            self._bar.close()
        logger.info(
            "loaded %s of weights from %d file(s) in %.1f s",
            approx_size(self._bytes),
            len(self._files),
            time.perf_counter() - self._t0,
        )


_INIT_LOCK = threading.Lock()


@contextlib.contextmanager
def _no_init() -> Iterator[None]:
    """``torch.nn.init``'s in-place initialisers as no-ops (the module docstring says why).
    They are module attributes looked up at each call, so this reaches every layer; the lock
    keeps two loads in one process from restoring each other's patches."""
    import torch.nn.init as init

    names = [
        n
        for n in dir(init)
        if n.endswith("_") and not n.startswith("_") and callable(getattr(init, n))
    ]
    with _INIT_LOCK:
        saved = {n: getattr(init, n) for n in names}
        try:
            for n in names:
                setattr(init, n, _keep)
            yield
        finally:
            for n, fn in saved.items():
                setattr(init, n, fn)


def _keep(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return tensor


def load_model(
    model_dir: str,
    dtype: str,
    device: torch.device | str,
    max_positions: int | None = None,
    tp: TPShard | None = None,
) -> LoadedModel:
    """Build the model on ``device`` in the resolved dtype and fill every parameter from the
    checkpoint. Raises ValueError for an unsupported architecture (naming the supported
    ones) or if the checkpoint misses a parameter or has an extra one. ``tp`` (size > 1):
    this rank's slice of every split weight (``engine.models.parallel``); ``arch`` of the
    result is then the rank's (its heads and intermediate size divided)."""
    hf_config = read_hf_config(model_dir)
    # The architecture first (one line listing the supported ones): another family's config
    # may lack fields ModelArchConfig reads.
    cls = get_model_class((hf_config.get("architectures") or ["(none in config.json)"])[0])
    arch = ModelArchConfig.from_hf(hf_config)
    torch_dtype = resolve_dtype(dtype, hf_config)
    # Build without allocating or initializing, then materialize once on the target device.
    with _no_init(), torch.device("meta"):
        model = (
            cls(arch, max_positions) if tp is None or tp.size == 1 else cls(arch, max_positions, tp)
        )
    model = model.to(dtype=torch_dtype).to_empty(device=device)
    progress = WeightProgress(safetensors_files(model_dir))
    loaded = model.load_weights(iter_weights(model_dir, progress))
    progress.done()
    missing = sorted(set(dict(model.named_parameters())) - loaded)
    if missing:
        raise ValueError(f"checkpoint in {model_dir!r} lacks parameters: {missing[:8]}")
    return LoadedModel(
        model=model.eval(),
        arch=getattr(model, "arch", arch),
        dtype=torch_dtype,
        hf_config=hf_config,
    )


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
