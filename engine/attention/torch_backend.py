"""Reference attention backend in plain torch: exact on CPU in float32, device-agnostic.

For each request it gathers the request's blocks from the layer view, so it reads the KV back
through the same paging path a real kernel would, and computes softmax attention in float32
with a causal mask aligned to the end of the context. GQA: query head ``h`` reads KV head
``h // (num_heads // num_kv_heads)``, as the checkpoints expect. Meant for correctness and
CPU serving, not speed (one small matmul per request per layer).
"""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata, write_kv


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self._meta: AttentionMetadata | None = None
        self._masks: list[torch.Tensor | None] = []

    @property
    def slot_mapping(self) -> torch.Tensor | None:
        return None if self._meta is None else self._meta.slot_mapping

    def plan(self, metadata: AttentionMetadata) -> None:
        """Precompute each request's causal mask once for all layers."""
        self._meta = metadata
        self._masks = []
        device = metadata.slot_mapping.device
        for q_len, seq_len in zip(metadata.query_lens_cpu, metadata.seq_lens_cpu, strict=True):
            if q_len == 1:
                self._masks.append(None)  # a decode token sees the whole context
                continue
            # Query row r sits at position seq_len - q_len + r and sees keys 0..that position.
            q_pos = torch.arange(seq_len - q_len, seq_len, device=device).unsqueeze(1)
            k_pos = torch.arange(seq_len, device=device).unsqueeze(0)
            self._masks.append(k_pos <= q_pos)

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: torch.Tensor,
        kv_written: bool = False,
    ) -> torch.Tensor:
        meta = self._meta
        if meta is None:
            raise RuntimeError("TorchAttentionBackend.forward called before plan()")
        if not kv_written:
            write_kv(kv_layer, meta.slot_mapping, k, v)
        num_tokens = q.shape[0]
        out = torch.empty(num_tokens, self.num_heads, self.head_dim, dtype=q.dtype, device=q.device)
        group = self.num_heads // self.num_kv_heads
        bs = meta.block_size
        start = 0
        for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
            num_blocks = -(-seq_len // bs)
            blocks = meta.block_tables[i, :num_blocks].long()
            kv = kv_layer[blocks]  # [nb, 2, bs, Hkv, D] gathered copy
            keys = kv[:, 0].reshape(num_blocks * bs, self.num_kv_heads, self.head_dim)[:seq_len]
            vals = kv[:, 1].reshape(num_blocks * bs, self.num_kv_heads, self.head_dim)[:seq_len]
            # [Hkv, group, q_len, D] x [Hkv, 1, D, seq_len] -> [Hkv, group, q_len, seq_len]
            qi = q[start : start + q_len].float().reshape(q_len, self.num_kv_heads, group, self.head_dim)
            qi = qi.permute(1, 2, 0, 3)
            kt = keys.float().permute(1, 2, 0).unsqueeze(1)
            scores = torch.matmul(qi, kt) * self.scale
            mask = self._masks[i]
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            vi = vals.float().permute(1, 0, 2).unsqueeze(1)  # [Hkv, 1, seq_len, D]
            oi = torch.matmul(probs, vi)  # [Hkv, group, q_len, D]
            out[start : start + q_len] = oi.permute(2, 0, 1, 3).reshape(q_len, self.num_heads, self.head_dim).to(q.dtype)
            start += q_len
        return out.view(num_tokens, self.num_heads * self.head_dim)
