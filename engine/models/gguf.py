"""GGUF checkpoints: converted once into a plain HF directory in the cache, then loaded as any.

``ensure_converted(path, dtype=...)`` returns ``<cache>/gguf/<sha256 prefix>-v<N>[-<dtype>]``
(no suffix for float32): a directory with config.json, model.safetensors (dequantized by
transformers' GGUF reader to the serving dtype: a bfloat16 server keeps 2 bytes a weight, not
4),
generation_config.json and the tokenizer files (chat template included). The directory is
named by the sha256 of the GGUF's bytes, so the same file under another name or path reuses
it and a changed file never does. A marker file (``kvtier-gguf.json``) is written last; a
directory without it is a half-written one and is built again. The GGUF's sha256 is also
stored in the safetensors header's metadata, so ``model_loader.model_fingerprint`` (which
hashes safetensors headers) differs for different GGUF files of one architecture.

Safe under concurrent first use: one process converts under an exclusive file lock while
the others wait, and a conversion builds in a private temporary directory renamed into
place. Needs the ``gguf`` and ``accelerate`` packages (``pip install 'kvtier[gguf]'``).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from engine.cache_dir import default_cache_dir

GGUF_SUBDIR = "gguf"
MARKER_FILE = "kvtier-gguf.json"
# Bump when the converted layout changes, so that old conversions are not reused.
CONVERTER_VERSION = 1
GGUF_MAGIC = b"GGUF"
_HASH_CHUNK_BYTES = 8 << 20
_DTYPES = ("float32", "float16", "bfloat16")
_INSTALL_HINT = "pip install 'kvtier[gguf]' (the gguf and accelerate packages)"


def is_gguf_path(model: str) -> bool:
    """True for a path naming a ``.gguf`` file (existing or not): the resolver's switch."""
    return model.lower().endswith(".gguf") and not os.path.isdir(model)


def check_gguf_dependencies() -> None:
    """Raises ImportError with a one-line install hint if ``gguf`` or ``accelerate`` is
    missing (transformers 5 needs both to read a GGUF file)."""
    import importlib.util

    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(f"reading a GGUF file needs {' and '.join(missing)}: {_INSTALL_HINT}")


