"""Loads of compressed blocks (``compression: lossless``): host slab -> device staging -> the
Triton decoder -> the cache blocks (``SlabCopier`` delegates here when it has a codec).

Two ways, both CUDA-asynchronous on the current stream (the loader's side stream), with the
decode kernels on a second stream so that a decode runs beside the next copy:

- ``to_device`` (async loads, lower-tier stagings): whole payloads in chunks of two 64 MiB
  staging buffers in turn; each run of consecutive slots is one copy.
- ``to_device_layers`` (in-step loads; ``layered_loads``, on by default with compression): a
  group of layers at a time (``layer_groups``). The payloads' metadata (counts, escapes,
  codebooks) comes over first, one 2-D copy per run; then for each group, its codes and low
  bytes from every block (two 2-D copies per run: a group's parts sit at a fixed offset in
  each payload) into one of two layer buffers, decoded into those layers of the cache blocks.
  One CUDA event per group, after its decode: the forward's attention of layer ``l`` waits
  only for its group's event (``KVCache.set_layer_ready``), so the forward runs while later
  groups are still on the link. The copies are DMA (``connectors.device.copy2d``), the SMs stay
  free. On the H200 a 16K prefix loads so in 38-42 ms against 42-47 whole; one layer a copy
  (16-32 KiB rows) is slower than whole payloads (docs/offload.md).

On the CPU ``to_device`` decodes straight from the slab; ``to_device_layers`` (tests, with
``force_layers``) runs the same staging steps synchronously. Not thread-safe: one caller (the engine thread).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence

import torch

from connectors.device.copy2d import copy2d, copy2d_available
from connectors.device.kv_compress import Hi4Codec, index_to_device, triton_decode_available
from connectors.device.slab_runs import ascending_runs, pad16

log = logging.getLogger(__name__)

CHUNK_BYTES = 64 << 20  # each of the two staging buffers of ``to_device``
LAYER_BYTES = 128 << 20  # each of the two layer buffers of ``to_device_layers``
MIN_ROW_BYTES = 128 << 10  # auto ``layers_per_copy``: codes rows at least this wide
MIN_TAIL_ROW_BYTES = 32 << 10  # ... and the last group tapered down to rows this wide


class StagedDecoder:
    def __init__(
        self,
        codec: Hi4Codec,
        rows: torch.Tensor,
        host: torch.Tensor,
        num_layers: int,
        *,
        layers: bool = False,
        force_layers: bool = False,
        layers_per_copy: int = 0,
    ) -> None:
        """``rows``: the cache as ``[num_blocks, raw_bytes]`` uint8; ``host``: the slab (1-D
        uint8). ``layers``: enable ``to_device_layers`` where it can run (``layered_loads``);
        ``force_layers``: run it on the CPU too (tests); ``layers_per_copy``: see
        ``layer_groups`` (0: automatic)."""
        if codec.num_segments != 2 * num_layers:
            raise ValueError(f"codec of {codec.num_segments} segments for {num_layers} layers")
        if layers_per_copy < 0:
            raise ValueError(f"layers_per_copy must be >= 0, got {layers_per_copy}")
        if codec.segment_values % 16:  # the layer buffers' parts must stay 16-byte aligned
            force_layers = layers = False
        self.layers_per_copy = layers_per_copy
        self.codec = codec
        self.num_layers = num_layers
        self._rows = rows
        self._host = host
        self._cuda = rows.is_cuda
        self._layers_ok = force_layers or (
            layers
            and self._cuda
            and host.is_pinned()
            and copy2d_available()
            and triton_decode_available()
        )
        self._staging: torch.Tensor | None = None
        self._stream: object | None = None  # CUDA: the decode stream

    @property
    def layered(self) -> bool:
        """Whether ``to_device_layers`` runs (CUDA with Triton and the driver's 2-D copies,
        a pinned slab; or ``force_layers``)."""
        return self._layers_ok

    # -- shared ----------------------------------------------------------------------------

    def _buffer(self, nbytes: int) -> torch.Tensor:
        if self._staging is None or self._staging.numel() < nbytes:
            self._staging = None  # drop the old one first
            self._staging = torch.empty(pad16(nbytes), dtype=torch.uint8, device=self._rows.device)
        return self._staging

    def _decoder_stream(self) -> object:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self._rows.device)
        return self._stream

    # -- whole payloads --------------------------------------------------------------------

    def to_device(self, block_ids: Sequence[int], offsets: Sequence[int]) -> None:
        """Decode the payloads at slab ``offsets`` into cache blocks ``block_ids``."""
        codec = self.codec
        codec_bytes = codec.payload_bytes
        if not self._cuda:
            codec.decode_into(self._host, offsets, self._rows, block_ids)
            return
        if not block_ids:
            return
        cap = max(CHUNK_BYTES, pad16(codec_bytes))
        buffers = self._buffer(2 * cap).split(cap)
        chunks = staging_plan(offsets, codec_bytes, cap)
        at = [a for _, entries in chunks for a, _ in entries]
        ids = [block_ids[j] for _, entries in chunks for _, j in entries]
        bases = codec.payload_bases(at)
        codec.check(cap, bases, ids, self._rows.shape[0], 0, codec.num_segments)
        index = codec.decode_index(bases, ids, self._rows.device)
        current = torch.cuda.current_stream(self._rows.device)
        decoder = self._decoder_stream()
        decoder.wait_stream(current)  # type: ignore[attr-defined]
        index.record_stream(decoder)  # type: ignore[arg-type]
        free: list[object | None] = [None, None]  # a buffer's last decode, done
        k0 = 0
        for c, (copies, entries) in enumerate(chunks):
            buf = buffers[c % 2]
            if free[c % 2] is not None:
                current.wait_event(free[c % 2])
            for dst, src, span in copies:
                buf[dst : dst + span].copy_(self._host[src : src + span], non_blocking=True)
            k1 = k0 + len(entries)
            free[c % 2] = self._decode_after_copy(
                current, decoder, buf, index[:, k0:k1], 0, codec.num_segments
            )
            k0 = k1
        current.wait_stream(decoder)

    def _decode_after_copy(
        self,
        current: object | None,
        decoder: object | None,
        src: torch.Tensor,
        index: torch.Tensor,
        first: int,
        count: int,
    ) -> object | None:
        """CUDA: the decoder stream waits for the copies enqueued so far, decodes, records an
        event (returned). CPU (``current`` None): decodes at once, returns None."""
        if current is None:
            self.codec.decode_indexed(src, index, self._rows, first, count)
            return None
        copied = torch.cuda.Event()
        copied.record(current)  # type: ignore[arg-type]
        decoder.wait_event(copied)  # type: ignore[union-attr]
        with torch.cuda.stream(decoder):  # type: ignore[arg-type]
            self.codec.decode_indexed(src, index, self._rows, first, count)
        done = torch.cuda.Event()
        done.record(decoder)  # type: ignore[arg-type]
        return done

    # -- layer by layer --------------------------------------------------------------------

    def layer_groups(self) -> list[tuple[int, int]]:
        """The ``[first, end)`` layers each layer-wise copy moves. ``layers_per_copy`` of them;
        or (0, automatic) the fewest that make a codes row of ``MIN_ROW_BYTES`` (2-D DMA over
        narrow rows runs below the link's speed, docs/offload.md), the last such group halved to
        rows of ``MIN_TAIL_ROW_BYTES`` (what lands last is what the forward waits for at the
        end: its own layers only)."""
        n, m = self.num_layers, self.codec.segment_values
        per = max(1, min(n, self.layers_per_copy or -(-MIN_ROW_BYTES // m)))
        tail = per if self.layers_per_copy else max(1, min(per, -(-MIN_TAIL_ROW_BYTES // m)))
        sizes: list[int] = []
        left = min(per, n)  # the last group, halved: 8 -> 4, 2, 2
        while left > tail:
            sizes.append(left - left // 2)
            left //= 2
        sizes.append(left)
        front = n - min(per, n)
        sizes = [front % per] * bool(front % per) + [per] * (front // per) + sizes
        return list(itertools.pairwise(itertools.accumulate(sizes, initial=0)))

    def to_device_layers(self, block_ids: Sequence[int], offsets: Sequence[int]) -> list[object]:
        """Like ``to_device``, a group of layers at a time (``layer_groups``); returns one CUDA
        event per layer, recorded after its group's decode (the last one with timing; CPU:
        ``[]``, done on return)."""
        self._require_layer_loads()
        codec = self.codec
        n, m, meta = len(block_ids), codec.segment_values, codec.offsets["codes"]
        if n == 0:
            return []
        groups = self.layer_groups()
        widths = sorted({b - a for a, b in groups})  # layers a staging row holds
        runs = ascending_runs(offsets, codec.payload_bytes)
        order = [j for _, _, js in runs for j in js]  # staging row -> index into block_ids
        ids = [block_ids[j] for j in order]
        if min(ids) < 0 or max(ids) >= self._rows.shape[0]:
            raise ValueError(f"block id out of range [0, {self._rows.shape[0]})")
        meta_size = pad16(n * meta)
        buf_size = pad16(max(LAYER_BYTES, 3 * m * widths[-1]))
        staging = self._buffer(meta_size + 2 * buf_size)
        current = torch.cuda.current_stream(self._rows.device) if self._cuda else None
        try:  # first, so that the link is busy while the rest is set up
            self._copy_meta(runs, staging)
        except RuntimeError:  # the driver refused a 2-D copy: whole payloads from now on
            if current is None:
                raise
            return self._whole_payloads(block_ids, offsets, current)
        index, rows, cols = self._layer_index(ids, widths, meta_size, buf_size)
        decoder = None
        if current is not None:
            decoder = self._decoder_stream()
            decoder.wait_stream(current)  # type: ignore[attr-defined]
            index.record_stream(decoder)  # type: ignore[arg-type]
        events: list[object] = []
        free: list[object | None] = [None, None]
        c = 0
        for a, b in groups:
            w = b - a
            for r0 in range(0, n, rows[w]):
                p = c % 2
                if free[p] is not None:
                    current.wait_event(free[p])  # type: ignore[union-attr]
                r1 = min(n, r0 + rows[w])
                self._copy_layers(
                    runs, staging, meta_size + p * buf_size, rows[w] * w * m, (a, b), (r0, r1)
                )
                k = cols[p, w]
                free[p] = self._decode_after_copy(
                    current, decoder, staging, index[:, k + r0 : k + r1], 2 * a, 2 * w
                )
                c += 1
            if decoder is not None:
                event = torch.cuda.Event(enable_timing=b == self.num_layers)
                event.record(decoder)  # type: ignore[arg-type]
                events.extend([event] * w)
        if decoder is not None:
            current.wait_stream(decoder)  # type: ignore[union-attr]  # staging reused next load
        return events

    def _require_layer_loads(self) -> None:
        """Raises ValueError unless this engine can load layer by layer."""
        if not self._layers_ok:
            raise ValueError(
                "layer-wise loads of compressed blocks need CUDA, Triton, the "
                "driver's 2-D copies and a pinned slab"
            )

    def _whole_payloads(
        self, block_ids: Sequence[int], offsets: Sequence[int], current: object
    ) -> list[object]:
        """Layer-wise loads are off for this engine (the driver refused a 2-D copy): the
        blocks' whole payloads with ``to_device``, one event for every layer."""
        log.exception("layer-wise loads of compressed blocks are off for this engine")
        self._layers_ok = False
        self.to_device(block_ids, offsets)
        event = torch.cuda.Event(enable_timing=True)
        event.record(current)  # type: ignore[arg-type]
        return [event] * self.num_layers

    def _layer_index(
        self, ids: list[int], widths: list[int], meta_size: int, buf_size: int
    ) -> tuple[torch.Tensor, dict[int, int], dict[tuple[int, int], int]]:
        """One decode index for every (layer buffer, group width), on the device; with the
        staging rows each width's buffer holds (``rows[w]``) and where each (buffer, width)'s
        columns begin in the index (``cols[p, w]``). Staging row r of a group of w layers sits
        at r % rows[w] of its buffer: codes (w * M bytes) from ``base``, low bytes (2 * w * M)
        after all the codes rows; rows[w] * 3 * w * M fits the buffer and M, the metadata size
        and the bases are multiples of 16 (``__init__``), which is all ``Hi4Codec.check``
        would verify."""
        n, m, meta = len(ids), self.codec.segment_values, self.codec.offsets["codes"]
        rows: dict[int, int] = {w: max(1, min(n, buf_size // (3 * m * w))) for w in widths}
        cols: dict[tuple[int, int], int] = {}
        r = torch.arange(n, dtype=torch.int64)
        block = torch.tensor(ids, dtype=torch.int64)
        parts = []
        for p in range(2):
            base = meta_size + p * buf_size
            for w in widths:
                cols[p, w] = len(parts) * n
                k = r % rows[w]
                parts.append(
                    torch.stack(
                        (
                            r * meta,
                            base + k * (w * m),
                            base + rows[w] * w * m + k * (2 * w * m),
                            block,
                        )
                    )
                )
        return index_to_device(torch.cat(parts, 1), self._rows.device), rows, cols

    def _copy_meta(self, runs: list[tuple[int, int, list[int]]], staging: torch.Tensor) -> None:
        meta = self.codec.offsets["codes"]
        row = 0
        for first, pitch, js in runs:
            copy2d(staging, row * meta, meta, self._host, first, pitch, meta, len(js))
            row += len(js)

    def _copy_layers(
        self,
        runs: list[tuple[int, int, list[int]]],
        staging: torch.Tensor,
        base: int,
        low_at: int,
        layers: tuple[int, int],
        rows: tuple[int, int],
    ) -> None:
        """The codes and low bytes of ``layers`` ``[a, b)`` of staging rows ``[g0, g1)`` into
        the layer buffer at ``base``: codes rows of ``(b - a) * M`` bytes, then from
        ``base + low_at`` low rows of twice that."""
        off, m = self.codec.offsets, self.codec.segment_values
        (a, b), (g0, g1) = layers, rows
        row_m = (b - a) * m
        r0 = 0
        for first, pitch, js in runs:
            lo, hi = max(g0, r0), min(g1, r0 + len(js))
            if lo < hi:
                src = first + (lo - r0) * pitch
                copy2d(
                    staging,
                    base + (lo - g0) * row_m,
                    row_m,
                    self._host,
                    src + off["codes"] + a * m,
                    pitch,
                    (b - a) * m,
                    hi - lo,
                )
                copy2d(
                    staging,
                    base + low_at + (lo - g0) * 2 * row_m,
                    2 * row_m,
                    self._host,
                    src + off["low"] + 2 * a * m,
                    pitch,
                    2 * (b - a) * m,
                    hi - lo,
                )
            r0 += len(js)


def staging_plan(
    offsets: Sequence[int], nbytes: int, cap: int
) -> list[tuple[list[tuple[int, int, int]], list[tuple[int, int]]]]:
    """Cut the payloads at ``offsets`` into chunks that fit a ``cap``-byte staging buffer:
    per chunk, the copies ``(staging offset, host offset, bytes)`` (a run of slots at a
    constant stride is one copy, ``ascending_runs``) and the payloads ``(staging offset,
    index into offsets)``."""
    chunks: list[tuple[list[tuple[int, int, int]], list[tuple[int, int]]]] = [([], [])]
    used = 0
    for first, step, js in ascending_runs(offsets, nbytes):
        i = 0
        while i < len(js):
            if used + nbytes > cap:
                chunks.append(([], []))
                used = 0
            fit = min(len(js) - i, (cap - used - nbytes) // step + 1)
            span = (fit - 1) * step + nbytes
            copies, entries = chunks[-1]
            copies.append((used, first + i * step, span))
            entries.extend((used + k * step, js[i + k]) for k in range(fit))
            used += pad16(span)
            i += fit
    return chunks
