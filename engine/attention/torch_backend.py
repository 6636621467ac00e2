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
index, the new tokens' (block, offset) write positions, and for a decode-only step one padded
block index and key-padding mask, so each layer runs ONE gather and ONE SDPA call for the
whole batch instead of one per request. A decode step's query heads go in as rows of their
KV head (``[B, Hkv, group, D]``, no ``enable_gqa``). SmolLM2's shapes, one thread, a batch of
8 at 160 tokens: 284 us a layer against 663 us for the per-request gather of whole blocks
with ``enable_gqa``.

On the CPU in float32, a prompt chunk goes through the C kernel of
``engine/kernels/cpu_prefill.py`` where it is built and the head dim is a multiple of 64
(SmolLM2, one thread, a 1,024-token prompt's 30 layers: 0.50 against 0.62-0.65 s for the
products below, interleaved in one engine). Otherwise a chunk of ``GEMM_MIN_QUERIES`` to
``GEMM_MAX_KEYS`` tokens goes through ``causal_gemm_attention`` instead of torch's flash kernel (one thread, SmolLM2's
shapes, a layer of a 512-token prompt 6.4 against 8.6 ms, 1,024 tokens 20.7 against 22.5;
equal at 2,048, where a chunk's scores no longer fit the core's cache). Its GEMMs go through
oneDNN where it is built in (``_linear_pointwise``, the key or value rows as the weight): on
this AMD core MKL's sgemm reaches ~65 GFLOP/s on these thin products, oneDNN ~75-85; a
1,024-token layer 24.7 against 26.2 ms (medians, interleaved, busy machine).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.kernels import cpu_decode, cpu_prefill

# The prompt chunks causal_gemm_attention takes on the CPU (module docstring).
GEMM_MIN_QUERIES = 128
GEMM_MAX_KEYS = 1536
GEMM_CHUNK = 128  # query positions per pair of GEMMs
# From this many keys on, a chunk's two products go through oneDNN, below it through MKL, whose
# small products can be faster (one thread, 384 x 256 scores once 80 against 66 GFLOP/s); a
# 1,024-token SmolLM2 layer took within 2% with a bound of 0, 256 or 512.
ONEDNN_MIN_KEYS = 256
# The softmax written over its input (the lastdim kernel reads each row before it writes it).
_softmax_out = torch.ops.aten._softmax.out


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _mm_nt(a: torch.Tensor, b: torch.Tensor, onednn: bool) -> torch.Tensor:
    """``a @ b.T`` for float32 CPU matrices. ``onednn``: as a oneDNN inner product (``b`` is
    its weight, reordered per call), whose AVX-512 kernels run this VM's AMD core at ~85
    GFLOP/s on the attention's shapes where MKL's sgemm reaches ~65 (module docstring)."""
    if onednn:
        return torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")
    return torch.mm(a, b.t())


