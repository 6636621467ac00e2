"""The offload connector's worker side: moves KV bytes between the GPU cache and the store.

``OffloadWorker`` is the model runner's connector (``engine.kv_connector.KVConnectorWorker``);
it owns two side streams (CUDA), one per direction, so saves and loads overlap:
- ``HostSaver`` (connectors/offload/saves.py): blocks freed since the last step, copied from the
  GPU straight into reserved host-tier slots, sealed after the forward.
- ``HostLoader`` (connectors/offload/loads.py): in-step loads (copied before this step's
  forward), async loads (host fast path now, lower tiers through a load thread: pipelined in
  chunks by default, ``connectors/offload/pipeline.py``), completion.

Per step (``ModelRunner`` calls, engine thread):
1. ``start_load_kv(meta)``, before the forward pass: saves first (their blocks may be rewritten
   by this forward), then loads: in-step ones issued now, async ones' host copies held until
2. ``forward_queued()``, once the forward's kernels (and sampling's) are queued: so the copy
   engine takes the forward's input uploads first and the async copies run beside its compute.
3. ``wait_for_save()``, after the forward: the save batch is sealed (checksum, commit) by the
   saver's thread (CUDA) or at once (CPU).
4. ``after_step(meta)``: ``take_report()`` as the runner's ``kv_connector_output``: every load
   whose copies completed, reported in the step they landed in: an in-step load in its own
   step, an async one so that its request runs in the next step.

Not thread-safe: the engine thread drives it.
"""

from __future__ import annotations

import torch

from cachestore.codec import BlockMeta
from cachestore.cost.online import OnlineCostModel
from cachestore.store.hierarchical import HierarchicalStore
from connectors.device.kv_compress import Hi4Codec
from connectors.offload.loads import HostLoader
from connectors.offload.metadata import BlockSave, KVConnectorMetadata, WorkerReport
from connectors.offload.pipeline import chunk_blocks_for
from connectors.offload.saves import HostSaver
from connectors.offload.stats import OffloadStats
from engine.core_types import KVConnectorOutput
from engine.kv_cache import KVCache

KV_LAYOUT = "block_major_v1"  # [num_layers, 2, block_size, kv_heads, head_dim] per block


def block_meta(
    kv_cache: KVCache, namespace_prefix: str, codec: Hi4Codec | None = None
) -> BlockMeta:
    """The codec metadata of one block of ``kv_cache`` (its encoded size sizes host slots);
    with ``codec``, of its compressed payload (bytes, in a layout naming the format)."""
    if codec is not None:
        return BlockMeta(
            dtype="uint8",
            shape=(codec.payload_bytes,),
            layout=f"{KV_LAYOUT}+{codec.name}",
            namespace=namespace_prefix,
        )
    return BlockMeta(
        dtype=str(kv_cache.spec.dtype),
        shape=kv_cache.spec.block_shape,
        layout=KV_LAYOUT,
        namespace=namespace_prefix,
    )


