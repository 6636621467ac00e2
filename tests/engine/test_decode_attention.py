"""The Triton split-KV decode attention (engine/kernels/decode_attention.py) against torch.

On a CUDA machine on the GPU, elsewhere through Triton's interpreter (set before Triton's first
import, as in test_kernels.py). The reference gathers each request's pages from the same
block-major cache and runs plain softmax attention in float32.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's first import

from engine.kernels.decode_attention import (  # noqa: E402
    decode_config,
    max_query_len,
    num_splits_for,
    paged_decode_attention,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PAGE = 16


def make_case(
    seq_lens: list[int],
    heads: int,
    kv_heads: int,
    dim: int,
    dtype: torch.dtype,
    layers: int = 3,
    seed: int = 0,
):
    """A block-major cache [blocks, layers, 2, PAGE, kv_heads, dim] with each request's pages
    scattered over it, q as a strided view of a fused [B, heads + kv_heads, dim] row, and the
    CSR page table."""
    g = torch.Generator().manual_seed(seed)
    pages_per = [-(-n // PAGE) for n in seq_lens]
    num_blocks = sum(pages_per) + 5
    cache = torch.randn(num_blocks, layers, 2, PAGE, kv_heads, dim, generator=g).to(dtype)
    order = torch.randperm(num_blocks, generator=g).tolist()
    indptr, indices = [0], []
    for n in pages_per:
        indices += order[len(indices) : len(indices) + n]
        indptr.append(len(indices))
    last = [n - (p - 1) * PAGE for n, p in zip(seq_lens, pages_per, strict=True)]
    fused = torch.randn(len(seq_lens), heads + kv_heads, dim, generator=g).to(dtype)
    cache, fused = cache.to(DEVICE), fused.to(DEVICE)
    as_i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=DEVICE)  # noqa: E731
    return cache, fused[:, :heads], as_i32(indptr), as_i32(indices), as_i32(last), indices, indptr


def reference(q, kv_layer, indices, indptr, seq_lens, scale):
    heads, kv_heads = q.shape[1], kv_layer.shape[3]
    outs = []
    for b, n in enumerate(seq_lens):
        pages = indices[indptr[b] : indptr[b + 1]]
        kv = kv_layer[pages].float()  # [pages, 2, PAGE, Hkv, D]
        k = kv[:, 0].reshape(-1, kv_heads, kv.shape[-1])[:n].repeat_interleave(heads // kv_heads, 1)
        v = kv[:, 1].reshape(-1, kv_heads, kv.shape[-1])[:n].repeat_interleave(heads // kv_heads, 1)
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[b].float(), k) * scale, dim=-1)
        outs.append(torch.einsum("hn,nhd->hd", w, v))
    return torch.stack(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 2, 64), (7, 1, 32), (2, 2, 32)])
@pytest.mark.parametrize("num_splits,block_n", [(1, 32), (4, 32), (16, 32), (2, 128)])
def test_matches_torch_on_scattered_pages(dtype, heads, kv_heads, dim, num_splits, block_n) -> None:
    seq_lens = [1, 17, 64, 65, 200]
    cache, q, indptr, indices, last, idx_list, indptr_list = make_case(
        seq_lens, heads, kv_heads, dim, dtype, seed=heads * dim + num_splits
    )
    layer = 1
    kv_layer = cache[:, layer]  # strided view, as the engine passes it
    scale = dim**-0.5
    before = cache.clone()
    out = paged_decode_attention(
        q, kv_layer, indptr, indices, last, scale, num_splits, block_n=block_n
    )
    ref = reference(q, kv_layer, idx_list, indptr_list, seq_lens, scale)
    assert out.shape == (len(seq_lens), heads, dim) and out.dtype == dtype
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    if dtype == torch.float32 and DEVICE.type == "cuda":
        tol = dict(rtol=5e-3, atol=5e-3)  # tf32 dots on the GPU
    torch.testing.assert_close(out.float(), ref, **tol)
    assert torch.equal(cache, before)  # reads only


def test_other_layers_do_not_leak_in() -> None:
    """Attention over layer 0 must not change when another layer's pages change."""
    seq_lens = [40, 3]
    cache, q, indptr, indices, last, *_ = make_case(seq_lens, 4, 2, 32, torch.float32, seed=7)
    out0 = paged_decode_attention(q, cache[:, 0], indptr, indices, last, 0.2, 4, block_n=32)
    cache[:, 1:] = torch.randn_like(cache[:, 1:])
    out1 = paged_decode_attention(q, cache[:, 0], indptr, indices, last, 0.2, 4, block_n=32)
    assert torch.equal(out0, out1)
    cache[:, 0, 1] *= 2.0  # values of layer 0 do matter
    out2 = paged_decode_attention(q, cache[:, 0], indptr, indices, last, 0.2, 4, block_n=32)
    assert not torch.allclose(out0, out2)


