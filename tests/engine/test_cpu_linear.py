"""oneDNN-packed linears on CPU (engine/models/cpu_linear.py): the same products as F.linear
for any row count and for 3-D inputs, and a model on the CPU gets every linear and its
output head packed (the logits against HF are checked in test_models.py, through the runner)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from engine.models.cpu_linear import PackedLinear, pack_cpu_linears, packing_available

pytestmark = pytest.mark.skipif(not packing_available(torch.float32), reason="no oneDNN")


@pytest.mark.parametrize("rows", [1, 8, 33])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("row_copy", [False, True])
def test_packed_linear_matches_f_linear(rows: int, bias: bool, row_copy: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    x = torch.randn(rows, 40, generator=g)
    layer = PackedLinear(weight, b, row_copy)
    assert (layer.weight_t is not None) == row_copy
    torch.testing.assert_close(layer(x), F.linear(x, weight, b), atol=1e-5, rtol=1e-5)
    x3 = torch.randn(2, rows, 40, generator=g)
    torch.testing.assert_close(layer(x3), F.linear(x3, weight, b), atol=1e-5, rtol=1e-5)


def test_pack_cpu_linears_swaps_every_linear_and_keeps_the_math() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Sequential(nn.Linear(32, 8, bias=False)))
    x = torch.randn(5, 16)
    want = model(x)
    assert pack_cpu_linears(model) == 2
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    torch.testing.assert_close(model(x), want, atol=1e-5, rtol=1e-5)


def test_float16_is_left_alone() -> None:
    model = nn.Sequential(nn.Linear(8, 8).half())
    assert pack_cpu_linears(model) == 0
    assert isinstance(model[0], nn.Linear)


def test_runner_on_cpu_packs_the_model_and_its_tied_head(tmp_path) -> None:
    from engine.config import CacheConfig, EngineConfig
    from engine.runner.model_runner import ModelRunner
    from tests.engine.hf_models import make_tiny_model

    model_dir = make_tiny_model(tmp_path, "llama", seed=1, tie_word_embeddings=True)
    config = EngineConfig(dtype="float32", device="cpu", cache=CacheConfig(num_gpu_blocks=8))
    runner = ModelRunner(config, model_dir)
    layers = runner.arch.num_layers
    assert runner.num_packed_linears == 4 * layers  # qkv, o, gate_up, down; no lm_head (tied)
    assert isinstance(runner.model._packed_head, PackedLinear)
    assert runner.model._packed_head.weight_t is not None  # a small model: batch-1 copies
    plain = ModelRunner(config, model_dir, cpu_packed_linears=False)
    assert plain.num_packed_linears == 0
    hidden = torch.randn(3, runner.arch.hidden_size)
    torch.testing.assert_close(
        runner.model.compute_logits(hidden),
        plain.model.compute_logits(hidden),
        atol=1e-5,
        rtol=1e-5,
    )
