"""Lossless compression of 2-byte KV blocks for the tiers (``compression: lossless``).

A bf16 (or fp16) value is a low byte (exponent LSB + mantissa: close to random) and a high
byte (sign + the exponent's upper bits). KV values of one layer's K or V in one block span a
few octaves, so a handful of high bytes cover almost all of them. Each block is cut into
``S = num_layers * 2`` segments (one layer's K or V: ``M = block_size * kv_heads * head_dim``
contiguous values of the block-major layout) and each segment stores:

- a 15-entry codebook of its most frequent high bytes; every value's high byte as a 4-bit code
  (two per byte; code 15 = escape);
- the escapes: up to ``E = M / 128`` (position u16, high byte u8) pairs and their count;
- the low bytes as they are.

That is 12 bits a value plus ~1.6% (Llama-3-8B shape: 2 MiB -> 1.52 MiB, 0.762x), the same
bytes back on decode (``test_kv_compress.py`` round-trips them), so outputs do not change. A
segment with more than ``E`` escapes (values spread over more than ~15 octave pairs, which
Gaussian-like KV never is) cannot be stored: ``overflowed`` says so after the fact and the
saver drops that block (counted as ``save_incompressible_blocks``; it is recomputed if needed).

Payload layout (one block, all offsets multiples of 16; ``cachestore.kv_format`` computes it)::

    count  u16[S] (padded to 16 B) | idx u16[S, E] | esc u8[S, E] | book u8[S, 16]
    codes  u8[S, M / 2] (value 2j in the low nibble, 2j + 1 in the high one) | low u8[S, M]

Encoding (save path, off the forward's critical path) is torch on any device; decoding on
CUDA is two Triton kernels reading straight from the staging buffer into the cache rows
(``engine.kernels.kv_unpack``), on the CPU the same arithmetic in torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from cachestore.kv_format import hi4_escapes, hi4_layout
from engine.kv_cache import KVCache

ESCAPE = 15  # the code that says "high byte in the escape list"
_ENCODE_ROWS = 8  # blocks encoded at a time (bounds the int64 temporaries: ~8 MiB a block)


@dataclass(frozen=True, slots=True)
class DecodeBases:
    """Where each block's parts sit in a decode source (byte offsets): ``meta`` (counts,
    escapes, codebook), ``codes`` and ``low`` of the segments being decoded."""

    meta: list[int]
    codes: list[int]
    low: list[int]


@dataclass(frozen=True, slots=True)
class Hi4Codec:
    """The lossless format for blocks of ``num_segments`` segments of ``segment_values``
    2-byte values. ``for_cache`` builds it for a KV cache."""

    num_segments: int
    segment_values: int
    _offsets: dict[str, int] = field(init=False, repr=False, compare=False)

    name = "hi4"  # in the block layout string and the key namespace: formats never mix

    def __post_init__(self) -> None:
        object.__setattr__(self, "_offsets", hi4_layout(self.num_segments, self.segment_values))

    @classmethod
    def for_cache(cls, kv_cache: KVCache) -> Hi4Codec:
        """Raises ValueError unless the cache holds 2-byte values (bf16, fp16)."""
        spec = kv_cache.spec
        if torch.empty((), dtype=spec.dtype).element_size() != 2:
            raise ValueError(
                f"kv offload: compression: lossless needs a 2-byte KV dtype (bfloat16, float16), "
                f"and this engine's is {spec.dtype}: pass --dtype bfloat16, or drop compression"
            )
        return cls(spec.num_layers * 2, spec.block_size * spec.num_kv_heads * spec.head_dim)

    # -- layout ----------------------------------------------------------------------------

    @property
    def escapes_per_segment(self) -> int:
        return hi4_escapes(self.segment_values)

    @property
    def raw_bytes(self) -> int:
        return 2 * self.num_segments * self.segment_values

    @property
    def offsets(self) -> dict[str, int]:
        """Byte offset of each part in a payload (``end``: the payload's size). Do not mutate."""
        return self._offsets

    @property
    def payload_bytes(self) -> int:
        return self.offsets["end"]

    # -- encode ----------------------------------------------------------------------------

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows``: ``[n, raw_bytes]`` uint8 (whole blocks) -> ``[n, payload_bytes]`` uint8 on
        the same device (asynchronous on CUDA: the current stream)."""
        if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] != self.raw_bytes:
            raise ValueError(
                f"encode wants [n, {self.raw_bytes}] uint8, got {tuple(rows.shape)} {rows.dtype}"
            )
        out = torch.zeros(
            (rows.shape[0], self.payload_bytes), dtype=torch.uint8, device=rows.device
        )
        for start in range(0, rows.shape[0], _ENCODE_ROWS):
            self._encode_rows(rows[start : start + _ENCODE_ROWS], out[start : start + _ENCODE_ROWS])
        return out

    def _encode_rows(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        s, m, e, off = (
            self.num_segments,
            self.segment_values,
            self.escapes_per_segment,
            self.offsets,
        )
        n, dev = rows.shape[0], rows.device
        pairs = rows.view(n * s, m, 2)  # little-endian: [..., 0] low byte, [..., 1] high byte
        high = pairs[..., 1].long()
        segs = n * s
        counts = torch.bincount(
            (high + torch.arange(segs, device=dev)[:, None] * 256).view(-1), minlength=segs * 256
        ).view(segs, 256)
        book = counts.topk(ESCAPE, dim=1).indices  # the 15 most frequent high bytes
        lut = torch.full((segs, 256), ESCAPE, dtype=torch.uint8, device=dev)
        lut.scatter_(1, book, torch.arange(ESCAPE, dtype=torch.uint8, device=dev).expand(segs, -1))
        codes = torch.gather(lut, 1, high)
        escaped = codes == ESCAPE
        count = escaped.sum(1)
        rank = escaped.cumsum(1) - 1
        col = torch.where(escaped & (rank < e), rank, e)  # column e: a bin for the rest
        idx = torch.zeros((segs, e + 1), dtype=torch.int32, device=dev)
        idx.scatter_(1, col, torch.arange(m, dtype=torch.int32, device=dev).expand(segs, -1))
        esc = torch.zeros((segs, e + 1), dtype=torch.uint8, device=dev)
        esc.scatter_(1, col, pairs[..., 1])

        def field(name: str, nbytes: int) -> torch.Tensor:
            return out[:, off[name] : off[name] + nbytes].view(n, s, -1)

        field("count", 2 * s).copy_(count.to(torch.int32).view(n, s, 1).view(torch.uint8)[..., :2])
        field("idx", 2 * s * e).copy_(
            idx[:, :e].reshape(n, s, e, 1).view(torch.uint8)[..., :2].reshape(n, s, 2 * e)
        )
        field("esc", s * e).copy_(esc[:, :e].view(n, s, e))
        book_bytes = torch.zeros((segs, 16), dtype=torch.uint8, device=dev)
        book_bytes[:, :ESCAPE] = book.to(torch.uint8)
        field("book", 16 * s).copy_(book_bytes.view(n, s, 16))
        field("codes", s * m // 2).copy_((codes[:, 0::2] | (codes[:, 1::2] << 4)).view(n, s, -1))
        field("low", s * m).copy_(pairs[..., 0].reshape(n, s, m))

    # -- decode ----------------------------------------------------------------------------

    def decode_into(
        self,
        src: torch.Tensor,
        src_offsets: Sequence[int],
        cache_rows: torch.Tensor,
        block_ids: Sequence[int],
        *,
        index: torch.Tensor | None = None,
    ) -> None:
        """Decode the payloads at byte ``src_offsets[i]`` of the 1-D uint8 ``src`` into row
        ``block_ids[i]`` of ``cache_rows`` (the cache as ``[num_blocks, raw_bytes]`` uint8).
        ``src`` must be on the cache's device. CUDA: two Triton kernels on the current stream
        when Triton runs here, else torch. ``index``: ``decode_index``'s tensor for the same
        payloads, already on the device (saves the kernels a host->device copy)."""
        self.decode_segments(
            src,
            self.payload_bases(src_offsets),
            cache_rows,
            block_ids,
            0,
            self.num_segments,
            index=index,
        )

    def payload_bases(self, offsets: Sequence[int]) -> DecodeBases:
        """The parts of whole payloads that start at ``offsets``."""
        off = self.offsets
        return DecodeBases(
            list(offsets), [o + off["codes"] for o in offsets], [o + off["low"] for o in offsets]
        )

    def decode_segments(
        self,
        src: torch.Tensor,
        bases: DecodeBases,
        cache_rows: torch.Tensor,
        block_ids: Sequence[int],
        first: int,
        count: int,
        *,
        index: torch.Tensor | None = None,
    ) -> None:
        """Decode segments ``[first, first + count)`` of each block from parts that need not
        sit together in ``src``: block ``i``'s metadata (counts, escapes, codebook: the
        payload's first ``offsets["codes"]`` bytes) at ``bases.meta[i]``, the codes of those
        segments at ``bases.codes[i]`` (``M / 2`` bytes a segment) and their low bytes at
        ``bases.low[i]`` (``M`` a segment). What a layer-wise load decodes from its staging.
        Raises ValueError on a part outside ``src``, a misaligned one or a bad block id."""
        if src.dtype != torch.uint8 or src.dim() != 1 or src.device != cache_rows.device:
            raise ValueError("src must be a 1-D uint8 tensor on the cache's device")
        if cache_rows.shape[1:] != (self.raw_bytes,) or cache_rows.dtype != torch.uint8:
            raise ValueError(f"cache_rows must be [blocks, {self.raw_bytes}] uint8")
        self.check(src.numel(), bases, block_ids, cache_rows.shape[0], first, count)
        if not block_ids:
            return
        if index is None:
            index = self.decode_index(bases, block_ids, cache_rows.device)
        self.decode_indexed(src, index, cache_rows, first, count)

    def check(
        self,
        src_bytes: int,
        bases: DecodeBases,
        block_ids: Sequence[int],
        num_rows: int,
        first: int,
        count: int,
    ) -> None:
        """Raise ValueError unless every part lies 16-byte aligned inside ``src_bytes`` and
        every block id below ``num_rows`` (what keeps the kernels in bounds)."""
        n, m, off = len(block_ids), self.segment_values, self.offsets
        if not (len(bases.meta) == len(bases.codes) == len(bases.low) == n):
            raise ValueError(f"bases for {len(bases.meta)} blocks, {n} block ids")
        if not 0 <= first < first + count <= self.num_segments:
            raise ValueError(f"segments [{first}, {first + count}) of {self.num_segments}")
        if n and (min(block_ids) < 0 or max(block_ids) >= num_rows):
            raise ValueError(f"block id out of range [0, {num_rows})")
        for starts, nbytes in (
            (bases.meta, off["codes"]),
            (bases.codes, count * m // 2),
            (bases.low, count * m),
        ):
            if any(b < 0 or b + nbytes > src_bytes or b % 16 for b in starts):
                raise ValueError(
                    "a payload part runs past the end of src or is not 16-byte aligned"
                )

    def decode_indexed(
        self,
        src: torch.Tensor,
        index: torch.Tensor,
        cache_rows: torch.Tensor,
        first: int,
        count: int,
    ) -> None:
        """``decode_segments`` after ``check``, from its ``decode_index`` (on the cache's
        device; a column slice is fine). CUDA: Triton when it runs here, else torch."""
        if cache_rows.is_cuda and _triton_decode() is not None:
            _triton_decode()(self, src, index, cache_rows, first, count)  # type: ignore[misc]
            return
        meta, codes, low, ids = index.cpu().tolist()
        for i, block in enumerate(ids):
            self._decode_torch(src, meta[i], codes[i], low[i], cache_rows[block], first, count)

    @staticmethod
    def decode_index(
        bases: DecodeBases, block_ids: Sequence[int], device: torch.device | str
    ) -> torch.Tensor:
        """The decode kernels' ``[4, n]`` int64 index (meta, codes and low bases, block id) on
        ``device`` (pinned and copied asynchronously to CUDA)."""
        index = torch.tensor(
            [bases.meta, bases.codes, bases.low, list(block_ids)], dtype=torch.int64
        )
        return index_to_device(index, device)

    def _decode_torch(
        self,
        src: torch.Tensor,
        meta: int,
        codes_at: int,
        low_at: int,
        row: torch.Tensor,
        first: int,
        count: int,
    ) -> None:
        s, m, e, off = (
            self.num_segments,
            self.segment_values,
            self.escapes_per_segment,
            self.offsets,
        )
        segs = slice(first, first + count)
        p = src[meta : meta + off["codes"]]
        book = p[off["book"] : off["codes"]].view(s, 16)[segs]
        packed = src[codes_at : codes_at + count * m // 2].view(count, m // 2)
        codes = torch.stack((packed & 15, packed >> 4), dim=-1).view(count, m).long()
        high = torch.gather(book, 1, codes)
        num = p[: 2 * s].view(s, 2).to(torch.int32)[segs]
        num = (num[:, 0] | (num[:, 1] << 8)).clamp(max=e)
        idx = p[off["idx"] : off["esc"]].view(s, e, 2).to(torch.int64)[segs]
        idx = idx[..., 0] | (idx[..., 1] << 8)
        valid = (torch.arange(e, device=src.device)[None, :] < num[:, None]) & (idx < m)
        idx = torch.where(valid, idx, m)  # column m: a bin for unused entries
        wide = torch.cat((high, high.new_zeros((count, 1))), dim=1)
        wide.scatter_(1, idx, p[off["esc"] : off["esc"] + s * e].view(s, e)[segs])
        out = row.view(s, m, 2)[segs]
        out[..., 0] = src[low_at : low_at + count * m].view(count, m)
        out[..., 1] = wide[:, :m]

    def warm(self, device: torch.device | str) -> bool:
        """Compile the decode kernels for this format now, on ``device``: Triton compiles them
        on first use, and on an H200 that first reload then took 322 ms where later ones took
        ~11 (the QA client, a 4K-token prefix): a first request pays it, and the cost model,
        measuring that outcome, refused loads for the rest of the run. Encodes one zero block
        and decodes it whole and a segment at a time (the layer-wise path). True when kernels
        ran; False off CUDA or without Triton (torch decoding: nothing to compile)."""
        if torch.device(device).type != "cuda" or _triton_decode() is None:
            return False
        rows = torch.zeros((1, self.raw_bytes), dtype=torch.uint8, device=device)
        payload = self.encode(rows).view(-1)
        out = torch.empty_like(rows)
        self.decode_into(payload, [0], out, [0])
        bases = self.payload_bases([0])
        self.decode_segments(payload, bases, out, [0], 1, 1)
        torch.cuda.synchronize(device)
        return True

    def overflowed(self, payload: memoryview | bytes) -> bool:
        """Whether an encoded payload lost escapes (a segment had more than ``E``): such a
        block must not be stored. Reads only the ``2 * S`` count bytes."""
        counts = memoryview(payload)[: 2 * self.num_segments].cast("B").cast("H")
        return max(counts) > self.escapes_per_segment


def index_to_device(index: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host decode index onto ``device`` (CUDA: pinned, copied asynchronously)."""
    if torch.device(device).type == "cuda":
        return index.pin_memory().to(device, non_blocking=True)
    return index


_TRITON_DECODE: object = None  # resolved once: the kernel wrapper, or False


def triton_decode_available() -> bool:
    """Whether the Triton decoder can be imported here."""
    return _triton_decode() is not None


def _triton_decode() -> object | None:
    global _TRITON_DECODE
    if _TRITON_DECODE is None:
        try:
            from engine.kernels.kv_unpack import decode_hi4

            _TRITON_DECODE = decode_hi4
        except ImportError:
            _TRITON_DECODE = False
    return _TRITON_DECODE or None
