"""bench/offload's random-weight loader stands in for ``engine.models.loader.load_model``: it
must take every argument the runner passes (a changed signature broke the H200 TTFT run while
every CPU test passed)."""

from __future__ import annotations

import inspect

import pytest

import engine.models.loader as ml
import engine.runner.model_runner as mr
from bench.offload.parts import _install_random_loader


def test_the_wrapper_takes_the_loaders_parameters(monkeypatch: pytest.MonkeyPatch) -> None:
    real = ml.load_model
    monkeypatch.setattr(ml, "load_model", real)  # restored after the test
    monkeypatch.setattr(mr, "load_model", mr.load_model)
    _install_random_loader()
    wrapper = ml.load_model
    assert wrapper is not real and mr.load_model is wrapper
    assert list(inspect.signature(wrapper).parameters) == list(inspect.signature(real).parameters)
