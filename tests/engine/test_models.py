"""The plain-torch models match HF transformers on the same random weights (fp32, atol 1e-4),
through the real paged cache path (torch attention backend), and the loader/fingerprint
behave as documented."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from engine.attention.torch_backend import TorchAttentionBackend
from engine.config import CacheConfig, EngineConfig
from engine.core_types import ScheduledRequest, SchedulerOutput
from engine.models.base import ModelArchConfig
from engine.models.loader import load_model, model_fingerprint
from engine.runner.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from tests.engine.hf_models import make_tiny_model

ARCHS = ["llama", "qwen2", "qwen3"]
ATOL = 1e-4


def hf_logits(model_dir: str, token_ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0]


def all_position_logits(
    model_dir: str, token_ids: list[int], block_table: list[int]
) -> torch.Tensor:
    """Logits of every position of one full prefill through our model and paged cache."""
    runner = ModelRunner(
        EngineConfig(dtype="float32", device="cpu", cache=CacheConfig(num_gpu_blocks=16)), model_dir
    )
    req = ScheduledRequest("r", token_ids, 0, block_table, True, SamplingParams(temperature=0.0))
    batch = runner.prepare_inputs(SchedulerOutput([req], len(token_ids)))
    with torch.inference_mode():
        runner.attn_backend.plan(batch.metadata)
        hidden = runner.model(
            batch.input_ids, batch.positions, runner.attn_backend, runner.kv_cache
        )
        return runner.model.compute_logits(hidden)


@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("llama", {}),
        ("qwen2", {}),
        ("qwen3", {}),
        # Llama 3.1 rope scaling with a short original context so all three bands are used.
        (
            "llama",
            dict(
                rope_parameters=dict(
                    rope_type="llama3",
                    rope_theta=500000.0,
                    factor=8.0,
                    low_freq_factor=1.0,
                    high_freq_factor=4.0,
                    original_max_position_embeddings=32,
                )
            ),
        ),
        ("llama", dict(tie_word_embeddings=True, num_key_value_heads=1)),
    ],
    ids=["llama", "qwen2", "qwen3", "llama3-rope", "tied-mqa"],
)
def test_full_prefill_matches_hf_at_every_position(tmp_path, arch: str, overrides: dict) -> None:
    model_dir = make_tiny_model(tmp_path, arch, seed=3, **overrides)
    tokens = torch.randint(3, 512, (37,), generator=torch.Generator().manual_seed(7)).tolist()
    ours = all_position_logits(model_dir, tokens, [9, 2, 14])  # out of order, non-contiguous
    ref = hf_logits(model_dir, tokens)
    assert ours.shape == ref.shape == (37, 512)
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)
    # The weights are non-trivial: greedy picks differ along the sequence.
    assert len(set(ref.argmax(-1).tolist())) > 5


def test_arch_config_parses_qwen_flags_and_rejects_unsupported() -> None:
    base = dict(
        vocab_size=8,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    q2 = ModelArchConfig.from_hf({**base, "architectures": ["Qwen2ForCausalLM"]})
    assert (q2.qkv_bias, q2.o_bias, q2.qk_norm, q2.head_dim) == (True, False, False, 4)
    q3 = ModelArchConfig.from_hf({**base, "architectures": ["Qwen3ForCausalLM"], "head_dim": 16})
    assert (q3.qkv_bias, q3.qk_norm, q3.head_dim) == (False, True, 16)
    old = ModelArchConfig.from_hf(
        {
            **base,
            "architectures": ["LlamaForCausalLM"],
            "rope_theta": 5e5,
            "rope_scaling": {"type": "linear", "factor": 2.0},
        }
    )
    assert (old.rope.theta, old.rope.rope_type, old.rope.factor) == (5e5, "linear", 2.0)
    with pytest.raises(ValueError, match="sliding_window"):
        ModelArchConfig.from_hf(
            {**base, "architectures": ["MistralForCausalLM"], "sliding_window": 4096}
        )
    with pytest.raises(ValueError, match="rope type 'yarn'"):
        ModelArchConfig.from_hf(
            {
                **base,
                "architectures": ["LlamaForCausalLM"],
                "rope_parameters": {"rope_type": "yarn"},
            }
        )
    from engine.models import get_model_class

    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        get_model_class("GPT2LMHeadModel")


def test_mistral_and_sharded_checkpoint_load_identically(tmp_path) -> None:
    model_dir = make_tiny_model(tmp_path, "llama", seed=5)
    tokens = list(range(10, 30))
    ref = all_position_logits(model_dir, tokens, [0, 1])
    # Re-save as MistralForCausalLM in 3 shards with an index file.
    from transformers import AutoModelForCausalLM, MistralConfig, MistralForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir)
    cfg = MistralConfig(
        **{k: v for k, v in hf.config.to_dict().items() if k not in ("architectures", "model_type")}
    )
    cfg.sliding_window = None
    mistral = MistralForCausalLM(cfg)
    mistral.load_state_dict(hf.state_dict())
    sharded = str(tmp_path / "mistral-sharded")
    mistral.save_pretrained(sharded, max_shard_size="60KB")
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(sharded) if f.endswith(".safetensors")]) >= 3
    loaded = load_model(sharded, "auto", "cpu")
    assert loaded.arch.architecture == "MistralForCausalLM"
    torch.testing.assert_close(all_position_logits(sharded, tokens, [0, 1]), ref, atol=ATOL, rtol=0)


def test_loader_dtypes_and_missing_weights(tmp_path) -> None:
    model_dir = make_tiny_model(tmp_path, "qwen2", seed=1)
    assert (
        load_model(model_dir, "bfloat16", "cpu").model.model.embed_tokens.weight.dtype
        == torch.bfloat16
    )
    assert load_model(model_dir, "auto", "cpu").dtype == torch.float32  # the config's dtype
    with pytest.raises(ValueError, match="dtype must be"):
        load_model(model_dir, "float64", "cpu")
    from safetensors.torch import load_file, save_file

    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    del tensors["model.norm.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks parameters: \['model.norm.weight'\]"):
        load_model(model_dir, "auto", "cpu")


def test_fingerprint_stable_across_processes_and_sensitive(tmp_path) -> None:
    a = make_tiny_model(tmp_path, "llama", seed=0)
    fp = model_fingerprint(a, "float32")
    assert fp.startswith("LlamaForCausalLM-") and len(fp) == len("LlamaForCausalLM-") + 32
    code = f"from engine.models.loader import model_fingerprint; print(model_fingerprint({a!r}, 'float32'))"
    other = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    )
    assert other.stdout.strip() == fp
    assert model_fingerprint(a, "auto") == fp  # auto resolves to the config's float32
    assert model_fingerprint(a, "bfloat16") != fp
    b = str(tmp_path / "copy")
    shutil.copytree(a, b)
    assert model_fingerprint(b, "float32") == fp  # same files, different place
    cfg = json.load(open(os.path.join(b, "config.json")))
    cfg["rms_norm_eps"] = 1e-5
    json.dump(cfg, open(os.path.join(b, "config.json"), "w"))
    assert model_fingerprint(b, "float32") != fp


def test_torch_backend_rejects_forward_before_plan() -> None:
    backend = TorchAttentionBackend(4, 2, 8, 0.1)
    x = torch.zeros(1, 4, 8)
    with pytest.raises(RuntimeError, match="before plan"):
        backend.forward(0, x, x[:, :2], x[:, :2], torch.zeros(1, 2, 16, 2, 8))
    with pytest.raises(ValueError, match="not a multiple"):
        TorchAttentionBackend(3, 2, 8, 0.1)
