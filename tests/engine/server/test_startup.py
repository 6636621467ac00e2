"""``kvtier serve`` start-up as a user meets it: every file a flag names is checked before the
model loads (``engine.server.startup.preflight``), each problem one line naming the flag or the
file (YAML: the file and the line), exit code 2; an engine core that fails to start is one line
and exit code 1, its traceback only with ``--log-level debug``; a good start logs one block with
the model, the KV budget and the tier stack (plain ``--kv-offload``: where its LMDB lives)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.models.sources import find_packaged_gguf
from engine.server.startup import UsageError, one_line, preflight
from tests.engine.hf_models import make_tiny_model
from tests.servers import python_env, wait_until_healthy

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("startup"), "llama", seed=4)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve(
    *argv: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable,
        "-m",
        "engine.cli",
        "serve",
        "--port",
        str(_free_port()),
        "--device",
        "cpu",
        *argv,
    ]
    return subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=python_env(**(env or {})),
    )


def _error_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if " ERROR " in ln or ln.startswith("kvtier serve:")]


def test_the_api_process_checks_the_model_and_loads_its_tokenizer_without_torch(
    model_dir: str,
) -> None:
    """What `kvtier serve`'s API process does before it answers: the preflight (device, model
    files, dtype) and the tokenizer, with the default device and an explicit cpu, import no
    torch (it was ~4 of the process's ~6.6 CPU s at start; the engine core imports it)."""
    code = (
        "import sys; from engine.config import EngineConfig; "
        "from engine.server.startup import preflight; from engine.tokenizer import load_tokenizer; "
        "import engine.server.api; "
        f"info = preflight(EngineConfig(model={model_dir!r})).model_info; "
        f"preflight(EngineConfig(model={model_dir!r}, device='cpu')); "
        f"assert load_tokenizer({model_dir!r}).encode('hi'); "
        "print(info['dtype'], 'torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env=python_env(),
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["float32", "False"]


def test_preflight_names_the_flag_or_the_file(model_dir: str, tmp_path: Path) -> None:
    def refused(config: EngineConfig, chat_template: str | None = None) -> str:
        with pytest.raises(UsageError) as info:
            preflight(config, chat_template)
        message = str(info.value)
        assert "\n" not in message
        return message

    checked = preflight(EngineConfig(model=model_dir), "{{ messages[0]['content'] }}")
    assert checked.chat_template == "{{ messages[0]['content'] }}"
    assert checked.model_info == {
        "path": model_dir,
        "architecture": "LlamaForCausalLM",
        "dtype": "float32",
        "layers": 2,
    }
    missing = str(tmp_path / "absent")
    assert refused(EngineConfig(model=missing)).startswith(f"model {missing}: no such directory")
    assert "no such GGUF file" in refused(EngineConfig(model=str(tmp_path / "m.gguf")))
    weightless = tmp_path / "weightless"
    weightless.mkdir()
    (weightless / "config.json").write_text(Path(model_dir, "config.json").read_text())
    assert "no *.safetensors" in refused(EngineConfig(model=str(weightless)))
    odd = tmp_path / "odd"
    odd.mkdir()
    assert refused(EngineConfig(model=str(odd))) == (
        f"model {odd}: no config.json in model directory {str(odd)!r}"
    )
    (odd / "model.safetensors").write_bytes(Path(model_dir, "model.safetensors").read_bytes())
    (odd / "config.json").write_text(
        json.dumps({**json.loads(Path(model_dir, "config.json").read_text()), "dtype": "int4"})
    )
    assert refused(EngineConfig(model=str(odd))).startswith(
        "--dtype auto: config.json dtype 'int4'"
    )
    assert refused(EngineConfig(model=model_dir, tokenizer=missing)) == (
        f"--tokenizer {missing}: no such directory"
    )
    assert refused(EngineConfig(model=model_dir), "{% if %}").startswith("--chat-template: line 1:")
    assert refused(EngineConfig(model=model_dir, device="tpu")).startswith("--device tpu: ")
    bad = tmp_path / "tiers.yaml"
    bad.write_text("tiers:\n  - {kind: host, capacity: 4MiB\n")
    message = refused(EngineConfig(model=model_dir, kv_offload_config=str(bad)))
    assert re.match(rf"--kv-offload-config {bad}: line \d+, column \d+: ", message), message
    assert "<unicode string>" not in message
    bad.write_text("tiers:\n  - {kind: host, capacity: 4 parsecs}\n")
    message = refused(EngineConfig(model=model_dir, kv_offload_config=str(bad)))
    assert message.startswith(f"--kv-offload-config {bad}: tiers[0] (host): field 'capacity'")
    bad.write_text("tiers:\n  - {kind: host, capacity: 1000TiB}\n")
    message = refused(EngineConfig(model=model_dir, kv_offload_config=str(bad)))
    assert message.startswith(f"--kv-offload-config {bad}: tiers[0] (host): field 'capacity': ")
    assert "memory available" in message
    bad.write_text(
        "tiers:\n  - {kind: host, capacity: 1MiB}\n"
        "  - {kind: lmdb, path: /proc/kvtier-no/lmdb, capacity: 1MiB}\n"
    )
    message = refused(EngineConfig(model=model_dir, kv_offload_config=str(bad)))
    assert message.startswith(
        f"--kv-offload-config {bad}: tiers[1] (lmdb): field 'path': "
        "cannot use '/proc/kvtier-no/lmdb'"
    ), message
    assert one_line("a\n  b\n\nc") == "a | b | c"


def test_tokenizer_and_chat_template_flags(tmp_path: Path) -> None:
    from engine.cli import build_parser
    from engine.server.cli import engine_config_from_args

    def parse(*argv: str):
        return build_parser(["serve", *argv]).parse_args(["serve", *argv])

    args = parse("/models/m", "--tokenizer", "/models/tok", "--chat-template", "t.jinja")
    assert engine_config_from_args(args).tokenizer == "/models/tok"
    assert args.chat_template == "t.jinja"
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("tokenizer: /models/t2\nchat-template: '{{ messages }}'\n")
    args = parse("--config", str(cfg))
    assert (engine_config_from_args(args).tokenizer, args.chat_template) == (
        "/models/t2",
        "{{ messages }}",
    )


def test_several_served_model_names(tmp_path: Path) -> None:
    """``--served-model-name A B`` (vLLM's aliases) is a list, not a second model."""
    from engine.cli import build_parser

    def parse(*argv: str):
        return build_parser(["serve", *argv]).parse_args(["serve", *argv])

    args = parse("/models/m", "--served-model-name", "llama3", "meta-llama/Llama-3-8B")
    assert args.served_model_name == ["llama3", "meta-llama/Llama-3-8B"]
    cfg = tmp_path / "serve.yaml"
    for text, names in (
        ("served-model-name: [a, b]\n", ["a", "b"]),
        ("served-model-name: a\n", ["a"]),
    ):
        cfg.write_text(text)
        assert parse("--config", str(cfg)).served_model_name == names


def test_bad_yaml_in_config_is_one_line_with_the_file_and_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "serve.yaml"
    bad.write_text("port: 9000\nmodel: [a, b\n")
    result = _serve("--config", str(bad), timeout=60)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()  # no usage text before it
    assert re.match(rf"kvtier serve: error: --config {bad}: line \d+, column \d+: ", line), line
    assert "<unicode string>" not in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("prot: 9000\n", "unknown serve flag 'prot'"),
        ("config: other.yaml\n", "unknown serve flag 'config'"),
        ("- port\n", "expected a mapping of flag names to values"),
    ],
)
def test_config_file_errors_are_one_line_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, problem: str
) -> None:
    from engine.cli import main

    bad = tmp_path / "serve.yaml"
    bad.write_text(text)
    with pytest.raises(SystemExit) as info:
        main(["serve", "--port", "9001", "--config", str(bad)])
    assert info.value.code == 2
    assert capsys.readouterr().err == f"kvtier serve: error: --config {bad}: {problem}\n"


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("max-num-seqs: abc\n", "max-num-seqs: invalid int value: 'abc'"),
        ("port: 99999\n", "port: invalid port 99999: a number 1..65535"),
        ("cpu-kv-cache-bytes: 4096\n", "cpu-kv-cache-bytes: '4096' has no unit; "),
        ("max-num-seqs: [4]\n", "max-num-seqs: expected a single value, got a list"),
        ('kv-offload: "no"\n', "kv-offload: expected true or false, got 'no'"),
        (
            "served-model-name: []\n",
            "served-model-name: expected at least one value, got an empty list",
        ),
        ("served-model-name: [a, [b]]\n", "served-model-name: expected a single value, got a list"),
        ("seed: true\n", "seed: expected a single value, got a boolean (true)"),
        ("dtype: float8\n", "dtype: invalid choice: 'float8' (choose from 'auto', "),
        ("port:\n", "port: expected a value, got nothing (null)"),
    ],
)
def test_config_file_bad_values_are_one_line_naming_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, problem: str
) -> None:
    """A value goes through the flag's own check (a port's range, a size's unit, a choice), a
    switch takes only true/false, and a list is no scalar: never a traceback, never a
    truthy string turning a switch on."""
    from engine.cli import main

    bad = tmp_path / "serve.yaml"
    bad.write_text(text)
    with pytest.raises(SystemExit) as info:
        main(["serve", "--config", str(bad)])
    assert info.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"kvtier serve: error: --config {bad}: {problem}"), line


