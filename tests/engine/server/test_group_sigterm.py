"""A supervisor's SIGTERM to the whole process group of ``kvtier serve`` (systemd's default
``KillMode=control-group``, ``kill -TERM -PGID``) reaches the engine core too: the core must
outlive it, stop on the API process's ``Shutdown`` and drain the KV offload (a write-back LMDB
under the host tier gets the host blocks only then), and the exit code says whether it did.

``kvtier serve`` runs a tiny random model on CPU in its own session (so its own process
group), with a 256 MiB host tier over a write-back LMDB (``decision: load``); the restart is an
``LLM`` in this process over the same LMDB, whose ``kv_stats`` count the loaded tokens.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine import SamplingParams
from tests.connectors.offload.test_connector import make_llm
from tests.engine.hf_models import make_tiny_model
from tests.servers import free_port, python_env, wait_until_healthy

ROOT = Path(__file__).resolve().parents[3]
rng = random.Random(27)
PROMPTS = [[rng.randrange(3, 500) for _ in range(n)] for n in (90, 121, 147)]
LOADABLE_TOKENS = sum(len(p) // 16 * 16 for p in PROMPTS)  # full blocks: 336 tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("group_sigterm"), "llama", seed=27)


def offload_config(lmdb: Path, drain_timeout_s: float = 5.0) -> dict[str, Any]:
    return {
        "decision": "load",
        "calibrate": False,
        "drain_timeout_s": drain_timeout_s,
        "tiers": [
            {"kind": "host", "capacity": "256MiB"},
            {"kind": "lmdb", "path": str(lmdb), "capacity": "64MiB", "write_policy": "write_back"},
        ],
    }


def start_serve(
    model_dir: str, tmp_path: Path, config: dict[str, Any], *extra: str
) -> tuple[subprocess.Popen[str], str]:
    """``kvtier serve`` in a new session (its own process group), up and healthy; stderr piped.
    ``extra``: more flags (a flag given twice: the last wins)."""
    (tmp_path / "offload.json").write_text(json.dumps(config))
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "engine.cli",
        "serve",
        "--model",
        model_dir,
        "--port",
        str(port),
        "--served-model-name",
        "tiny",
        "--device",
        "cpu",
        "--num-gpu-blocks",
        "16",
        "--dtype",
        "float32",
        "--log-level",
        "info",
        "--engine-num-threads",
        "1",
        "--kv-offload",
        "--kv-offload-config",
        str(tmp_path / "offload.json"),
        *extra,
    ]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=python_env(), stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(base, proc, 90)
    except BaseException:
        stop_group(proc, signal.SIGKILL)
        raise
    return proc, base


def complete(base: str, prompts: list[list[int]]) -> None:
    for prompt in prompts:
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": 4,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        reply = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text


def stop_group(proc: subprocess.Popen[str], sig: int, timeout_s: float = 60) -> tuple[int, str]:
    """``sig`` to the whole process group, as a supervisor sends it; (exit code, stderr)."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    try:
        _, err = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, err


def engine_core_pid(pid: int) -> int:
    """The one child of ``pid`` that multiprocessing spawned (the engine core)."""
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            return int(child)
    raise AssertionError("no engine core child")


def loaded_after_restart(model_dir: str, lmdb: Path) -> dict[str, Any]:
    """kv_stats of a fresh engine over ``lmdb`` (a restart) after it ran every prompt."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with make_llm(model_dir, 16, offload_config(lmdb)) as llm:
        for prompt in PROMPTS:
            llm.generate([prompt], params)
        return llm.kv_stats()


def test_group_sigterm_drains_the_host_tier_and_a_restart_loads_it(
    model_dir: str, tmp_path: Path
) -> None:
    steps = tmp_path / "steps.jsonl"
    proc, base = start_serve(
        model_dir,
        tmp_path,
        offload_config(tmp_path / "lmdb"),
        "--vllm-metric-names",
        "--step-log",
        str(steps),
    )
    complete(base, PROMPTS)
    # --vllm-metric-names: a router written for vLLM finds its gauges and counters
    metrics = httpx.get(f"{base}/metrics").text
    assert 'vllm:num_requests_running{model_name="tiny"} 0.0' in metrics, metrics
    done = (
        f'vllm:request_success_total{{finished_reason="length",model_name="tiny"}} {len(PROMPTS)}'
    )
    assert done in metrics, metrics
    time.sleep(0.5)  # let the idle core save the last blocks (it does so at once anyway)
    code, err = stop_group(proc, signal.SIGTERM)
    assert code == 0, err
    assert "KV drain complete" in err, err
    assert "engine is not running" not in err and "leaked" not in err, err
    # --step-log: every prompt's chunks are in the engine's step log, flushed at exit
    lines = [json.loads(line) for line in steps.read_text().splitlines()]
    assert sum(c[1] for line in lines for c in line["prefill"]) == sum(len(p) for p in PROMPTS)
    assert sum(line["decodes"] for line in lines) == len(PROMPTS) * 3  # 4 tokens, 1 from prefill
    kv = loaded_after_restart(model_dir, tmp_path / "lmdb")
    assert kv["loaded_tokens"] >= 0.9 * LOADABLE_TOKENS, kv
    assert kv["failed_loads"] == 0


def test_exit_code_is_non_zero_when_the_core_died_first(model_dir: str, tmp_path: Path) -> None:
    proc, base = start_serve(model_dir, tmp_path, offload_config(tmp_path / "lmdb"))
    complete(base, PROMPTS[:1])
    os.kill(engine_core_pid(proc.pid), signal.SIGKILL)
    code, err = stop_group(proc, signal.SIGTERM)
    assert code == 1, err
    # The SIGTERM may reach the API before its output thread saw the core die: either way the
    # last line says the KV offload was not drained.
    assert "engine core process died" in err or "killed by signal 9" in err, err
    assert "exiting:" in err.splitlines()[-1], err


def test_exit_code_is_non_zero_when_the_drain_left_blocks_behind(
    model_dir: str, tmp_path: Path
) -> None:
    """``drain_timeout_s: 0``: no time to flush the host-only blocks down, so they are lost; the
    log says how many and ``kvtier serve`` exits 1."""
    config = offload_config(tmp_path / "lmdb", drain_timeout_s=0.0)
    proc, base = start_serve(model_dir, tmp_path, config)
    complete(base, PROMPTS)
    code, err = stop_group(proc, signal.SIGTERM)
    assert code == 1, err
    assert "KV drain incomplete" in err and "host-only blocks not flushed" in err, err


def test_sigusr1_dumps_every_threads_stack_and_the_server_goes_on(
    model_dir: str, tmp_path: Path
) -> None:
    """``kill -USR1 -PGID``: the API process and the engine core each write their threads'
    stacks to stderr (the core's step loop among them) and keep serving."""
    proc, base = start_serve(model_dir, tmp_path, offload_config(tmp_path / "lmdb"))
    complete(base, PROMPTS[:1])
    core = engine_core_pid(proc.pid)
    os.kill(proc.pid, signal.SIGUSR1)
    os.kill(core, signal.SIGUSR1)
    time.sleep(0.5)
    complete(base, PROMPTS[1:])  # both still serve
    assert proc.poll() is None
    code, err = stop_group(proc, signal.SIGTERM)
    assert code == 0, err
    # one "Current thread" header per dumping process: the API's and the core's
    assert err.count("Current thread 0x") + err.count("Thread 0x") >= 2, err
    assert "engine/core/proc.py" in err, err  # the core's stack: its step loop
    assert "uvicorn" in err, err  # the API process's
