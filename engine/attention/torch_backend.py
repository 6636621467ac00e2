"""Reference attention backend in plain torch: exact on CPU in float32, device-agnostic.

For each request it gathers the request's blocks from the layer view, so it reads the KV back
through the same paging path a real kernel would, and computes softmax attention in float32
with a causal mask aligned to the end of the context, through
``torch.nn.functional.scaled_dot_product_attention`` on 4-D ``[1, H, T, D]`` tensors with
``enable_gqa`` (query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``, as the
checkpoints expect): ``is_causal`` when the query spans the whole sequence, no mask for one
query token, a boolean mask for a chunk after cached context. The 4-D call takes PyTorch's
fused CPU kernel (one 1500-token layer of a 135M model: 28.5 against 201.6 ms for matmul +
softmax + mask); 3-D inputs miss it.

Per step, ``plan`` does everything the layers share: the causal masks, each request's block
index, the new tokens' (block, offset) write positions, and for a decode-only batch of
several requests one padded gather index and key-padding mask, so each layer runs ONE
gather and ONE SDPA call for the whole batch instead of one per request (a CPU decode step
is otherwise dominated by per-request op dispatch: 8 requests x 30 layers x ~8 ops).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812

from engine.attention.base import AttentionBackend, AttentionMetadata


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self._meta: AttentionMetadata | None = None
        self._masks: list[torch.Tensor | None] = []
        self._blocks: list[torch.Tensor] = []  # per request: its block ids (int64)
        self._write_at: tuple[torch.Tensor, torch.Tensor] | None = None  # (blocks, offsets)
        # Decode-only batches of > 1 request: [B, max_blocks] block ids, [B, 1, 1, S] mask.
        self._batch_decode: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def slot_mapping(self) -> torch.Tensor | None:
        return None if self._meta is None else self._meta.slot_mapping

    def plan(self, metadata: AttentionMetadata) -> None:
        """Precompute, once for all layers, what the layers share (see the module docstring)."""
        self._meta = metadata
        self._masks = []
        device = metadata.slot_mapping.device
        bs = metadata.block_size
        slots = metadata.slot_mapping
        self._write_at = (torch.div(slots, bs, rounding_mode="floor"), slots % bs)
        tables = metadata.block_tables.long()
        num_blocks = [-(-n // bs) for n in metadata.seq_lens_cpu]
        self._blocks = [tables[i, :n] for i, n in enumerate(num_blocks)]
        self._batch_decode = None
        if len(num_blocks) > 1 and all(q == 1 for q in metadata.query_lens_cpu):
            width = max(num_blocks)
            seq_lens = metadata.seq_lens.to(torch.int64).view(-1, 1, 1, 1)
            keys_pos = torch.arange(width * bs, device=device).view(1, 1, 1, -1)
            self._batch_decode = (tables[:, :width], keys_pos < seq_lens)
            return
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
        if meta is None or self._write_at is None:
            raise RuntimeError("TorchAttentionBackend.forward called before plan()")
        if not kv_written:
            blocks, offsets = self._write_at
            # One scatter for k and v: [T, 2, Hkv, D] at (block, :, offset).
            kv_layer[blocks, :, offsets] = torch.stack((k, v), dim=1).to(kv_layer.dtype)
        if self._batch_decode is not None:
            return self._decode_batch(q, kv_layer)
        num_tokens = q.shape[0]
        out = torch.empty(num_tokens, self.num_heads, self.head_dim, dtype=q.dtype, device=q.device)
        group = self.num_heads // self.num_kv_heads
        start = 0
        for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
            kv = kv_layer[self._blocks[i]]  # [nb, 2, bs, Hkv, D] gathered copy
            keys = kv[:, 0].reshape(-1, self.num_kv_heads, self.head_dim)[:seq_len]
            vals = kv[:, 1].reshape(-1, self.num_kv_heads, self.head_dim)[:seq_len]
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

    def _decode_batch(self, q: torch.Tensor, kv_layer: torch.Tensor) -> torch.Tensor:
        """One query row per request, all requests in one SDPA call over their blocks
        gathered side by side, padded to the longest and masked past each one's length."""
        assert self._batch_decode is not None
        tables, mask = self._batch_decode
        num_reqs, width = tables.shape
        kv = kv_layer[tables]  # [B, nb, 2, bs, Hkv, D] gathered copy
        shape = (num_reqs, width * kv.shape[3], self.num_kv_heads, self.head_dim)
        keys = kv[:, :, 0].reshape(shape).float().transpose(1, 2)  # [B, Hkv, S, D]
        vals = kv[:, :, 1].reshape(shape).float().transpose(1, 2)
        qb = q.float().unsqueeze(2)  # [B, H, 1, D]
        out = F.scaled_dot_product_attention(
            qb, keys, vals, attn_mask=mask, scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )  # [B, H, 1, D]
        return out.to(q.dtype).reshape(num_reqs, self.num_heads * self.head_dim)