def test_config_file_values_are_converted_as_the_flags_text_is(tmp_path: Path) -> None:
    import argparse

    from engine.server.flags import add_arguments

    good = tmp_path / "serve.yaml"
    good.write_text(
        "port: 9001\nkv-offload: false\nenable-prefix-caching: false\n"
        "cpu-kv-cache-bytes: 64MiB\ngpu-memory-utilization: 0.5\nserved-model-name: 7\n"
    )
    parser = argparse.ArgumentParser(prog="kvtier serve")
    add_arguments(parser)
    args = parser.parse_args(["--config", str(good)])
    assert (args.port, args.kv_offload, args.enable_prefix_caching) == (9001, False, False)
    assert (args.cpu_kv_cache_bytes, args.gpu_memory_utilization) == (64 << 20, 0.5)
    assert args.served_model_name == ["7"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA")
def test_device_cuda_without_cuda_fails_before_any_conversion(
    model_dir: str, tmp_path: Path
) -> None:
    """The device is checked first: a GGUF is not converted into the cache (18 s and 260 MB
    for the packaged SmolLM2) only for the engine core to find no CUDA."""
    model = find_packaged_gguf() or model_dir
    cache = tmp_path / "cache"
    start = time.monotonic()
    result = _serve(model, "--device", "cuda", env={"KVTIER_CACHE_DIR": str(cache)}, timeout=60)
    elapsed = time.monotonic() - start
    assert result.returncode == 2, result.stderr
    (line,) = _error_lines(result.stderr)
    assert line.endswith(
        " ERROR --device cuda: device 'cuda' requested but CUDA is not available"
    ), line
    assert "loading" not in result.stderr and "converting" not in result.stderr
    assert not cache.exists() or not any(cache.iterdir()), list(cache.rglob("*"))
    assert elapsed < 8.0, elapsed  # the interpreter and torch's import; a conversion took 18 s


def test_usage_errors_exit_2_before_loading(model_dir: str, tmp_path: Path) -> None:
    bad = tmp_path / "tiers.yaml"
    bad.write_text("tiers:\n  - {kind: host, capacity: 4MiB\n")
    result = _serve(model_dir, "--kv-offload-config", str(bad), timeout=60)
    assert result.returncode == 2, result.stderr
    (line,) = _error_lines(result.stderr)
    assert f"ERROR --kv-offload-config {bad}: line 3, column 1: " in line, line
    assert "Traceback" not in result.stderr and "loading" not in result.stderr
    result = _serve(str(tmp_path / "absent"), timeout=60)
    assert result.returncode == 2
    (line,) = _error_lines(result.stderr)
    assert f"model {tmp_path / 'absent'}: no such directory" in line


def test_an_engine_core_failure_is_one_line_and_its_traceback_needs_debug(
    model_dir: str, tmp_path: Path
) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in os.listdir(model_dir):
        data = Path(model_dir, name).read_bytes()
        if name.endswith(".safetensors"):
            data = data[:64]  # a truncated weight file: found by name, fails to load
        (broken / name).write_bytes(data)
    result = _serve(str(broken), "--num-gpu-blocks", "16", "--engine-num-threads", "1")
    assert result.returncode == 1, result.stderr
    (line,) = _error_lines(result.stderr)
    assert "engine core failed to start" in line
    assert "Traceback" not in result.stderr
    debug = _serve(
        str(broken), "--num-gpu-blocks", "16", "--engine-num-threads", "1", "--log-level", "debug"
    )
    assert debug.returncode == 1 and "Traceback" in debug.stderr


def test_start_up_logs_model_kv_budget_and_where_the_default_lmdb_lives(
    model_dir: str, tmp_path: Path
) -> None:
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "engine.cli",
        "serve",
        model_dir,
        "--port",
        str(port),
        "--device",
        "cpu",
        "--num-gpu-blocks",
        "40",
        "--kv-offload",
        "--engine-num-threads",
        "1",
        "--served-model-name",
        "tiny",
    ]
    env = python_env(KVTIER_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}", proc, 120)
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr
    block = stderr[stderr.index("kvtier engine ready") :]
    assert f"model       {model_dir} (LlamaForCausalLM, float32, 2 layers, cpu)" in block
    assert "KV cache    40 blocks x 16 tokens = 640 tokens" in block
    lmdb = re.search(r"tier 1    lmdb  max 32GiB at (\S+), write_through", block)
    assert lmdb is not None, block
    assert lmdb.group(1).startswith(str(tmp_path / "cache" / "lmdb"))
    assert re.search(r"tier 0    host  ~?[0-9.]+[KMG]iB of host memory", block), block
    assert "loaded " in stderr and " of weights from 1 file(s)" in stderr  # the load's progress