def test_bad_arguments_raise() -> None:
    cache, q, indptr, indices, last, *_ = make_case([5], 4, 2, 32, torch.float32)
    with pytest.raises(ValueError, match="power of two"):
        paged_decode_attention(q, cache[:, 0], indptr, indices, last, 1.0, 3)
    wide = torch.zeros(1, 34, 32, device=DEVICE)  # group 17 > 16
    with pytest.raises(ValueError, match="GQA group"):
        paged_decode_attention(wide, cache[:, 0], indptr, indices, last, 1.0, 1)


def test_num_splits_fill_about_two_programs_per_sm() -> None:
    assert num_splits_for(1, 8, 132) == 32
    assert num_splits_for(8, 8, 132) == 4
    assert num_splits_for(32, 8, 132) == 1
    for b in (1, 2, 4, 8, 16, 32, 64):
        s = num_splits_for(b, 8, 132)
        assert s & (s - 1) == 0 and 1 <= s <= 32
        assert b * 8 * s <= 264 or s == 1


def test_decode_config_per_graph_size() -> None:
    assert decode_config(1, 8, 132) == (32, 64, 4, 2)
    assert decode_config(8, 8, 132) == (4, 128, 4, 2)
    assert decode_config(32, 8, 132) == (1, 128, 4, 2)


def reference_multi(q, kv_layer, indices, indptr, seq_lens, q_lens, scale):
    """Each request's newest ``q_lens[b]`` tokens, causal: token i sees keys up to its own."""
    heads, kv_heads = q.shape[1], kv_layer.shape[3]
    outs, row = [], 0
    for b, (n, lq) in enumerate(zip(seq_lens, q_lens, strict=True)):
        pages = indices[indptr[b] : indptr[b + 1]]
        kv = kv_layer[pages].float()
        k = kv[:, 0].reshape(-1, kv_heads, kv.shape[-1])[:n].repeat_interleave(heads // kv_heads, 1)
        v = kv[:, 1].reshape(-1, kv_heads, kv.shape[-1])[:n].repeat_interleave(heads // kv_heads, 1)
        for i in range(lq):
            visible = n - lq + i + 1
            w = torch.softmax(
                torch.einsum("hd,nhd->hn", q[row].float(), k[:visible]) * scale, dim=-1
            )
            outs.append(torch.einsum("hn,nhd->hd", w, v[:visible]))
            row += 1
    return torch.stack(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,q_lens", [(8, 2, [16, 1, 5, 3]), (7, 1, [9, 1, 4, 3])])
@pytest.mark.parametrize("num_splits", [1, 8])
def test_short_queries_over_long_contexts_are_causal(
    dtype, heads, kv_heads, q_lens, num_splits
) -> None:
    """Several query tokens per request (a short append over cached context, or a whole short
    prompt: q_len == seq_len): each token attends up to its own position."""
    seq_lens = [200, 1, 70, 3]
    cache, _, indptr, indices, last, idx_list, indptr_list = make_case(
        seq_lens, heads, kv_heads, 32, dtype, seed=sum(q_lens) + num_splits
    )
    g = torch.Generator().manual_seed(5)
    q = torch.randn(sum(q_lens), heads, 32, generator=g).to(dtype=dtype, device=DEVICE)
    qo = torch.tensor(
        [0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE
    )
    kv_layer = cache[:, 2]
    out = paged_decode_attention(
        q,
        kv_layer,
        indptr,
        indices,
        last,
        0.17,
        num_splits,
        block_n=32,
        qo_indptr=qo,
        num_reqs=len(q_lens),
        max_q_len=max(q_lens),
    )
    ref = reference_multi(q, kv_layer, idx_list, indptr_list, seq_lens, q_lens, 0.17)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    if dtype == torch.float32 and DEVICE.type == "cuda":
        tol = dict(rtol=5e-3, atol=5e-3)
    assert out.shape == q.shape
    torch.testing.assert_close(out.float(), ref, **tol)


def test_one_query_token_per_request_is_the_decode_case() -> None:
    seq_lens = [33, 90]
    cache, q, indptr, indices, last, *_ = make_case(seq_lens, 8, 2, 32, torch.float32, seed=3)
    qo = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    decode = paged_decode_attention(q, cache[:, 0], indptr, indices, last, 0.2, 4, block_n=32)
    multi = paged_decode_attention(
        q.contiguous(),
        cache[:, 0],
        indptr,
        indices,
        last,
        0.2,
        4,
        block_n=32,
        qo_indptr=qo,
        num_reqs=2,
        max_q_len=1,
    )
    torch.testing.assert_close(multi, decode, rtol=1e-5, atol=1e-5)
    assert max_query_len(4) == 16 and max_query_len(7) == 9 and max_query_len(16) == 4
    with pytest.raises(ValueError, match="exceed 64 rows"):
        paged_decode_attention(
            q, cache[:, 0], indptr, indices, last, 0.2, 1, qo_indptr=qo, num_reqs=2, max_q_len=17
        )
