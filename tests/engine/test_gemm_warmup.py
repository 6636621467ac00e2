"""engine.runner.gemm_warmup: every distinct linear of the first layer at every row count a step
can have, the output head at every count of sampled rows (CPU here: the same calls as on CUDA,
counted through the forward's ``linear`` and a hook on the head)."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from torch import nn

from engine.runner import gemm_warmup
from engine.runner.gemm_warmup import DENSE_ROWS, SPARSE_STEP, row_counts, warm_gemm_shapes


def test_row_counts_dense_then_sparse_and_the_maximum_included() -> None:
    assert row_counts(1) == []
    assert row_counts(5) == [2, 3, 4, 5]
    rows = row_counts(DENSE_ROWS + 3 * SPARSE_STEP + 5)
    assert rows[: DENSE_ROWS - 1] == list(range(2, DENSE_ROWS + 1))
    tail = rows[DENSE_ROWS - 1 :]
    assert tail == [DENSE_ROWS + k * SPARSE_STEP for k in (1, 2, 3)] + [rows[-1]]
    assert rows[-1] == DENSE_ROWS + 3 * SPARSE_STEP + 5 and len(set(rows)) == len(rows)


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(16, 64, bias=False)
        self.down_proj = nn.Linear(32, 16, bias=False)


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = nn.Linear(16, 32, bias=True)
        self.o_proj = nn.Linear(16, 16, bias=False)
        self.extra = nn.Linear(16, 16, bias=False)  # o_proj's shape again: warmed once
        self.mlp = _Mlp()


class _Arch:
    hidden_size = 16


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([_Layer(), _Layer()])
        self.arch = _Arch()
        self.head = nn.Linear(16, 50, bias=False)
        self.head_rows: list[int] = []

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.head_rows.append(hidden.shape[0])
        return self.head(hidden).float()


def test_each_distinct_linear_of_the_first_layer_at_every_row_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The layers' linears go through ``engine.kernels.linear`` (the forward's own call)."""
    model = _Model()
    names = {mod: name for name, mod in model.named_modules()}
    calls: dict[str, list[int]] = defaultdict(list)
    real = gemm_warmup.linear

    def counted(x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
        calls[names[layer]].append(x.shape[0])
        return real(x, layer)

    monkeypatch.setattr(gemm_warmup, "linear", counted)
    model.head.register_forward_hook(lambda m, args, out: calls["head"].append(args[0].shape[0]))
    out = warm_gemm_shapes(model, max_rows=40, max_head_rows=6)
    first = "model.layers.0."
    # o_proj and extra share a shape: one of them runs; the second layer never runs
    assert sorted(calls) == sorted(
        [first + "qkv_proj", first + "o_proj", first + "mlp.gate_up_proj", first + "mlp.down_proj"]
        + ["head"]
    )
    for name in ("qkv_proj", "o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        assert calls[first + name] == list(range(2, 41))
    assert model.head_rows == [2, 3, 4, 5, 6] == calls["head"]
    assert out["launches"] == 4 * 39 + 5
    assert out["linears"] == [(32, 16), (16, 16), (64, 16), (16, 32)]


def test_a_one_token_step_budget_warms_only_the_head() -> None:
    """max_num_batched_tokens 1: no row count for the linears (one row takes the gemv)."""
    model = _Model()
    out = warm_gemm_shapes(model, max_rows=1, max_head_rows=3)
    assert out["rows"] == [] and model.head_rows == [2, 3] and out["launches"] == 2


def test_a_model_without_layers_or_a_head_warms_nothing() -> None:
    assert warm_gemm_shapes(nn.Module(), max_rows=8, max_head_rows=4)["launches"] == 0
