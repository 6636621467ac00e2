"""Start-up calibration of the offload connector's cost model, on the real engine.

``cachestore.cost.calibration.calibrate`` is torch-free and takes callbacks; this module builds them
from the engine's own parts:

- ``prefill_timer(execute, ...)``: a throwaway prefill through the model runner on scratch
  blocks (block ids ``[0, n)`` of a pool that holds nothing yet: calibration runs before the
  first request, and before the connector is attached to the runner, so nothing is saved,
  cached or hashed). The request id is dropped from the runner afterwards (``finish``).
- ``host_to_gpu_timer(kv_cache, ...)``: the host -> device hop every load ends with, timed on
  ``kv_cache.scatter_blocks`` from a (pinned on CUDA) host tensor into the same scratch blocks.
- ``prefill_sizes(max_tokens, max_new_tokens)``: a few (new, context) shapes that fit the
  pool and the model's length, with new tokens within the step's token budget, varied in
  length and context so the fit is determined.

The scratch blocks are zeroed again afterwards (the cache starts zeroed). Not thread-safe: the
engine thread calls it once, at construction.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from cachestore.cost.calibration import DEFAULT_PREFILL_SIZES
from connectors.device.kv_compress import Hi4Codec
from connectors.device.slab_runs import pad16
from engine.core_types import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from engine.kv_cache import KVCache
from engine.sampling_params import SamplingParams

CALIBRATION_REQ_ID = "kvtier-calibration"
Execute = Callable[[SchedulerOutput], ModelRunnerOutput]
_GREEDY = SamplingParams(temperature=0.0, max_tokens=1)
_CPU_MAX_PREFILL_TOKENS = 256  # keeps start-up calibration well under a second on CPU


def prefill_sizes(
    max_tokens: int, max_new_tokens: int | None = None
) -> tuple[tuple[int, int], ...]:
    """``DEFAULT_PREFILL_SIZES`` when they fit (new + context within ``max_tokens``, new
    tokens within ``max_new_tokens``, the step's budget; default ``max_tokens``), else the same
    five shapes with their new tokens scaled down: ``(m/8, 0), (m/2, 0), (m, 0), (m/4, c1),
    (m/8, c2)`` with ``m`` the largest multiple of 16 within both caps and the contexts the
    defaults' (3,072, 4,096) where ``max_tokens`` leaves room for them, never under ``3m/4``
    and ``m/2``. A small step budget thus still measures long contexts: `kvtier serve`'s
    2,048-token steps used to calibrate at contexts of 1.5K at most, and the attention term
    fit to them (0 in one run on an H200, 5.3-6.0 ns in others) decided reloads at 6K.
    Raises ValueError below 32 tokens (no 3 shapes)."""
    max_new = max_tokens if max_new_tokens is None else min(max_new_tokens, max_tokens)
    if all(n <= max_new and n + c <= max_tokens for n, c in DEFAULT_PREFILL_SIZES):
        return DEFAULT_PREFILL_SIZES
    m = max_new // 16 * 16
    if m < 32:
        raise ValueError(f"prefill calibration needs room for 32 tokens, got {max_new}")
    c1 = max(3 * m // 4, min(3072, max_tokens - m // 4))
    c2 = max(m // 2, min(4096, max_tokens - m // 8))
    sizes = ((m // 8, 0), (m // 2, 0), (m, 0), (m // 4, c1), (m // 8, c2))
    return tuple(dict.fromkeys((max(n, 1), c) for n, c in sizes))


def max_prefill_tokens(kv_cache: KVCache, max_model_len: int, token_budget: int) -> int:
    """The largest calibration prefill (new + context tokens) this engine can run: the pool,
    the model's length (one token short) and the step budget; capped on CPU for speed."""
    return max_prefill_shape(kv_cache, max_model_len, token_budget)[1]


def max_prefill_shape(kv_cache: KVCache, max_model_len: int, token_budget: int) -> tuple[int, int]:
    """``(new + context, new)``: the largest calibration prefill and the most new tokens in
    it. New tokens are bounded by the step budget; the context only by the pool and the
    model's length (one token short). Both capped on CPU for speed."""
    total = min(kv_cache.num_blocks * kv_cache.block_size, max_model_len - 1)
    if kv_cache.device.type == "cpu":
        total = min(total, _CPU_MAX_PREFILL_TOKENS)
    return total, min(total, token_budget)


def prefill_timer(
    execute: Execute, block_size: int, vocab_size: int
) -> Callable[[int, int], float]:
    """``run(n, c)``: one prefill of ``n`` new tokens after ``c`` (garbage) cached ones on
    blocks ``[0, ceil((n+c)/block_size))``, sampled greedily (the sample is the step's sync),
    returning seconds. The caller guarantees those blocks are scratch."""
    gen = torch.Generator().manual_seed(0)

    def run(num_tokens: int, context_tokens: int) -> float:
        end = num_tokens + context_tokens
        tokens = torch.randint(0, vocab_size, (num_tokens,), generator=gen).tolist()
        table = list(range(-(-end // block_size)))
        sliced = ScheduledRequest(CALIBRATION_REQ_ID, tokens, context_tokens, table, True, _GREEDY)
        out = SchedulerOutput([sliced], num_tokens, frozenset({CALIBRATION_REQ_ID}))
        t0 = time.perf_counter()
        execute(out)
        return time.perf_counter() - t0

    return run


def finish(execute: Execute, kv_cache: KVCache, num_scratch_blocks: int) -> None:
    """Drop the calibration request's runner state and zero the scratch blocks."""
    execute(SchedulerOutput([], 0, frozenset({CALIBRATION_REQ_ID})))
    if num_scratch_blocks:
        kv_cache.tensor[:num_scratch_blocks].zero_()


def host_to_gpu_timer(
    kv_cache: KVCache, max_blocks: int, codec: Hi4Codec | None = None
) -> Callable[[int], float]:
    """``copy(n)``: copy ``n <= max_blocks`` blocks from host memory (pinned on CUDA) laid out
    like host-tier slots (a header before each payload) into scratch blocks ``[0, n)`` exactly
    as a load's host fast path does (``SlabCopier.to_device``), synchronized; returns seconds.
    With ``codec``, the slots hold encoded blocks and the copy decodes them. The one host
    buffer is allocated here, once."""
    from connectors.device.copy import SlabCopier

    nbytes = kv_cache.bytes_per_block if codec is None else codec.payload_bytes
    # Encoded payloads sit 16-byte aligned in the slab (the decoder needs it), raw ones anywhere.
    header = _SLOT_HEADER_BYTES if codec is None else pad16(_SLOT_HEADER_BYTES)
    stride = nbytes + header
    pinned = kv_cache.device.type == "cuda"
    host = torch.empty(max_blocks * stride, dtype=torch.uint8, pin_memory=pinned)
    host.fill_(0x3C)  # finite in every float dtype
    copier = SlabCopier(kv_cache, host, codec=codec)
    ids = list(range(max_blocks))
    offsets = [i * stride + header for i in ids]
    if codec is not None:  # a valid payload in every slot
        payload = codec.encode(torch.full((1, codec.raw_bytes), 0x3C, dtype=torch.uint8))[0]
        for offset in offsets:
            host[offset : offset + nbytes] = payload

    def copy(num_blocks: int) -> float:
        t0 = time.perf_counter()
        copier.to_device(ids[:num_blocks], offsets[:num_blocks])
        if pinned:
            torch.cuda.synchronize(kv_cache.device)
        return time.perf_counter() - t0

    return copy


# About a codec header's size (fixed part, dtype, layout, namespace, shape): the payload's
# offset inside a host slot is then not a multiple of anything, as in the real slab.
_SLOT_HEADER_BYTES = 141
