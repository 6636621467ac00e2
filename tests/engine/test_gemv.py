"""The Triton batch-1 matrix-vector product (engine/kernels/gemv.py) against torch; on CUDA on
the GPU, elsewhere through Triton's interpreter (set before Triton's first import)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's first import

from engine.kernels import linear  # noqa: E402
from engine.kernels.gemv import gemv, tile_config  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "n,k,config",
    [
        (37, 300, (8, 128, 4, 3)),
        (64, 512, None),
        (5, 1024, (4, 256, 4, 2)),
        (130, 96, (16, 64, 4, 3)),
    ],
)
def test_gemv_matches_torch(dtype, n, k, config) -> None:
    g = torch.Generator().manual_seed(n * k)
    x = torch.randn(1, k, generator=g).to(dtype=dtype, device=DEVICE)
    w = torch.randn(n, k, generator=g).to(dtype=dtype, device=DEVICE)
    y = gemv(x, w) if config is None else gemv(x, w, *config)
    ref = x.float() @ w.float().T
    assert y.shape == (1, n) and y.dtype == dtype
    tol = dict(rtol=1e-4, atol=1e-3) if dtype == torch.float32 else dict(rtol=2e-2, atol=0.25)
    torch.testing.assert_close(y.float(), ref, **tol)


def test_gemv_reads_a_row_slice_and_rejects_bad_shapes() -> None:
    x = torch.randn(3, 64, device=DEVICE)[1:2]  # a row of a larger batch
    w = torch.randn(16, 64, device=DEVICE)
    torch.testing.assert_close(gemv(x, w, 8, 64, 4, 2), x @ w.T, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="x \\[1, K\\]"):
        gemv(torch.randn(2, 64, device=DEVICE), w)
    with pytest.raises(ValueError, match="x \\[1, K\\]"):
        gemv(torch.randn(1, 63, device=DEVICE), w)
    with pytest.raises(ValueError, match="unit last strides"):
        gemv(x, torch.randn(64, 16, device=DEVICE).T)


def test_tile_config_by_shape_class() -> None:
    assert tile_config(4096, 14336) == (4, 512, 4, 3)  # down
    assert tile_config(28672, 4096) == (16, 256, 4, 3)  # gate/up
    assert tile_config(128256, 4096) == (16, 256, 4, 3)  # lm_head
    assert tile_config(6144, 4096) == tile_config(4096, 4096) == (8, 512, 4, 3)  # qkv, o


def test_linear_equals_the_layer() -> None:
    """One row on CUDA goes through gemv, anything else through F.linear: same values."""
    layer = torch.nn.Linear(48, 20, bias=True).to(DEVICE)
    tied_head = torch.nn.Embedding(20, 48).to(DEVICE)  # no bias: a tied output head
    for rows in (1, 3):
        x = torch.randn(rows, 48, device=DEVICE)
        torch.testing.assert_close(linear(x, layer), layer(x), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(
            linear(x, tied_head), x @ tied_head.weight.T, rtol=1e-4, atol=1e-4
        )