def file_sha256(path: str) -> str:
    """Hex sha256 of the file's bytes (reads it once, in 8 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def _cached_sha256(path: str, root: Path) -> str:
    """``file_sha256`` memoized by (real path, size, mtime) under ``root/index``, so that a
    second start of a multi-GB model does not read it whole again. A stale or unreadable
    memo is just recomputed."""
    st = os.stat(path)
    key = f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}"
    memo = root / "index" / (hashlib.sha256(key.encode()).hexdigest()[:32] + ".json")
    try:
        entry = json.loads(memo.read_text(encoding="utf-8"))
        if entry.get("key") == key:
            return str(entry["sha256"])
    except (OSError, ValueError, KeyError):
        pass
    digest = file_sha256(path)
    memo.parent.mkdir(parents=True, exist_ok=True)
    tmp = memo.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"key": key, "sha256": digest}), encoding="utf-8")
    os.replace(tmp, memo)
    return digest


def read_marker(model_dir: str) -> dict | None:
    """The conversion marker of ``model_dir`` (source name, sha256, versions), or None when
    the directory is not a complete conversion."""
    try:
        with open(os.path.join(model_dir, MARKER_FILE), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def converted_name(digest: str, dtype: str) -> str:
    """The cache directory name of the GGUF with sha256 ``digest`` dequantized to ``dtype``."""
    suffix = "" if dtype == "float32" else f"-{dtype}"
    return f"{digest[:32]}-v{CONVERTER_VERSION}{suffix}"


def ensure_converted(gguf_path: str, cache_dir: str | None = None, dtype: str = "float32") -> str:
    """The HF directory converted from ``gguf_path`` with weights in ``dtype`` (float32,
    float16 or bfloat16), converting first if the cache lacks a complete one (a log line on
    stderr and transformers' progress bar; ~1 min for a 100 MB file on 2 cores). Raises
    FileNotFoundError (no such file), ValueError (not a GGUF file, one transformers cannot
    read, or a bad dtype), ImportError (gguf/accelerate missing)."""
    if dtype not in _DTYPES:
        raise ValueError(f"a GGUF is dequantized to one of {', '.join(_DTYPES)}, not {dtype!r}")
    if not os.path.isfile(gguf_path):
        raise FileNotFoundError(f"GGUF file not found: {gguf_path!r}")
    with open(gguf_path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ValueError(f"{gguf_path!r} is not a GGUF file (no GGUF magic)")
    root = Path(cache_dir or default_cache_dir()) / GGUF_SUBDIR
    root.mkdir(parents=True, exist_ok=True)
    digest = _cached_sha256(gguf_path, root)
    final = root / converted_name(digest, dtype)
    if read_marker(str(final)) is not None:
        return str(final)
    check_gguf_dependencies()
    with open(root / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if read_marker(str(final)) is not None:
            return str(final)  # another process converted it while this one waited
        if final.exists():
            shutil.rmtree(final)  # half-written (no marker): redo
        size_mb = os.path.getsize(gguf_path) / 1e6
        print(
            f"kvtier: converting {os.path.basename(gguf_path)} ({size_mb:.0f} MB) to a "
            f"{dtype} HF directory in {final} (once; later starts reuse it)",
            file=sys.stderr,
            flush=True,
        )
        start = time.perf_counter()
        tmp = tempfile.mkdtemp(prefix=f".{final.name}-", dir=root)
        try:
            convert_gguf(gguf_path, tmp, digest, dtype)
            os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide a shared cache from other users
            os.rename(tmp, final)
        finally:
            if os.path.isdir(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
        print(
            f"kvtier: converted in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True
        )
    return str(final)


def convert_gguf(gguf_path: str, out_dir: str, sha256: str, dtype: str = "float32") -> None:
    """Write the HF directory of ``gguf_path`` into the existing empty ``out_dir``, marker
    last, weights and config in ``dtype``. transformers dequantizes the GGUF; its
    GGUF-loaded model refuses ``save_pretrained``, so the state dict and config are written
    directly (tied weights once, as HF does). Raises ValueError if transformers cannot read the file."""
    import torch
    import transformers
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, dtype)
    src_dir, name = os.path.split(os.path.abspath(gguf_path))
    try:
        tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch_dtype)
    except ImportError:
        raise
    except Exception as exc:  # the GGUF parser's errors on a bad file are of any type
        raise ValueError(f"transformers cannot read GGUF {gguf_path!r}: {exc}") from exc
    config = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "transformers_version"):
        config.pop(key, None)
    config["architectures"] = [type(model).__name__]  # the GGUF config leaves it null
    config["dtype"] = dtype
    state = model.state_dict()
    embed = state.get("model.embed_tokens.weight")
    head = state.get("lm_head.weight")
    if config.get("tie_word_embeddings") and embed is not None and head is not None:
        del state["lm_head.weight"]  # the same tensor; safetensors stores a tensor once
    tensors = {k: v.detach().to(torch_dtype).contiguous() for k, v in state.items()}
    save_file(
        tensors,
        os.path.join(out_dir, "model.safetensors"),
        metadata={"format": "pt", "kvtier_gguf_sha256": sha256},
    )
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    marker = {
        "source": os.path.basename(gguf_path),
        "gguf_sha256": sha256,
        "converter_version": CONVERTER_VERSION,
        "dtype": dtype,
        "transformers_version": transformers.__version__,
    }
    with open(os.path.join(out_dir, MARKER_FILE), "w", encoding="utf-8") as f:
        json.dump(marker, f, indent=2, sort_keys=True)
