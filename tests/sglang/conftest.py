"""The SGLang tests run only where SGLang is installed (``make test-sglang``: .venv-sglang with
``sglang`` installed without its CUDA dependencies); elsewhere (the main venv, ``make test``)
this directory is not collected."""

from __future__ import annotations

import importlib.util

collect_ignore_glob: list[str] = []
if importlib.util.find_spec("sglang") is None:
    collect_ignore_glob = ["test_*.py"]  # `make test-sglang` runs these
