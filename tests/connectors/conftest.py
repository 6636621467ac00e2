"""Fixtures shared by the connector tests: one torch thread (the tiny models run faster without
intra-op threads on a shared CPU, and timings stay steadier) and one tiny random-weight Llama,
built once per session (same seed, same weights for every test that uses it)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Every connector test module runs with one torch thread (tests/conftest.py)."""


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tests.engine.hf_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models"), "llama", seed=3)
