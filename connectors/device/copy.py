"""Whole-block copies between the KV cache and a flat uint8 host buffer (the host tier's slab).

A block of the block-major cache is one contiguous run of ``bytes_per_block`` bytes, and a host
slot holds one encoded block whose payload is one contiguous run too, so every transfer is one
``copy_`` of ``bytes_per_block`` bytes (2 MiB for Llama-3-8B: link speed, DESIGN.md "Physics").
No staging tensor and no allocation per call: the copies read and write the slab in place.

With a CUDA cache the copies are ``non_blocking`` and go to the current stream (the caller puts
them on its side stream and records an event); the host buffer must stay untouched (pinned
entries) until that event completed. With a CPU cache they are plain synchronous memcpys.
Not thread-safe: one caller (the engine thread) at a time.

``coalesce`` (opt-in, ``coalesced_loads`` in the offload config; CUDA only): ``to_device`` finds runs of
blocks whose payloads sit at a constant stride in the slab (consecutive slots, as a prefix
saved in order gets them) and moves each run as ONE copy of the whole span (headers and
padding included) into a device staging buffer, then one ``index_copy_`` of 8-byte words
into the cache blocks. A per-block copy of 2 MiB reached 0.81x of the raw link on the H200
where one large copy plus a device scatter reached 0.96x (``KVCache.scatter_blocks``, docs/
offload.md "Session 3"); whether the runs get the same is for bench/offload/main.py "load_path"
(``coalesced`` row) to show, so it is off by default.

``layered`` with raw blocks on CUDA: ``to_device_layers`` moves the blocks a group of layers
at a time with an event per group; the forward's layers wait only for their group
(``KVCache.set_layer_ready``), so a step's compute runs under the rest of its load. A block is
layer-major (``[layers, 2, block_size, heads, dim]``), so a group of layers is one contiguous
run in the slot and in the cache row. With the driver's 2-D copies (the default),
``connectors.device.raw_layers.StagedLayers``: per group, one 2-D copy per run of consecutive
slots into device staging, then a word scatter into the cache rows on a second stream, groups
of ``STAGED_LAYERS_PER_COPY`` (4) layers unless ``layers_per_copy`` says. Copies per group =
runs, not blocks: the path before it (``staged_layers`` False; kept for bench/h2d_pieces.py)
makes one driver copy per block and group (``copy2d.copy_h2d_many``, groups of
``RAW_LAYERS_PER_COPY`` by default), and a pair of QA reloads at 8 layers a copy, 2,032 copies,
filled the driver's queue and held the engine thread 12.5 ms to issue. Without the driver
library, the Triton kernel ``engine.kernels.copy_layer_from_host`` (SMs reading pinned memory;
slower: docs/scheduling.md, fourth session). Per-block copies on CUDA go through the driver
too (``copy_h2d_many``), a few microseconds of host time each instead of ~10.

``codec`` (``compression: lossless``, ``connectors.device.kv_compress``): the slab holds encoded
payloads of ``codec.payload_bytes``. ``to_host`` encodes before copying out (callers that gather
themselves encode with the codec); ``to_device`` and ``to_device_layers`` hand the payloads to
``connectors.device.decode.StagedDecoder`` (device staging, then the Triton decoder).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from connectors.device.copy2d import copy_h2d_many, copy_many_available
from connectors.device.decode import StagedDecoder
from connectors.device.kv_compress import Hi4Codec
from connectors.device.raw_layers import StagedLayers
from connectors.device.slab_runs import ascending_runs, check_payloads
from engine.kv_cache import KVCache

STAGING_BYTES = 32 << 20  # device staging of a coalesced run, copied in chunks of this size
# Layer-wise loads of raw blocks by one driver copy per block and group (``staged_layers``
# False; the staged path's automatic size is raw_layers.STAGED_LAYERS_PER_COPY): layers one
# copy moves (0 in config). Copies past ~1,000 in flight on a stream fill the driver's queue
# and the issue waits for the copy engine (bench/h2d_pieces.py on an H200: 508 blocks in 1,016
# copies issued in 2.4 ms, in 2,032 copies in 12.5 ms), so a pair of QA reloads (~254 blocks
# each) gets two groups of a 32-layer model.
RAW_LAYERS_PER_COPY = 16


class SlabCopier:
    def __init__(
        self,
        kv_cache: KVCache,
        host: torch.Tensor,
        *,
        layered: bool = False,
        coalesce: bool = False,
        codec: Hi4Codec | None = None,
        layers_per_copy: int = 0,
        force_layers: bool = False,
        issue_ahead: int = 0,
    ) -> None:
        """``host``: a 1-D uint8 tensor (the slab). ``layered``: enable ``to_device_layers``
        where it can run. ``coalesce``: ``to_device`` moves runs of consecutive slots as one
        copy each. ``codec``: the slab holds its payloads (module docstring).
        ``force_layers``: run the staged layer-wise path on the CPU too (tests).
        ``issue_ahead``: raw blocks' staged layer-wise copies issued as the forward reaches
        that many layers before them (``StagedLayers.issue_ahead``; 0: all before it). Raises
        ValueError for anything else."""
        if host.dtype != torch.uint8 or host.dim() != 1:
            raise ValueError("host buffer must be a 1-D uint8 tensor")
        self.codec = codec
        self.nbytes = codec.payload_bytes if codec is not None else kv_cache.bytes_per_block
        self._rows = kv_cache.byte_rows()
        self._host = host
        self._non_blocking = kv_cache.device.type == "cuda"
        # CUDA only: on a CPU cache a per-block copy is already one memcpy straight into the
        # block, and the staging would add a second pass (0.41x against 0.90x of a raw copy,
        # bench/offload/main.py --quick). Tests set ``coalesce`` to run the same code on the CPU.
        self.coalesce = (
            coalesce
            and self._non_blocking
            and self.nbytes % 8 == 0
            and self.nbytes <= STAGING_BYTES
        )
        self._staging: torch.Tensor | None = None  # int64 words, allocated on first use
        spec = kv_cache.spec
        self._num_layers = spec.num_layers
        self._decoder = (
            StagedDecoder(
                codec,
                self._rows,
                host,
                spec.num_layers,
                layers=layered,
                force_layers=force_layers,
                layers_per_copy=layers_per_copy,
            )
            if codec is not None
            else None
        )
        # Raw blocks, layer-wise: the staged 2-D copies where they can run (``_staged_path``).
        staged = (
            StagedLayers(
                self._rows,
                host,
                spec.num_layers,
                self._per_block,
                layers=layered,
                force_layers=force_layers,
                layers_per_copy=layers_per_copy,
                issue_ahead=issue_ahead,
            )
            if codec is None and (layered or force_layers)
            else None
        )
        self._staged = staged if staged is not None and staged.layered else None
        self.staged_layers = True  # False: the per-block driver copies (bench/h2d_pieces.py)
        # The layer kernel's programs (``engine.kernels.copy_layer_from_host``): 0, one per
        # 8 KiB tile; > 0, that many looping over the tiles. Settable (bench/profile_gpu.py).
        self.layer_copy_programs = 0
        # Host -> device copies through the driver (module docstring); ``use_driver`` False
        # falls back to torch copies (bench/h2d_pieces.py compares the two).
        self._driver = (
            self._non_blocking and codec is None and host.is_pinned() and copy_many_available()
        )
        self.use_driver = True
        self.layers_per_copy = layers_per_copy or RAW_LAYERS_PER_COPY
        self._driver_layers = layered and self._driver
        self._words = None  # [num_blocks, words_per_block] int32 view: the layer kernel's target
        if (
            layered
            and not self._driver_layers
            and codec is None
            and self._non_blocking
            and self.nbytes % (4 * spec.num_layers) == 0
            and host.is_pinned()
            and host.data_ptr() % 16 == 0
        ):
            from engine.kernels import fused_kernels_available

            if fused_kernels_available(kv_cache.device):
                self._words = kv_cache.tensor.reshape(kv_cache.num_blocks, -1).view(torch.int32)

    @property
    def layered(self) -> bool:
        """Whether ``to_device_layers`` can run (CUDA and a pinned slab; the driver library,
        or for raw blocks without it Triton and a 16-byte aligned slab; with a codec, the
        driver's 2-D copies and Triton). With ``force_layers``, on the CPU too."""
        if self._decoder is not None:
            return self._decoder.layered
        if (staged := self._staged_path()) is not None:
            return staged.layered  # False once the driver refused a 2-D copy
        return self._driver_layers or self._words is not None

    def _staged_path(self) -> StagedLayers | None:
        """Raw blocks' staged layer-wise loads, where they can run and ``staged_layers``."""
        return self._staged if self.staged_layers else None

    @property
    def load_stages(self) -> int:
        """How many events ``to_device_layers``' layers become ready in (one per group of
        layers: ``layer_groups``; one per layer with the Triton kernel)."""
        if self._decoder is not None or self._staged_path() is not None or self._driver_layers:
            return len(self.layer_groups())
        return self._num_layers

    def layer_groups(self) -> list[tuple[int, int]]:
        """The ``[first, end)`` layers each layer-wise copy moves (raw blocks without the
        staged path: each driver copy of a block; ``layers_per_copy`` of them, 0:
        ``RAW_LAYERS_PER_COPY``)."""
        if self._decoder is not None:
            return self._decoder.layer_groups()
        if (staged := self._staged_path()) is not None:
            return staged.layer_groups()
        n, per = self._num_layers, max(1, self.layers_per_copy)
        return [(a, min(n, a + per)) for a in range(0, n, per)]

    def to_device_layers(self, block_ids: Sequence[int], offsets: Sequence[int]) -> list[object]:
        """Like ``to_device``, layer group by layer group on the current stream: staged 2-D
        copies (``raw_layers.StagedLayers``; on the CPU with ``force_layers``, synchronous,
        returning ``[]``), per-block driver copies (``layer_groups``), or without the driver
        one kernel per layer (see ``engine.kernels.copy_layer_from_host``; offsets must then
        be multiples of 16). Returns one CUDA event per layer, recorded after its group's
        copy (the last one with timing). Raises ValueError for offsets the path cannot take
        or when not ``layered``."""
        from engine.kernels import copy_layer_from_host

        if self._decoder is not None:
            return self._decoder.to_device_layers(block_ids, offsets)
        if (staged := self._staged_path()) is not None:
            return staged.to_device_layers(block_ids, offsets)
        if self._driver_layers:
            return self._driver_to_device_layers(block_ids, offsets)
        if self._words is None:
            raise ValueError("layer-wise copies need CUDA, Triton and a pinned aligned slab")
        if any(o % 16 for o in offsets):
            raise ValueError("layer-wise copies need 16-byte aligned payload offsets")
        index = torch.tensor([list(block_ids), [o // 4 for o in offsets]], dtype=torch.int64)
        index = index.pin_memory().to(self._words.device, non_blocking=True)
        chunk = self._words.shape[1] // self._num_layers
        events: list[object] = []
        last = self._num_layers - 1
        for layer in range(self._num_layers):
            copy_layer_from_host(
                self._host,
                index[1],
                self._words,
                index[0],
                layer * chunk,
                chunk,
                self.layer_copy_programs,
            )
            event = torch.cuda.Event(enable_timing=layer == last)  # the last one times the load
            event.record()
            events.append(event)
        return events

    def to_device(self, block_ids: Sequence[int], offsets: Sequence[int]) -> None:
        """Copy the payload at host byte ``offsets[i]`` into cache block ``block_ids[i]``."""
        if len(block_ids) != len(offsets):
            raise ValueError(f"{len(block_ids)} blocks for {len(offsets)} offsets")
        if self._decoder is not None:
            self._decoder.to_device(block_ids, offsets)
            return
        if not self.coalesce:
            self._per_block(block_ids, offsets)
            return
        for first, stride, js in ascending_runs(offsets, self.nbytes):
            ids = [block_ids[j] for j in js]  # descending slots (a prefix saved tail first) too
            if len(js) == 1:
                self._per_block(ids, [first])
            else:
                self._run(ids, first, stride)

    def _addresses(
        self, block_ids: Sequence[int], offsets: Sequence[int]
    ) -> tuple[list[int], list[int]]:
        """Device addresses of the blocks' rows and host addresses of the payloads, checked
        against both buffers (ValueError)."""
        rows = self._rows
        check_payloads(block_ids, offsets, rows.shape[0], self.nbytes, self._host.numel())
        base, stride, src = rows.data_ptr(), rows.stride(0), self._host.data_ptr()
        return [base + b * stride for b in block_ids], [src + o for o in offsets]

    def _driver_to_device_layers(
        self, block_ids: Sequence[int], offsets: Sequence[int]
    ) -> list[object]:
        """``to_device_layers`` by driver copies: group after group (``layer_groups``), every
        block's slice of the group, then the group's event."""
        dsts, srcs = self._addresses(block_ids, offsets)
        per_layer = self.nbytes // self._num_layers
        device = self._rows.device
        events: list[object] = []
        for a, b in self.layer_groups():
            skip = a * per_layer
            copy_h2d_many(
                [d + skip for d in dsts], [s + skip for s in srcs], (b - a) * per_layer, device
            )
            event = torch.cuda.Event(enable_timing=b == self._num_layers)  # the last times it
            event.record()
            events.extend([event] * (b - a))
        return events

    def _per_block(self, block_ids: Sequence[int], offsets: Sequence[int]) -> None:
        if self._driver and self.use_driver:
            dsts, srcs = self._addresses(block_ids, offsets)
            copy_h2d_many(dsts, srcs, self.nbytes, self._rows.device)
            return
        rows, host, n, nb = self._rows, self._host, self.nbytes, self._non_blocking
        for block_id, offset in zip(block_ids, offsets, strict=True):
            rows[block_id].copy_(host[offset : offset + n], non_blocking=nb)

    def _run(self, block_ids: Sequence[int], first: int, stride: int) -> None:
        """Blocks whose payloads start at ``first + i * stride``: one host copy of each chunk's
        span into the staging buffer, then one word scatter into the cache rows."""
        n, nb = self.nbytes, self._non_blocking
        if self._staging is None:
            self._staging = torch.empty(
                STAGING_BYTES // 8, dtype=torch.int64, device=self._rows.device
            )
        staged_bytes = self._staging.view(torch.uint8)
        words = self._rows.view(torch.int64)
        per_chunk = max(1, (STAGING_BYTES - n) // stride + 1)
        for c in range(0, len(block_ids), per_chunk):
            ids = block_ids[c : c + per_chunk]
            span = (len(ids) - 1) * stride + n
            begin = first + c * stride
            staged_bytes[:span].copy_(self._host[begin : begin + span], non_blocking=nb)
            src = self._staging.as_strided((len(ids), n // 8), (stride // 8, 1))
            index = torch.tensor(list(ids), dtype=torch.long)
            if nb:
                index = index.pin_memory().to(words.device, non_blocking=True)
            words.index_copy_(0, index, src)

    def to_host(self, block_ids: Sequence[int], offsets: Sequence[int]) -> None:
        """Copy cache block ``block_ids[i]`` to host byte ``offsets[i]`` (reads the cache
        itself: on CUDA, call ``gather`` first when the blocks may be rewritten meanwhile)."""
        if self.codec is None:
            self.rows_to_host(self._rows, block_ids, offsets)
            return
        self.rows_to_host(self.codec.encode(self.gather(block_ids)), range(len(block_ids)), offsets)

    def gather(self, block_ids: Sequence[int]) -> torch.Tensor:
        """A ``[n, bytes_per_block]`` uint8 copy of the blocks on the cache's device (one
        ``index_select``: device-speed, so the blocks may be reused once it ran)."""
        ids = torch.as_tensor(list(block_ids), dtype=torch.long, device=self._rows.device)
        return self._rows.index_select(0, ids)

    def rows_to_host(self, src: torch.Tensor, rows: Sequence[int], offsets: Sequence[int]) -> None:
        """Copy ``src[rows[i]]`` (uint8 rows of ``bytes_per_block``) to host byte ``offsets[i]``."""
        host, n, nb = self._host, self.nbytes, self._non_blocking
        for row, offset in zip(rows, offsets, strict=True):
            host[offset : offset + n].copy_(src[row], non_blocking=nb)
