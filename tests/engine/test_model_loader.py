"""``engine.models.loader``: weight-loading progress (log lines per file, a bar on a terminal),
and loading a model on CPU imports neither ``torch._dynamo`` nor Triton, whose nanobind
objects otherwise print ~30 ``nanobind: leaked ...`` lines at interpreter exit."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.models.loader import WeightProgress, load_model, safetensors_files
from tests.engine.hf_models import build_tiny_hf_model, make_tiny_model
from tests.servers import python_env
from tiers.sizes import approx_size

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="a CUDA host imports Triton on purpose (the fused kernels)"
)
def test_loading_on_cpu_imports_no_triton_and_prints_no_nanobind_leaks(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path, "llama", seed=1)
    code = (
        "import sys\n"
        "from engine.llm import LLM\n"
        "from engine.sampling_params import SamplingParams\n"
        f"llm = LLM({model_dir!r}, device='cpu', num_gpu_blocks=16)\n"
        "llm.generate(['hello'], SamplingParams(max_tokens=2))\n"
        "print(sorted(m for m in ('triton', 'torch._dynamo') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=python_env(),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"
    assert "nanobind" not in result.stderr


def test_weights_equal_the_checkpoint_with_init_switched_off(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path, "qwen2", seed=3)
    hf = build_tiny_hf_model("qwen2", seed=3)
    loaded = load_model(model_dir, "float32", "cpu")
    ours = dict(loaded.model.named_parameters())
    theirs = dict(hf.named_parameters())
    embed = next(n for n in ours if "embed_tokens" in n)
    assert torch.equal(ours[embed], theirs["model.embed_tokens.weight"])
    # torch.nn.init is restored: a module built afterwards is initialised again.
    layer = torch.nn.Linear(8, 8)
    assert layer.weight.abs().sum() > 0 and torch.nn.init.normal_.__name__ == "normal_"


def test_progress_logs_each_file_of_a_sharded_model(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "sharded"
    build_tiny_hf_model("llama", seed=2).save_pretrained(str(out), max_shard_size="200KB")
    files = safetensors_files(str(out))
    assert len(files) >= 2
    caplog.set_level(logging.INFO, logger="engine.models.loader")
    loaded = load_model(str(out), "float32", "cpu")
    assert loaded.arch.num_layers == 2
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith(f"loading weights from {out}: {len(files)} file(s), ")
    for i, path in enumerate(files, 1):
        assert any(f"file {i}/{len(files)} {os.path.basename(path)} done" in ln for ln in lines)
    assert lines[-1].startswith("loaded ") and f"from {len(files)} file(s) in " in lines[-1]


def test_progress_draws_a_bar_on_a_terminal_and_logs_no_lines(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    (tmp_path / "a.safetensors").write_bytes(b"x" * 3000)
    caplog.set_level(logging.INFO, logger="engine.models.loader")
    stream = Tty()
    progress = WeightProgress([str(tmp_path / "a.safetensors")], stream)
    progress.tensor(3000)
    progress.file_done(str(tmp_path / "a.safetensors"))
    progress.done()
    assert "loading weights" in stream.getvalue()
    assert [r.getMessage() for r in caplog.records][:-1] == []  # only the closing summary
    assert [approx_size(n) for n in (512, 3 << 20, 15 << 30)] == ["512 B", "3.0 MiB", "15.0 GiB"]
