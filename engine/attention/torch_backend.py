"""Reference attention backend in plain torch: exact on CPU in float32, device-agnostic.

For each request it gathers the request's blocks from the layer view, so it reads the KV back
through the same paging path a real kernel would, and computes softmax attention in float32
with a causal mask aligned to the end of the context, through
``torch.nn.functional.scaled_dot_product_attention`` on 4-D ``[1, H, T, D]`` tensors with
``enable_gqa`` (query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``, as the
checkpoints expect): ``is_causal`` when the query spans the whole sequence, no mask for one
query token, a boolean mask for a chunk after cached context. The 4-D call takes PyTorch's
fused CPU kernel (one 1500-token layer of a 135M model: 28.5 against 201.6 ms for matmul +
softmax + mask, issue 21); 3-D inputs miss it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812

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
            if q_len == 1 or q_len == seq_len:
                self._masks.append(None)  # a decode token sees all; a whole prompt is is_causal
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
            qi = q[start : start + q_len].float().transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
            ki = keys.float().transpose(0, 1).unsqueeze(0)  # [1, Hkv, seq, D]
            vi = vals.float().transpose(0, 1).unsqueeze(0)
            mask = self._masks[i]
            oi = F.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=mask if mask is not None and q_len != seq_len else None,
                is_causal=q_len == seq_len and q_len > 1, scale=self.scale, enable_gqa=group > 1,
            )  # [1, H, q_len, D]
            out[start : start + q_len] = oi[0].transpose(0, 1).to(q.dtype)
            start += q_len
        return out.view(num_tokens, self.num_heads * self.head_dim)