class OffloadWorker:
    def __init__(
        self,
        kv_cache: KVCache,
        store: HierarchicalStore,
        meta: BlockMeta,
        *,
        load_timeout_s: float,
        stats: OffloadStats,
        cost_model: OnlineCostModel | None = None,
        layered_loads: bool = False,
        layers_per_copy: int = 0,
        load_issue_ahead: int = 0,
        coalesced_loads: bool = False,
        codec: Hi4Codec | None = None,
        load_chunk_bytes: int = 0,
        load_pipeline_depth: int = 2,
        load_read_threads: int = 0,
        hold_async_copies: bool = False,
    ) -> None:
        """``load_chunk_bytes`` > 0: lower-tier loads of raw blocks are pipelined (tier read,
        pinned staging and the copy overlap in chunks of that many bytes, rounded to whole
        blocks, through ``load_pipeline_depth`` staging slots, each chunk's reads split over
        ``load_read_threads`` threads: connectors/offload/pipeline.py); 0: read all, then copy."""
        self.kv_cache = kv_cache
        self.store = store
        self.meta = meta
        self.stats = stats
        self.cost_model = cost_model
        cuda = kv_cache.device.type == "cuda"
        # Saves (device -> host) and loads (host -> device) on streams of their own, so the
        # copy engines run both directions at once: an in-step load (which the forward waits
        # for) never queues behind the step's saves (which nothing waits for).
        self._save_stream = torch.cuda.Stream(kv_cache.device) if cuda else None
        self._load_stream = torch.cuda.Stream(kv_cache.device) if cuda else None
        self._saver = HostSaver(kv_cache, store, meta, stats, self._save_stream, codec)
        self._loader = HostLoader(
            kv_cache,
            store,
            meta,
            stats,
            self._load_stream,
            load_timeout_s=load_timeout_s,
            cost_model=cost_model,
            layered=layered_loads,
            coalesced=coalesced_loads,
            codec=codec,
            layers_per_copy=layers_per_copy,
            issue_ahead=load_issue_ahead,
            chunk_blocks=chunk_blocks_for(load_chunk_bytes, kv_cache.bytes_per_block),
            depth=load_pipeline_depth,
            readers=load_read_threads,
            hold_async=hold_async_copies,
        )

    @property
    def layered_loads(self) -> bool:
        """Whether in-step host loads land layer by layer (CUDA, Triton, aligned slab)."""
        return self._loader.layered

    @property
    def load_stages(self) -> int:
        """How many stages (CUDA events) an in-step layer-wise load lands in, the forward
        waiting for each in turn: one per layer for raw blocks, one per group of layers for
        compressed ones (1 without layer-wise loads). Not engine steps."""
        return self._loader.load_stages

    # -- runner hooks --------------------------------------------------------------------

    def start_load_kv(self, metadata: object | None) -> None:
        if not isinstance(metadata, KVConnectorMetadata):
            return
        # Cancelled loads first: a pipelined load's thread stops copying into blocks that
        # this step may save (a freed block's bytes must be whole) or reuse.
        self._loader.cancel(metadata.cancelled_loads)
        if self._save_stream is not None:
            # Copies loads issued in earlier steps (a cancelled one's, or one whose request
            # left before computing) land before their blocks can be read out by a save.
            self._save_stream.wait_stream(self._load_stream)  # type: ignore[arg-type]
        self._saver.start(metadata.saves, metadata.saves_reuse_blocks)
        if self._saver.gather_event is not None and self._load_stream is not None:
            # A block saved this step may be a load's destination: read out first (the gather
            # is a device copy; the slow device -> host part does not hold loads up).
            self._load_stream.wait_event(self._saver.gather_event)  # type: ignore[arg-type]
        self._loader.start(
            metadata.loads, metadata.cancelled_loads, idle=metadata.num_scheduled_requests == 0
        )

    def forward_queued(self) -> None:
        """The step's forward is queued: issue the async loads' copies ``start_load_kv`` held."""
        self._loader.release_held()

    def wait_for_save(self) -> None:
        self._saver.end_step()

    def after_step(self, metadata: object | None) -> KVConnectorOutput:
        """The loads that landed by now, reported to the scheduler side (``take_report``)."""
        return self.take_report().as_output()

    def take_report(self) -> WorkerReport:
        return WorkerReport(finished_loads=tuple(self._loader.take_finished()))

    def save_now(self, saves: tuple[BlockSave, ...], wait: bool = True) -> None:
        """Copy ``saves`` out between steps. ``wait``: return once they (and every earlier
        save) are sealed and visible (shutdown, flush). Without it (an engine going idle) the
        copies are issued and the seal thread makes them visible shortly after: the engine
        thread does not wait for the checksums of a whole history (on the H200 QA run with a
        small host tier, 12% of the engine thread's time, during which arrivals waited). On the
        CPU saves seal on the caller's thread either way."""
        self._saver.start(saves, reuse=False)
        if wait:
            self._saver.drain()
        else:
            self._saver.end_step()

    def close(self) -> None:
        """Finish pending saves, drop pending loads (releasing their pins), stop the threads.
        Idempotent."""
        self._saver.close()
        self._loader.close()