def causal_gemm_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    chunk: int = GEMM_CHUNK,
    onednn: bool | None = None,
) -> torch.Tensor:
    """Causal attention of the last ``T`` positions ``q [T, H, D]`` over keys/values
    ``[S, Hkv, D]`` (``S >= T``: query row ``r`` sits at ``S - T + r`` and sees keys up to
    it), returned as ``[T, H * D]``, by two GEMMs and a softmax per ``chunk`` of query
    positions and KV head: the chunk's ``H // Hkv`` query heads are rows of one GEMM against
    their keys (no GQA expansion), the keys stop at the chunk's last position (no work above
    the diagonal but inside the chunk's own block, which a ``-inf`` triangle masks), and the
    scale is folded into the keys (one multiply over ``Hkv`` heads, not ``H``); the softmax
    runs in place on the scores. ``out``: a contiguous ``[T, H, D]`` or ``[T, H * D]`` tensor
    to write into (returned, viewed). ``onednn``: the GEMMs through oneDNN when the product
    has at least ``ONEDNN_MIN_KEYS`` keys (None: wherever oneDNN is built in), else MKL."""
    num_q, num_heads, dim = q.shape
    num_keys, num_kv_heads = k.shape[0], k.shape[1]
    group = num_heads // num_kv_heads
    offset = num_keys - num_q
    if onednn is None:
        onednn = _onednn_available()
    # Each KV head's query rows contiguous ([Hkv, T * group, D]): one copy, not one a chunk.
    qh = torch.empty(num_kv_heads, num_q, group, dim, dtype=q.dtype)
    qh.copy_(q.reshape(num_q, num_kv_heads, group, dim).transpose(0, 1))
    kh = torch.empty(num_kv_heads, num_keys, dim, dtype=k.dtype)
    torch.mul(k.transpose(0, 1), scale, out=kh)
    vh = v.transpose(0, 1).contiguous()
    if out is None:
        out = torch.empty(num_q, num_heads * dim, dtype=q.dtype)
    rows = out.view(num_q, num_kv_heads, group, dim)
    above = torch.full((chunk, chunk), float("-inf"), dtype=q.dtype).triu_(1).unsqueeze(1)
    for h in range(num_kv_heads):
        q_rows = qh[h].view(num_q * group, dim)
        for s in range(0, num_q, chunk):
            e = min(s + chunk, num_q)
            n, last = e - s, offset + e  # keys [0, last) for this chunk
            dnn = onednn and last >= ONEDNN_MIN_KEYS
            scores = _mm_nt(q_rows[s * group : e * group], kh[h, :last], dnn)
            scores.view(n, group, last)[:, :, last - n :].add_(above[:n, :, :n])
            _softmax_out(scores, -1, False, out=scores)
            # oneDNN's weight is [D, last] with strides (1, D): a prefix of rows of a [D, S]
            # copy instead (strides (S, 1)) took it 250x longer.
            vals = _mm_nt(scores, vh[h, :last].t(), True) if dnn else torch.mm(scores, vh[h, :last])
            rows[s:e, h] = vals.view(n, group, dim)
    return out.view(num_q, num_heads * dim)


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
        # The same on the CPU for engine/kernels/cpu_decode.py: tables, lengths, the new
        # tokens' slots, scratch.
        self._cpu_decode: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = (
            None
        )
        self._cpu_prefill = False  # this step's CPU prompt chunks through cpu_prefill's kernel

    def bind(self, kv_dtype: torch.dtype, device: torch.device) -> None:
        """A float32 cache on the CPU: the C decode and prefill kernels are compiled now (~0.5 s
        each, once a machine: cached on disk), not inside a first request's step."""
        if device.type == "cpu" and kv_dtype == torch.float32:
            cpu_decode.enabled()
            cpu_prefill.enabled()

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
        self._cpu_decode = None
        self._cpu_prefill = device.type == "cpu" and cpu_prefill.enabled()
        if all(q == 1 for q in metadata.query_lens_cpu):
            width = max(num_blocks)
            lens = metadata.seq_lens.to(torch.int64).contiguous()
            seq_lens = lens.view(-1, 1, 1, 1)
            keys_pos = torch.arange(width * bs, device=device).view(1, 1, 1, -1)
            # Additive, in float32 (the SDPA below runs in float32): a boolean mask is turned
            # into this inside every layer's call (SmolLM2's batch-8 decode: ~9 us a layer).
            past = keys_pos >= seq_lens  # [B, 1, 1, keys]
            additive = torch.zeros(past.shape, device=device).masked_fill_(past, float("-inf"))
            self._batch_decode = (tables[:, :width], additive)
            if device.type == "cpu" and cpu_decode.enabled():
                self._cpu_decode = (
                    tables[:, :width].contiguous(),
                    lens,
                    slots.to(torch.int64).contiguous(),
                    torch.empty(self.num_heads * width * bs),
                )
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
        if (
            self._cpu_decode is not None
            and q.dtype == kv_layer.dtype == torch.float32
            and kv_layer[0].is_contiguous()
        ):
            # the paged cache read in place, this step's keys and values written by the same
            # call (engine/kernels/cpu_decode.py)
            c_tables, lens, c_slots, scratch = self._cpu_decode
            num_reqs = c_tables.shape[0]
            new_kv = None
            if not kv_written:
                shape = (num_reqs, self.num_kv_heads, self.head_dim)
                new_kv = (
                    k.reshape(shape).float().contiguous(),
                    v.reshape(shape).float().contiguous(),
                    c_slots,
                )
            return cpu_decode.decode_attention(
                q.reshape(num_reqs, self.num_heads, self.head_dim).contiguous(),
                kv_layer,
                c_tables,
                lens,
                self.scale,
                scratch,
                new_kv,
            )
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
        for i, (q_len, seq_len) in enumerate(
            zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)
        ):
            if q_len == seq_len and not kv_written:
                # No cached context: the keys are this step's, already at hand (the write
                # above stored these very values in the cache's dtype): no gather.
                keys = k[start : start + q_len].to(kv_layer.dtype)
                vals = v[start : start + q_len].to(kv_layer.dtype)
            else:
                keys, vals = self._gather(kv_layer, self._blocks[i], 1)
                keys, vals = keys[0, :seq_len], vals[0, :seq_len]  # [seq, Hkv, D]
            q_rows = q[start : start + q_len]
            if self._cpu_prefill and q_len > 1 and cpu_prefill.supports(q_rows, keys, vals):
                cpu_prefill.prefill_attention(
                    q_rows, keys, vals, self.scale, out[start : start + q_len]
                )
                start += q_len
                continue
            if (
                GEMM_MIN_QUERIES <= q_len
                and seq_len <= GEMM_MAX_KEYS
                and q.device.type == "cpu"
                and q.dtype == keys.dtype == torch.float32
            ):
                causal_gemm_attention(
                    q[start : start + q_len], keys, vals, self.scale, out[start : start + q_len]
                )
                start += q_len
                continue
            qi = q[start : start + q_len].float().transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
            ki = keys.float().transpose(0, 1).unsqueeze(0)  # [1, Hkv, seq, D]
            vi = vals.float().transpose(0, 1).unsqueeze(0)
            mask = self._masks[i]
            oi = F.scaled_dot_product_attention(
                qi,
                ki,
                vi,
                attn_mask=mask if mask is not None and q_len != seq_len else None,
                is_causal=q_len == seq_len and q_len > 1,
                scale=self.scale,
                enable_gqa=group > 1,
            )  # [1, H, q_len, D]
            out[start : start + q_len] = oi[0].transpose(0, 1).to(q.dtype)
            start += q_len
        return out.view(num_tokens, self.num_heads * self.head_dim)

    def _gather(
        self, kv_layer: torch.Tensor, block_ids: torch.Tensor, num_reqs: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``block_ids`` (``[num_reqs * nb]`` flat, request-major) as
        ``[num_reqs, nb * block_size, Hkv, D]`` each: one ``index_select`` per half, whose
        contiguous result reshapes for free (indexing the whole layer, then slicing k and v
        out of it, copied everything twice more: 2.4x slower for a batch of 8)."""
        flat = block_ids.reshape(-1)
        shape = (num_reqs, -1, self.num_kv_heads, self.head_dim)
        keys = kv_layer[:, 0].index_select(0, flat).view(shape)
        vals = kv_layer[:, 1].index_select(0, flat).view(shape)
        return keys, vals

    def _decode_batch(self, q: torch.Tensor, kv_layer: torch.Tensor) -> torch.Tensor:
        """One query row per request, all requests in one SDPA call over their blocks
        gathered side by side, padded to the longest and masked past each one's length.
        The ``group`` query heads that share a KV head go in as ``group`` query rows of
        that head (one position, so no causal mask among them): no GQA expansion."""
        assert self._batch_decode is not None
        tables, mask = self._batch_decode
        num_reqs = tables.shape[0]
        keys, vals = self._gather(kv_layer, tables, num_reqs)
        group = self.num_heads // self.num_kv_heads
        qb = q.float().view(num_reqs, self.num_kv_heads, group, self.head_dim)
        out = F.scaled_dot_product_attention(
            qb,
            keys.float().transpose(1, 2),
            vals.float().transpose(1, 2),
            attn_mask=mask,
            scale=self.scale,
        )  # [B, Hkv, group, D]: head h = kv head h // group, row h % group
        return out.to(q.dtype).reshape(num_reqs, self.num_heads * self.head_dim)
