"""Guards for pinned host buffers that are refilled every step and read by asynchronous copies.

A host->device copy from pinned memory is only *enqueued* when the call returns: the GPU reads
the host bytes when the stream reaches the copy, which can be several steps later when the
host runs ahead (steps that sample nothing, e.g. the chunks of a long prefill, never
synchronize). Refilling such a buffer before that copy ran hands the GPU the *next* step's
values: FlashInfer's ``plan`` does exactly this with its page-locked plan buffer (a raw
``cudaMemcpyAsync`` that PyTorch's pinned allocator does not track), so a chunk planned for
2048 queries over 4K tokens ran with the plan of the chunk after it (more KV than its page
table) and read page ids past its page table: illegal memory accesses from about 4.5K tokens
of context on, only when the host got two steps ahead.

``StagingFence.wait()`` before refilling a buffer, ``record()`` right after enqueuing the
copies that read it. The wait returns as soon as the GPU *started* the step that read the
buffer, so the host still runs one step ahead of the device.
"""

from __future__ import annotations

import torch


class StagingFence:
    """One reusable host buffer's guard. Not thread-safe (one engine loop owns it). A fence
    never recorded does not wait. ``record`` must not be called during graph capture."""

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event: torch.cuda.Event | None = None  # made at the first record

    def record(self) -> None:
        """Mark the point in the current stream after the copies that read the buffer."""
        if self._event is None:
            self._event = torch.cuda.Event()
        self._event.record()

    def wait(self) -> None:
        """Block until every copy enqueued before the last ``record`` has run."""
        if self._event is not None:
            self._event.synchronize()
