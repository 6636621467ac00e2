"""Where a model comes from (engine/models/sources.py) and the engine's length check: a hub
id resolved from a Hugging Face cache that the test lays out (``HF_HOME`` in a temp dir,
``models--ORG--NAME/snapshots/<rev>`` plus ``refs/main``) with ``HF_HUB_OFFLINE=1``, served
by ``kvtier serve ORG/NAME``; an unknown architecture is one line naming the supported ones;
a GGUF's converted directory follows the serving dtype; ``max_model_len`` longer than the KV
pool is a start-up error saying what to change, never a silent cut."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from engine.config import CacheConfig, EngineConfig, SchedulerConfig, check_max_model_len
from engine.models import gguf, supported_architectures
from engine.models.sources import gguf_dtype, hub_cache_dir, is_model_id, resolve_model_dir
from engine.server.startup import UsageError, preflight
from tests.engine.hf_models import make_tiny_model
from tests.servers import python_env, wait_until_healthy

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[2]
REV = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("sources"), "llama", seed=5)


def _hf_cache(home: Path, repo_id: str, files_from: str) -> Path:
    """Lay out ``home/hub`` as huggingface_hub does for ``repo_id`` at revision REV."""
    repo = home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / REV
    shutil.copytree(files_from, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REV)
    return snapshot


@pytest.fixture()
def offline_cache(tmp_path: Path, model_dir: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "hf"
    snapshot = _hf_cache(home, "tiny-org/tiny-llama", model_dir)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return snapshot


def test_a_model_id_resolves_to_its_snapshot_in_the_hf_cache(
    offline_cache: Path, tmp_path: Path
) -> None:
    assert hub_cache_dir() == str(tmp_path / "hf" / "hub")
    assert is_model_id("tiny-org/tiny-llama") and not is_model_id(str(offline_cache))
    assert resolve_model_dir("tiny-org/tiny-llama") == str(offline_cache)
    assert resolve_model_dir(f"tiny-org/tiny-llama@{REV}") == str(offline_cache)
    checked = preflight(EngineConfig(model="tiny-org/tiny-llama"))
    assert checked.model_info["snapshot"] == str(offline_cache)
    assert checked.model_info["architecture"] == "LlamaForCausalLM"


def test_a_model_id_nothing_provides_is_one_line_naming_the_cache(
    offline_cache: Path, tmp_path: Path
) -> None:
    with pytest.raises(FileNotFoundError) as info:
        resolve_model_dir("tiny-org/absent")
    message = str(info.value)
    assert message == (
        f"model tiny-org/absent: no such directory, and not in the Hugging Face "
        f"cache {tmp_path / 'hf' / 'hub'} (HF_HUB_OFFLINE is set: nothing "
        "downloaded)"
    )
    with pytest.raises(UsageError, match="^model tiny-org/absent: no such directory, and not"):
        preflight(EngineConfig(model="tiny-org/absent"))


def test_an_unknown_architecture_names_the_supported_ones(tmp_path: Path, model_dir: str) -> None:
    other = tmp_path / "gpt2"
    shutil.copytree(model_dir, other)
    config = json.loads((other / "config.json").read_text())
    config = {
        "architectures": ["GPT2LMHeadModel"],
        "n_embd": 64,
        "n_layer": 2,
        "vocab_size": config["vocab_size"],
    }  # GPT-2's own field names
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(UsageError) as info:
        preflight(EngineConfig(model=str(other)))
    supported = ", ".join(supported_architectures())
    assert str(info.value) == (
        f"model {other}: unsupported architecture 'GPT2LMHeadModel'; supported: {supported}"
    )
    from engine.models.loader import load_model

    with pytest.raises(ValueError, match=f"supported: {supported}$"):
        load_model(str(other), "auto", "cpu")


def test_readme_lists_every_supported_architecture() -> None:
    readme = (ROOT / "README.md").read_text()
    for arch in supported_architectures():
        assert f"`{arch}`" in readme, arch


def test_a_gguf_is_converted_in_the_serving_dtype(tmp_path: Path) -> None:
    assert gguf_dtype("auto", "cpu") == "float32" and gguf_dtype("auto", "cuda:1") == "bfloat16"
    assert gguf_dtype("float16", "cpu") == "float16"
    src = tmp_path / "m.gguf"
    src.write_bytes(gguf.GGUF_MAGIC + b"payload")
    digest = gguf.file_sha256(str(src))
    cache = tmp_path / "cache"
    for dtype in ("float32", "bfloat16"):  # a complete conversion per dtype, made by hand
        final = cache / gguf.GGUF_SUBDIR / gguf.converted_name(digest, dtype)
        final.mkdir(parents=True)
        (final / gguf.MARKER_FILE).write_text(json.dumps({"dtype": dtype}))
    bf16 = resolve_model_dir(str(src), str(cache), dtype="bfloat16", device="cpu")
    assert bf16.endswith(f"{digest[:32]}-v{gguf.CONVERTER_VERSION}-bfloat16")
    assert resolve_model_dir(str(src), str(cache), dtype="auto", device="cuda") == bf16
    f32 = resolve_model_dir(str(src), str(cache), dtype="auto", device="cpu")
    assert f32.endswith(f"{digest[:32]}-v{gguf.CONVERTER_VERSION}")
    with pytest.raises(ValueError, match="not 'int8'"):
        gguf.ensure_converted(str(src), str(cache), "int8")


def _config(max_model_len: int | None = None, num_gpu_blocks: int | None = None) -> EngineConfig:
    return EngineConfig(
        cache=CacheConfig(num_gpu_blocks=num_gpu_blocks),
        scheduler=SchedulerConfig(max_model_len=max_model_len),
    )


def test_max_model_len_longer_than_the_pool_is_an_error_saying_what_to_change() -> None:
    assert check_max_model_len(_config(), 8192, 512) == 8192  # fits: unchanged
    with pytest.raises(ValueError) as info:
        check_max_model_len(_config(), 8192, 364)  # 5824 tokens: the CPU case
    assert str(info.value) == (
        "max_model_len 8192 (the model's context length (config.json)) needs 512 KV blocks, "
        "but the KV cache holds 364 blocks (5824 tokens): pass --max-model-len 5824 or less, "
        "or give the KV cache more memory (--gpu-memory-utilization (GPU) or "
        "--cpu-kv-cache-bytes (CPU))"
    )
    with pytest.raises(
        ValueError,
        match=r"^max_model_len 4096 \(--max-model-len\) needs 256 "
        r"KV blocks.*\(--num-gpu-blocks\)$",
    ):
        check_max_model_len(_config(4096, 40), 4096, 40)


def test_a_fixed_pool_under_a_derived_length_cuts_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level("WARNING", logger="engine.llm_engine"):
        assert check_max_model_len(_config(num_gpu_blocks=40), 4096, 40) == 640
    assert "max_model_len cut from 4096 (the model's context length) to 640" in caplog.text


def test_the_engine_refuses_a_pool_too_small_and_the_default_holds_the_context(
    model_dir: str,
) -> None:
    from engine.llm import LLM

    per_block = 2 * 2 * 2 * 16 * 16 * 4  # layers x (K, V) x kv heads x head_dim x 16 x fp32
    with pytest.raises(ValueError, match=r"^max_model_len 512 .* pass --max-model-len 256 or"):
        LLM(model_dir, device="cpu", cpu_kv_cache_bytes=16 * per_block)
    with LLM(model_dir, device="cpu", cpu_kv_cache_bytes=16 * per_block, max_model_len=256) as llm:
        assert llm.engine.max_model_len == 256
    with LLM(model_dir, device="cpu") as llm:  # default pool: 256 MiB, the context fits
        assert llm.engine.max_model_len == 512


def test_kvtier_serve_a_model_id_offline(offline_cache: Path, tmp_path: Path) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "engine.cli",
        "serve",
        "tiny-org/tiny-llama",
        "--port",
        str(port),
        "--device",
        "cpu",
        "--num-gpu-blocks",
        "32",
        "--engine-num-threads",
        "1",
    ]
    env = python_env(
        HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", KVTIER_CACHE_DIR=str(tmp_path / "kv")
    )
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}", proc, 120)
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["tiny-org/tiny-llama"]
        reply = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={
                "model": "tiny-org/tiny-llama",
                "prompt": "hello",
                "max_tokens": 3,
                "temperature": 0,
            },
            timeout=60,
        ).json()
        assert reply["usage"]["completion_tokens"] == 3
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr
