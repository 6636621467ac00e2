"""The CPU prompt attention by GEMMs (engine/attention/torch_backend.py
``causal_gemm_attention``) against plain float64 softmax attention: whole prompts and chunks
after cached context, GQA groups 1 and 3, chunk sizes that do not divide the prompt; and the
backend choosing it for a long prompt (its fresh keys, no gather) with the same output as the
SDPA path it replaces. Both GEMM engines (MKL's ``torch.mm`` and oneDNN) are checked."""

from __future__ import annotations

import pytest
import torch

from engine.attention import torch_backend
from engine.attention.base import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend, causal_gemm_attention
from tests.engine.test_torch_attention import reference

BS = 16


ENGINES = [
    pytest.param(False, id="mkl"),
    pytest.param(
        True,
        id="onednn",
        marks=pytest.mark.skipif(
            not torch_backend._onednn_available(), reason="torch built without oneDNN"
        ),
    ),
]


@pytest.mark.parametrize("onednn", ENGINES)
@pytest.mark.parametrize(
    "q_len,seq_len,heads,kv_heads,chunk",
    [
        (200, 200, 9, 3, 64),
        (130, 300, 4, 4, 128),
        (37, 37, 6, 2, 16),
        (1, 50, 9, 3, 128),
        (700, 700, 9, 3, 128),  # past ONEDNN_MIN_KEYS: both engines in one call
        (300, 900, 6, 2, 128),
    ],
)
def test_gemm_attention_matches_softmax_attention(
    q_len: int, seq_len: int, heads: int, kv_heads: int, chunk: int, onednn: bool
) -> None:
    g = torch.Generator().manual_seed(q_len + seq_len)
    dim = 32
    q = torch.randn(q_len, heads, dim, generator=g)
    keys = torch.randn(seq_len, kv_heads, dim, generator=g)
    vals = torch.randn(seq_len, kv_heads, dim, generator=g)
    got = causal_gemm_attention(q, keys, vals, dim**-0.5, chunk=chunk, onednn=onednn)
    want = reference(q, keys, vals, dim**-0.5).float().reshape(q_len, heads * dim)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    out = torch.full((q_len, heads, dim), float("nan"))
    got_out = causal_gemm_attention(q, keys, vals, dim**-0.5, out, chunk, onednn)
    assert got_out.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out.view(q_len, -1), got, rtol=0, atol=0)


@pytest.mark.skipif(not torch_backend._onednn_available(), reason="torch built without oneDNN")
def test_onednn_products_at_every_chunk_match_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every chunk through oneDNN (bound 0), SmolLM2's head shapes, against torch's SDPA."""
    monkeypatch.setattr(torch_backend, "ONEDNN_MIN_KEYS", 0)
    g = torch.Generator().manual_seed(3)
    n, heads, kv_heads, dim = 320, 9, 3, 64
    q = torch.randn(n, heads, dim, generator=g)
    k = torch.randn(n, kv_heads, dim, generator=g)
    v = torch.randn(n, kv_heads, dim, generator=g)
    got = causal_gemm_attention(q, k, v, dim**-0.5, onednn=True)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1).repeat_interleave(3, 0),
        v.transpose(0, 1).repeat_interleave(3, 0),
        is_causal=True,
    )
    torch.testing.assert_close(got, want.transpose(0, 1).reshape(n, -1), rtol=1e-5, atol=1e-5)


def _prompt_step(backend: TorchAttentionBackend, q, k, v, kv_layer) -> torch.Tensor:
    n = q.shape[0]
    blocks = -(-n // BS)
    backend.plan(
        AttentionMetadata(
            cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
            seq_lens=torch.tensor([n], dtype=torch.int32),
            block_tables=torch.arange(blocks, dtype=torch.int32).flip(0).unsqueeze(0),
            slot_mapping=torch.tensor(
                [(blocks - 1 - p // BS) * BS + p % BS for p in range(n)], dtype=torch.int64
            ),
            query_lens_cpu=[n],
            seq_lens_cpu=[n],
            block_size=BS,
            block_tables_cpu=[list(range(blocks))[::-1]],
        )
    )
    return backend.forward(0, q, k, v, kv_layer)


def test_backend_takes_it_for_a_prompt_and_matches_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(7)
    n, heads, kv_heads, dim = 300, 9, 3, 32
    q = torch.randn(n, heads, dim, generator=g)
    k = torch.randn(n, kv_heads, dim, generator=g)
    v = torch.randn(n, kv_heads, dim, generator=g)
    backend = TorchAttentionBackend(heads, kv_heads, dim, dim**-0.5)
    kv_gemm = torch.zeros(-(-n // BS), 2, BS, kv_heads, dim)
    calls: list[int] = []
    real = torch_backend.causal_gemm_attention
    monkeypatch.setattr(
        torch_backend,
        "causal_gemm_attention",
        lambda *a, **kw: calls.append(1) or real(*a, **kw),
    )
    got = _prompt_step(backend, q, k, v, kv_gemm)
    assert calls == [1]
    monkeypatch.setattr(torch_backend, "GEMM_MIN_QUERIES", n + 1)  # the SDPA path
    kv_sdpa = torch.zeros_like(kv_gemm)
    want = _prompt_step(backend, q, k, v, kv_sdpa)
    assert calls == [1]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(kv_gemm, kv_sdpa)  # the cache written all the same
    torch.testing.assert_close(
        want.view(n, heads, dim), reference(q, k, v, dim**-0.5).float(), rtol=1e-5, atol=1e-5
    )