def test_vllm_api_key_is_read_when_kvtier_s_is_absent(model_dir: str, tmp_path: Path) -> None:
    """A deployment moved from ``vllm serve`` keeps its ``VLLM_API_KEY``: the server requires
    it rather than serving /v1/* to anyone. ``KVTIER_API_KEY`` and ``--api-key`` come first."""
    import argparse

    import httpx

    from engine.server.cli import api_key_from

    flag = argparse.Namespace(api_key="sk-flag")
    both = {"KVTIER_API_KEY": "sk-kvtier", "VLLM_API_KEY": "sk-vllm"}
    assert api_key_from(flag, both) == "sk-flag"
    assert api_key_from(argparse.Namespace(api_key=None), both) == "sk-kvtier"
    port = _free_port()
    cmd = [sys.executable, "-m", "engine.cli", "serve", model_dir, "--port", str(port)]
    cmd += ["--device", "cpu", "--num-gpu-blocks", "40", "--engine-num-threads", "1"]
    env = python_env(VLLM_API_KEY="sk-vllm", KVTIER_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("KVTIER_API_KEY", None)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(base, proc, 120)
        assert httpx.get(f"{base}/v1/models").status_code == 401
        wrong = httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer sk-other"})
        assert wrong.status_code == 401
        right = httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer sk-vllm"})
        assert right.status_code == 200, right.text
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
