"""The engine's connector registry: a name resolves to its class only when asked, and the
engine's own import of the socket pulls in no connector."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.kv_connector import create_kv_connector, kv_connector_class, kv_connector_names


def test_offload_resolves_to_the_offload_connector():
    from connectors.offload.connector import OffloadConnector

    assert "offload" in kv_connector_names()
    assert kv_connector_class("offload") is OffloadConnector


def test_unknown_name_is_one_clear_error():
    with pytest.raises(ValueError, match=r"unknown KV connector 'nope'; choose from \['offload'"):
        kv_connector_class("nope")
    with pytest.raises(ValueError, match="unknown KV connector 'nope'"):
        create_kv_connector("nope", None, None, None)  # type: ignore[arg-type]


def test_importing_the_engine_side_loads_no_connector():
    code = (
        "import sys, engine.kv_connector, engine.sched.scheduler, engine.llm_engine; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'connectors'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"
