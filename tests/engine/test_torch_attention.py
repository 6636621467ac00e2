"""The CPU attention backend (SDPA on 4-D tensors) against plain float64 softmax attention over
the same paged KV: whole prompts (causal), chunks after cached context (masked), decode rows,
GQA groups 1, 3 and 4, mixed in one step over scattered blocks."""

from __future__ import annotations

import pytest
import torch

from engine.attention.base import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend

BS = 16


def reference(
    q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [q_len, H, D] at the last q_len positions of keys/vals [seq, Hkv, D], float64."""
    q_len, heads, _ = q.shape
    seq, kv_heads, _ = keys.shape
    k = keys.double().repeat_interleave(heads // kv_heads, 1)
    v = vals.double().repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_pos = torch.arange(seq - q_len, seq).unsqueeze(1)
    scores = scores.masked_fill(torch.arange(seq).unsqueeze(0) > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 2)])
def test_sdpa_backend_matches_softmax_attention(heads: int, kv_heads: int) -> None:
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    dim, num_blocks = 32, 40
    # (query tokens, sequence length): a whole prompt, a chunk after 37 cached tokens, a decode.
    shapes = [(50, 50), (20, 57), (1, 90)]
    kv_layer = torch.randn(num_blocks, 2, BS, kv_heads, dim, generator=g)
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for _, seq in shapes:
        n = -(-seq // BS)
        tables.append(order[used : used + n])
        used += n
    width = max(len(t) for t in tables)
    q = torch.randn(sum(ql for ql, _ in shapes), heads, dim, generator=g)
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor([0, 50, 70, 71], dtype=torch.int32),
        seq_lens=torch.tensor([s for _, s in shapes], dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.zeros(q.shape[0], dtype=torch.int64),
        query_lens_cpu=[ql for ql, _ in shapes],
        seq_lens_cpu=[s for _, s in shapes],
        block_size=BS,
        block_tables_cpu=tables,
    )
    backend = TorchAttentionBackend(heads, kv_heads, dim, dim**-0.5)
    backend.plan(meta)
    out = backend.forward(0, q, q[:, :kv_heads], q[:, :kv_heads], kv_layer, kv_written=True)
    start = 0
    for (q_len, seq), table in zip(shapes, tables, strict=True):
        kv = kv_layer[torch.tensor(table)]
        keys = kv[:, 0].reshape(-1, kv_heads, dim)[:seq]
        vals = kv[:, 1].reshape(-1, kv_heads, dim)[:seq]
        want = reference(q[start : start + q_len], keys, vals, dim**-0.5).float()
        got = out[start : start + q_len].view(q_len, heads, dim)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        start += q_len


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3)])
def test_decode_batch_in_one_call_matches_per_request_attention(heads: int, kv_heads: int) -> None:
    """A decode-only step of several requests (one padded gather, one masked SDPA) gives each
    row the attention over exactly its own context, and stores each new k/v at its slot."""
    g = torch.Generator().manual_seed(7 + heads)
    dim, num_blocks = 16, 30
    seqs = [1, 17, 33, 5]  # lengths after this step: one block to three, ragged
    kv_layer = torch.randn(num_blocks, 2, BS, kv_heads, dim, generator=g)
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for seq in seqs:
        n = -(-seq // BS)
        tables.append(order[used : used + n])
        used += n
    width = max(len(t) for t in tables)
    slots = [t[(s - 1) // BS] * BS + (s - 1) % BS for t, s in zip(tables, seqs, strict=True)]
    q = torch.randn(len(seqs), heads, dim, generator=g)
    k = torch.randn(len(seqs), kv_heads, dim, generator=g)
    v = torch.randn(len(seqs), kv_heads, dim, generator=g)
    meta = AttentionMetadata(
        cu_seqlens_q=torch.arange(len(seqs) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seqs, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_lens_cpu=[1] * len(seqs),
        seq_lens_cpu=seqs,
        block_size=BS,
        block_tables_cpu=tables,
    )
    backend = TorchAttentionBackend(heads, kv_heads, dim, dim**-0.5)
    backend.plan(meta)
    out = backend.forward(0, q, k, v, kv_layer)
    for i, (seq, table) in enumerate(zip(seqs, tables, strict=True)):
        block, offset = table[(seq - 1) // BS], (seq - 1) % BS
        assert torch.equal(kv_layer[block, 0, offset], k[i])
        assert torch.equal(kv_layer[block, 1, offset], v[i])
        kv = kv_layer[torch.tensor(table)]
        keys = kv[:, 0].reshape(-1, kv_heads, dim)[:seq]
        vals = kv[:, 1].reshape(-1, kv_heads, dim)[:seq]
        want = reference(q[i : i + 1], keys, vals, dim**-0.5).float()
        torch.testing.assert_close(out[i].view(1, heads, dim), want, rtol=1e-5, atol=1e-5)
