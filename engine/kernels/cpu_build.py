"""Small C kernels for the CPU, compiled on first use with the system's C compiler.

A kernel's source is compiled into the user's cache (``~/.cache/kvtier/cpu_kernels``, keyed by
the source and the flags) and loaded with ctypes: no build step, no Python headers. Flags
follow torch's CPU capability (AVX-512, AVX2 or the baseline). Where no compiler runs, or it
fails, ``CKernel.function()`` is False and the caller keeps its torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence

import torch

from engine.cache_dir import default_cache_dir

log = logging.getLogger(__name__)

_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512vl", "-mavx2", "-mfma"],
    "AVX2": ["-mavx2", "-mfma"],
}


def cache_dir() -> str:
    """``cpu_kernels`` under kvtier's one cache directory (``engine.cache_dir``: converted
    models and the default LMDB tier are there too)."""
    return str(default_cache_dir() / "cpu_kernels")


class CKernel:
    """One C function from one source, built once a process (thread-safe), cached on disk.
    ``env``: the variable that turns it off (``=0``), so the torch path can be compared."""

    def __init__(
        self, name: str, source: str, symbol: str, argtypes: Sequence[object], env: str
    ) -> None:
        self.name, self.source, self.symbol, self.argtypes, self.env = (
            name,
            source,
            symbol,
            list(argtypes),
            env,
        )
        self._lock = threading.Lock()
        self._fn: object = None  # the loaded function, or False once building it failed
        self._lib: ctypes.CDLL | None = None
        self._symbols: dict[str, object] = {}  # symbol_of's typed functions

    def _build(self) -> object:
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            log.info("no C compiler: %s stays in torch", self.name)
            return False
        # -ffast-math: the dot products vectorized (sums in another order); the kernels never
        # compare against infinities (they start maxima from a score or a large negative)
        flags = ["-O3", "-ffast-math", "-shared", "-fPIC"]
        flags += _FLAGS.get(torch.backends.cpu.get_cpu_capability(), [])
        digest = hashlib.sha256((self.source + " ".join(flags)).encode()).hexdigest()[:16]
        path = os.path.join(cache_dir(), f"{self.name}-{digest}.so")
        try:
            if not os.path.exists(path):
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with tempfile.TemporaryDirectory() as tmp:
                    src = os.path.join(tmp, f"{self.name}.c")
                    with open(src, "w", encoding="utf-8") as f:
                        f.write(self.source)
                    built = os.path.join(tmp, "out.so")
                    subprocess.run(
                        [cc, *flags, src, "-o", built, "-lm"],
                        check=True,
                        capture_output=True,
                        timeout=120,
                    )
                    os.replace(built, path)  # atomic: a concurrent builder never loads half
            self._lib = ctypes.CDLL(path)
        except (OSError, subprocess.SubprocessError) as exc:
            log.info("%s stays in torch: building it failed (%s)", self.name, exc)
            return False
        fn = getattr(self._lib, self.symbol)
        fn.argtypes = self.argtypes
        fn.restype = None
        return fn

    def function(self) -> object:
        """The loaded function (built on the first call), or False where it cannot be."""
        if self._fn is None:
            with self._lock:
                if self._fn is None:
                    self._fn = self._build()
        return self._fn

    def symbol_of(self, symbol: str, argtypes: Sequence[object], restype: object) -> object:
        """Another function of the same library (None where the library is not built),
        looked up and typed once (callers may ask on every call)."""
        fn = self._symbols.get(symbol)
        if fn is not None:
            return fn
        if not self.function() or self._lib is None:
            return None
        fn = getattr(self._lib, symbol)
        fn.argtypes, fn.restype = list(argtypes), restype
        self._symbols[symbol] = fn
        return fn

    def available(self) -> bool:
        """Whether the kernel is built (or can be) here; builds it on the first call."""
        return bool(self.function())

    def enabled(self) -> bool:
        """Built here, and not turned off with ``<env>=0``."""
        return os.environ.get(self.env, "1") != "0" and self.available()
