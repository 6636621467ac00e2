"""Layer-wise in-step loads of raw (uncompressed) blocks through device staging: what
``SlabCopier.to_device_layers`` runs for raw blocks on CUDA (``layered_loads: true``).

Why: a load that moved each block a group of layers at a time by a driver copy of its own
made blocks x groups copies (a pair of QA reloads, 508 blocks: 2,032 at 8 layers a copy).
Past ~1,000 queued copies the H200's driver queue is full and the issue waits for the copy
engine: 12.5 ms of the engine thread for those 2,032 (bench/h2d_pieces.py). But a group of
layers sits at one offset in every slot (a block is layer-major) and consecutive slots sit at
one pitch (``ascending_runs``), so the group's bytes of a whole run of slots are ONE 2-D copy
(``copy2d``: a row per block, the slot pitch apart): copies per group = runs, not blocks.

How, the raw twin of ``decode.StagedDecoder.to_device_layers``: per group of layers
``[a, b)`` (``layer_groups``) and per chunk of staging rows that fits one of two
``LAYER_BYTES`` buffers, one 2-D copy per run into the buffer on the current stream (the
loader's side stream); then on a second ("scatter") stream one ``index_copy_`` of 8-byte words
writes the staged rows into bytes ``[a, b) * per_layer`` of the blocks' cache rows. The two
buffers take turns; a copy into one waits for that buffer's last scatter. One CUDA event per
group, on the scatter stream after its last chunk: the forward's layers wait only for their
group's (``KVCache.set_layer_ready``). The block ids go to the device once, before the first
data copy: host -> device copies run in issue order on the H200 whatever their stream, so a
small upload issued after the big copies would wait for all of them.

If the driver refuses a 2-D copy or the staging cannot be allocated (CUDA out of memory: it
comes out of what ``gpu_memory_utilization`` leaves beside the KV cache), that load and every
later one of this engine move whole blocks (``whole_blocks``, given by ``SlabCopier``), one event for every layer. On the CPU
(tests, ``force_layers``) the same staging steps run synchronously. Not thread-safe: one
caller (the engine thread).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence

import torch

from connectors.device.copy2d import copy2d, copy2d_available
from connectors.device.kv_compress import index_to_device
from connectors.device.slab_runs import ascending_runs, check_payloads, pad16

log = logging.getLogger(__name__)

LAYER_BYTES = 128 << 20  # each of the two staging buffers
# Automatic ``layers_per_copy``: with a copy per run instead of per block, the group count
# costs a few copies each, not one per block: a pair of QA reloads (508 blocks in consecutive
# slots) issues in ~1.8 ms and copies at 0.965x of one contiguous copy at 8 and at 4 layers a
# copy alike (H200, bench/h2d_pieces.py). 4 (256 KiB rows for Llama-3-8B): the forward's
# last layers, which wait for the last group, start sooner after the link is done.
STAGED_LAYERS_PER_COPY = 4

Runs = list[tuple[int, int, list[int]]]  # ``ascending_runs``: (lowest offset, pitch, indices)
Streams = tuple[torch.cuda.Stream, torch.cuda.Stream]  # CUDA: (the current one, the scatter one)


class StagedLayers:
    def __init__(
        self,
        rows: torch.Tensor,
        host: torch.Tensor,
        num_layers: int,
        whole_blocks: Callable[[Sequence[int], Sequence[int]], None],
        *,
        layers: bool = False,
        force_layers: bool = False,
        layers_per_copy: int = 0,
        issue_ahead: int = 0,
    ) -> None:
        """``rows``: the cache as ``[num_blocks, bytes_per_block]`` uint8 (layer-major rows);
        ``host``: the slab (1-D uint8); ``whole_blocks(block_ids, offsets)``: whole-block
        copies on the current stream (the fallback). ``layers``: run where it can
        (CUDA, the driver's 2-D copies, a pinned slab); ``force_layers``: on the CPU too
        (tests); ``layers_per_copy``: see ``layer_groups`` (0: automatic); ``issue_ahead``:
        see ``to_device_layers`` (0: every group issued at once)."""
        if layers_per_copy < 0:
            raise ValueError(f"layers_per_copy must be >= 0, got {layers_per_copy}")
        if issue_ahead < 0:
            raise ValueError(f"issue_ahead must be >= 0, got {issue_ahead}")
        self.num_layers = num_layers
        self.layers_per_copy = layers_per_copy
        self.issue_ahead = issue_ahead
        self.per_layer = rows.shape[1] // num_layers
        self._rows = rows
        self._host = host
        self._whole = whole_blocks
        self._cuda = rows.is_cuda
        # Scattered as 8-byte words: every layer's bytes must start and end on a word.
        words = self.per_layer * num_layers == rows.shape[1] and self.per_layer % 8 == 0
        self._layers_ok = words and (
            force_layers or (layers and self._cuda and host.is_pinned() and copy2d_available())
        )
        self._staging: torch.Tensor | None = None  # the two buffers, allocated on first use
        self._stream: torch.cuda.Stream | None = None  # CUDA: the scatter stream

    @property
    def layered(self) -> bool:
        """Whether ``to_device_layers`` runs (CUDA with the driver's 2-D copies and a pinned
        slab, or ``force_layers``; and layers of whole 8-byte words); False once the driver
        refused a 2-D copy."""
        return self._layers_ok

    def layer_groups(self) -> list[tuple[int, int]]:
        """The ``[first, end)`` layers each copy moves: consecutive groups of
        ``layers_per_copy`` (0: ``STAGED_LAYERS_PER_COPY``), the last one shorter when the
        count does not divide."""
        n = self.num_layers
        per = max(1, min(n, self.layers_per_copy or STAGED_LAYERS_PER_COPY))
        return [(a, min(n, a + per)) for a in range(0, n, per)]

    def to_device_layers(self, block_ids: Sequence[int], offsets: Sequence[int]) -> list[object]:
        """Copy the payload at slab byte ``offsets[i]`` into cache block ``block_ids[i]``, a
        group of layers at a time (module docstring). Returns one CUDA event per layer,
        recorded after its group landed (the last one with timing); CPU: ``[]``, done on
        return. With ``issue_ahead`` > 0 only the first groups are issued now and the result
        is a ``LayerEvents``: its ``ensure(layer)`` issues every group up to ``issue_ahead``
        layers past ``layer`` (the forward calls it before it waits for a layer), its
        ``finish()`` the rest; each event is recorded when its group is issued. Raises
        ValueError for a block id outside the cache or a payload outside the slab (before
        anything is copied), or when not ``layered``."""
        if not self._layers_ok:
            raise ValueError(
                "layer-wise loads of raw blocks need CUDA, the driver's 2-D copies and a "
                "pinned slab"
            )
        runs, ids = self._staging_order(block_ids, offsets)
        if not ids:
            return []
        device = self._rows.device
        index = index_to_device(torch.tensor(ids, dtype=torch.int64), device)  # before the data
        streams = None
        if self._cuda:
            streams = (torch.cuda.current_stream(device), self._scatter_stream())
            streams[1].wait_stream(streams[0])  # the upload, the blocks' previous owner
            index.record_stream(streams[1])
        try:
            if self.issue_ahead > 0:  # a later group the driver refuses: _LazyGroups falls back
                return _LazyGroups(self, runs, index, streams, (block_ids, offsets)).events
            # The staging comes out of the memory the KV budget left (gpu_memory_utilization's
            # rest); an engine without room for it loads whole blocks instead of failing.
            events = self._copy_groups(runs, index, self._buffers(), streams)
        except RuntimeError:  # a 2-D copy refused, or no memory for the staging: whole blocks
            if streams is None:
                raise
            return self._whole_blocks(block_ids, offsets, streams)
        if streams is not None:
            streams[0].wait_stream(streams[1])  # the staging is reused by the next load
        return events

    def _staging_order(
        self, block_ids: Sequence[int], offsets: Sequence[int]
    ) -> tuple[Runs, list[int]]:
        """The payloads' runs of slots (``ascending_runs``) and the block id of each staging
        row (the payloads in run order), after checking both against the cache and the slab
        (ValueError)."""
        num_blocks, n = self._rows.shape
        check_payloads(block_ids, offsets, num_blocks, n, self._host.numel())
        runs = ascending_runs(offsets, n)
        return runs, [block_ids[j] for _, _, js in runs for j in js]

    def _buffers(self) -> torch.Tensor:
        """The two staging buffers, back to back (uint8): each ``LAYER_BYTES``, or a whole
        block where that is more, so that one row of any group always fits."""
        if self._staging is None:
            size = pad16(max(LAYER_BYTES, self._rows.shape[1]))
            self._staging = torch.empty(2 * size, dtype=torch.uint8, device=self._rows.device)
        return self._staging

    def _scatter_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self._rows.device)
        return self._stream

    def _copy_groups(
        self,
        runs: Runs,
        index: torch.Tensor,
        staging: torch.Tensor,
        streams: Streams | None,
    ) -> list[object]:
        """Every group of layers (``_copy_group``); one event per layer (CUDA)."""
        turns = _Turns()
        events: list[object] = []
        for group in self.layer_groups():
            event = self._copy_group(runs, index, staging, streams, group, turns)
            if event is not None:
                events.extend([event] * (group[1] - group[0]))
        return events

    def _copy_group(
        self,
        runs: Runs,
        index: torch.Tensor,
        staging: torch.Tensor,
        streams: Streams | None,
        group: tuple[int, int],
        turns: _Turns,
        event: torch.cuda.Event | None = None,
    ) -> torch.cuda.Event | None:
        """Layers ``[a, b)`` of every staged row, chunk by chunk through the two buffers in
        turn (``turns``: whose turn, and each buffer's last scatter): the 2-D copies, then the
        scatter. CUDA: records ``event`` (a new one if None; the last group's times the load)
        on the scatter stream after the group's last chunk and returns it; CPU: None."""
        a, b = group
        n, size = index.numel(), staging.numel() // 2
        width = (b - a) * self.per_layer
        per_chunk = size // width  # >= 1: a buffer holds a whole block
        for r0 in range(0, n, per_chunk):
            r1, p = min(n, r0 + per_chunk), turns.count % 2
            if streams is not None and (done := turns.free[p]) is not None:
                streams[0].wait_event(done)
            self._stage(runs, staging, p * size, a, width, (r0, r1))
            staged = staging[p * size : p * size + (r1 - r0) * width]
            turns.free[p] = self._scatter_after_copy(streams, staged, index[r0:r1], a, width)
            turns.count += 1
        if streams is None:
            return None
        if event is None:
            event = torch.cuda.Event(enable_timing=b == self.num_layers)
        event.record(streams[1])
        return event

    def _stage(
        self,
        runs: Runs,
        staging: torch.Tensor,
        base: int,
        first_layer: int,
        width: int,
        rows: tuple[int, int],
    ) -> None:
        """Bytes ``[first_layer * per_layer, + width)`` of the payloads of staging rows
        ``[r0, r1)`` into ``staging`` from ``base``, rows of ``width`` bytes: one 2-D copy per
        run of slots that holds some of them."""
        r0, r1 = rows
        skip = first_layer * self.per_layer
        start = 0  # the staging row of the run's lowest slot
        for first, pitch, js in runs:
            end = start + len(js)
            lo, hi = max(r0, start), min(r1, end)
            if lo < hi:
                src = first + (lo - start) * pitch + skip
                copy2d(
                    staging, base + (lo - r0) * width, width, self._host, src, pitch, width, hi - lo
                )
            start = end

    def _scatter_after_copy(
        self,
        streams: Streams | None,
        staged: torch.Tensor,
        index: torch.Tensor,
        first_layer: int,
        width: int,
    ) -> torch.cuda.Event | None:
        """Staged rows of ``width`` bytes into bytes ``[first_layer * per_layer, + width)`` of
        the cache rows ``index``. CUDA: on the scatter stream once the copies enqueued so far
        on the current one ran; returns an event recorded after it (the buffer is free
        again). CPU (``streams`` None): at once, returns None."""
        words = self._rows.view(torch.int64).narrow(
            1, first_layer * self.per_layer // 8, width // 8
        )
        src = staged.view(torch.int64).view(-1, width // 8)
        if streams is None:
            words.index_copy_(0, index, src)
            return None
        current, scatter = streams
        copied = torch.cuda.Event()
        copied.record(current)
        scatter.wait_event(copied)
        with torch.cuda.stream(scatter):
            words.index_copy_(0, index, src)
        done = torch.cuda.Event()
        done.record(scatter)
        return done

    def _whole_blocks(
        self,
        block_ids: Sequence[int],
        offsets: Sequence[int],
        streams: Streams,
    ) -> list[object]:
        """Layer-wise loads are off for this engine (the driver refused a 2-D copy): the
        blocks whole (``whole_blocks``), one event for every layer."""
        log.exception("layer-wise loads of raw blocks are off for this engine")
        self._layers_ok = False
        current, scatter = streams
        # Groups already scattered land first: the event then covers everything this load did.
        current.wait_stream(scatter)
        self._whole(block_ids, offsets)
        event = torch.cuda.Event(enable_timing=True)
        event.record(current)
        return [event] * self.num_layers


class _Turns:
    """Which of the two staging buffers a load's next chunk takes, and each one's last
    scatter (an event; None: free)."""

    __slots__ = ("count", "free")

    def __init__(self) -> None:
        self.count = 0
        self.free: list[torch.cuda.Event | None] = [None, None]


class LayerEvents(list):
    """``StagedLayers.to_device_layers``' events when its groups are issued as the forward
    reaches them: ``ensure(layer)`` before the forward waits for ``layer``, ``finish()`` once
    the forward is queued (both idempotent)."""

    ensure: Callable[[int], None]
    finish: Callable[[], None]


class _LazyGroups:
    """One load's layer groups, issued in order as ``ensure`` asks (``StagedLayers.issue_ahead``
    layers ahead of the forward's reads), on the streams current at the load (CUDA: the side
    and scatter streams; the CPU runs each group at once, as the eager path does). Every
    group's event is made now and recorded when its group is issued. A group the driver
    refuses turns the rest into whole-block copies (``StagedLayers._whole_blocks``), after
    which every event left is recorded."""

    def __init__(
        self,
        owner: StagedLayers,
        runs: Runs,
        index: torch.Tensor,
        streams: Streams | None,
        load: tuple[Sequence[int], Sequence[int]],
    ) -> None:
        self._owner = owner
        self._runs = runs
        self._index = index  # held until the last group is issued
        self._streams = streams
        self._load = load
        self._staging = owner._buffers()
        self._turns = _Turns()
        self._groups = owner.layer_groups()
        self._group_of = [i for i, (a, b) in enumerate(self._groups) for _ in range(a, b)]
        self._issued = 0  # groups issued so far
        n = owner.num_layers
        self._events: list[torch.cuda.Event | None] = [
            torch.cuda.Event(enable_timing=b == n) if streams is not None else None
            for _, b in self._groups
        ]
        self.events = LayerEvents()
        if streams is not None:
            self.events.extend(self._events[g] for g in self._group_of)
        self.events.ensure = self.ensure
        self.events.finish = self.finish
        self.ensure(0)

    def ensure(self, layer: int) -> None:
        """Issue every group up to the one holding ``layer + issue_ahead`` (the forward is
        about to wait for ``layer``'s)."""
        last = self._owner.num_layers - 1
        target = self._group_of[min(max(layer, 0) + self._owner.issue_ahead, last)]
        while self._issued <= target:
            self._issue_next()

    def finish(self) -> None:
        """Issue every group left."""
        self.ensure(self._owner.num_layers - 1)

    def _issue_next(self) -> None:
        i, streams = self._issued, self._streams
        ctx = torch.cuda.stream(streams[0]) if streams is not None else contextlib.nullcontext()
        with ctx:
            try:
                self._owner._copy_group(
                    self._runs,
                    self._index,
                    self._staging,
                    streams,
                    self._groups[i],
                    self._turns,
                    self._events[i],
                )
            except RuntimeError:  # a 2-D copy refused: whole blocks, every event after them
                if streams is None:
                    raise
                self._owner._whole_blocks(*self._load, streams)
                for event in self._events[i:]:
                    event.record(streams[0])  # type: ignore[union-attr]
                self._issued = len(self._groups)
            else:
                self._issued += 1
        if self._issued == len(self._groups) and streams is not None:
            streams[0].wait_stream(streams[1])  # the staging is reused by the next load
