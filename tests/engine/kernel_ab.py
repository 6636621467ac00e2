"""An engine's greedy tokens with a CPU kernel on and off (its ``KVTIER_CPU_*`` switch), and
how often the kernel ran in each: the shared body of the C kernels' engine tests."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest

from engine import LLM, SamplingParams


def greedy_on_and_off(
    monkeypatch: pytest.MonkeyPatch,
    module: ModuleType,
    function: str,
    env: str,
    model_dir: str,
    prompts: list[list[int]],
    params: SamplingParams,
    **llm_kwargs: Any,
) -> tuple[list[list[list[int]]], list[int]]:
    """``module.function`` counted; one CPU float32 engine with ``env=1``, one with ``env=0``.
    Returns (each engine's token ids per prompt, each engine's calls of the kernel)."""
    calls: list[int] = []
    kernel = getattr(module, function)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(module, function, counted)
    runs, used = [], []
    for flag in ("1", "0"):
        monkeypatch.setenv(env, flag)
        calls.clear()
        with LLM(model_dir, device="cpu", dtype="float32", **llm_kwargs) as llm:
            runs.append([list(o.token_ids) for o in llm.generate(prompts, params)])
        used.append(len(calls))
    return runs, used
