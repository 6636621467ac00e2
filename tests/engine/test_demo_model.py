"""The demo model: written once, byte-identical across fresh directories, safe under
concurrent first use, loadable by AutoTokenizer, and runnable through the ModelRunner with
the same logits as HF transformers."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from engine.config import CacheConfig, EngineConfig
from engine.core_types import ScheduledRequest, SchedulerOutput
from engine.models.demo_model import DEMO_SUBDIR, ensure_demo_model
from engine.models.loader import model_fingerprint
from engine.runner.model_runner import ModelRunner
from engine.sampling_params import SamplingParams

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory) -> str:
    return ensure_demo_model(str(tmp_path_factory.mktemp("cache")))


def _files(d: str) -> dict[str, bytes]:
    return {name: open(os.path.join(d, name), "rb").read() for name in sorted(os.listdir(d))}


def test_created_once_and_deterministic_across_directories(demo_dir, tmp_path) -> None:
    assert os.path.basename(demo_dir) == DEMO_SUBDIR
    names = set(os.listdir(demo_dir))
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= names
    mtime = os.path.getmtime(os.path.join(demo_dir, "model.safetensors"))
    assert ensure_demo_model(os.path.dirname(demo_dir)) == demo_dir
    assert os.path.getmtime(os.path.join(demo_dir, "model.safetensors")) == mtime  # not rewritten
    # Two processes race to create it in a fresh directory: one wins, no temp dir is left.
    root = str(tmp_path / "race")
    code = f"from engine.models.demo_model import ensure_demo_model; print(ensure_demo_model({root!r}))"
    procs = [
        subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs == [os.path.join(root, DEMO_SUBDIR)] * 2
    assert os.listdir(root) == [DEMO_SUBDIR]
    assert _files(outs[0]) == _files(demo_dir)
    assert model_fingerprint(outs[0], "auto") == model_fingerprint(demo_dir, "auto")


def test_default_directory_comes_from_kvtier_cache_dir(monkeypatch, tmp_path, demo_dir) -> None:
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path))
    # Pre-seed via a copy so this test checks the path choice without rebuilding.
    import shutil

    shutil.copytree(demo_dir, tmp_path / DEMO_SUBDIR)
    assert ensure_demo_model() == str(tmp_path / DEMO_SUBDIR)


def test_tokenizer_loads_and_round_trips(demo_dir) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_dir)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 0)
    assert len(tok) == 512
    for text in [
        "Hello world!",
        "the cache block is 16 tokens\n\ttabs  and  spaces",
        "~`{}|^ 0123 xyz",
    ]:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_token_id
        assert tok.decode(ids, skip_special_tokens=True) == text
    # Learned merges make common words single tokens.
    assert len(tok.encode(" the", add_special_tokens=False)) == 1
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<s><|user|>\nhi<|end|>\n<|assistant|>\n"


def test_runs_through_the_runner_like_hf(demo_dir) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_dir)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "what is a cache block?"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    assert isinstance(prompt, list) and isinstance(prompt[0], int)
    runner = ModelRunner(EngineConfig(device="cpu", cache=CacheConfig(num_gpu_blocks=8)), demo_dir)
    assert (
        runner.arch.num_layers == 4
        and runner.dtype == torch.float32
        and runner.eos_token_ids == (2,)
    )
    table = [5, 2, 7]
    params = SamplingParams(temperature=0.0)
    seq = list(prompt)
    rows = []
    for n in range(4):
        new = seq if n == 0 else seq[-1:]
        r = ScheduledRequest("demo", new, len(seq) - len(new), table, True, params, n)
        out = runner.execute_model(SchedulerOutput([r], len(new)), return_logits=True)
        rows.append(out.logits["demo"])
        seq.append(out.sampled_token_ids["demo"])
    hf = AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([seq])).logits[0]
    n_prompt = len(prompt)
    torch.testing.assert_close(
        torch.stack(rows), ref[n_prompt - 1 : n_prompt + 3], atol=1e-4, rtol=0
    )
    assert seq[n_prompt:] == ref[n_prompt - 1 : n_prompt + 3].argmax(-1).tolist()
