"""Step input preparation for the model runner: one SchedulerOutput -> host lists -> device
tensors, plus the attention metadata.

``build_host_batch`` validates and flattens (pure Python, no tensors); ``build_device_batch``
packs every per-step int into ONE host buffer and makes one pinned, non-blocking copy.
Neither touches the KV cache. Split out of engine/runner/model_runner.py.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata
from engine.core_types import SchedulerOutput


@dataclass(frozen=True, slots=True)
class HostBatch:
    """One step's flat batch as host lists (validated), before any device copy."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]  # each row cut to ceil(seq_len / block_size) blocks
    logits_rows: list[int]
    sample_req_ids: list[str]

    @property
    def is_decode_only(self) -> bool:
        return len(self.input_ids) == len(self.query_lens)


@dataclass(frozen=True, slots=True)
class BatchInputs:
    """One step's flat batch on the device, plus which rows produce logits."""

    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # int64 [S], the last row of each sampling request
    sample_req_ids: list[str]


def build_host_batch(
    out: SchedulerOutput, block_size: int, num_blocks: int, max_model_len: int
) -> HostBatch:
    """Flatten a step into host lists, validated. Pure. Raises ValueError on an inconsistent
    SchedulerOutput (see ModelRunner.execute_model)."""
    bs = block_size
    host = HostBatch([], [], [], [], [], [], [], [])
    seen: set[str] = set()
    for r in out.requests:
        if r.req_id in seen:
            raise ValueError(f"request {r.req_id!r} scheduled twice in one step")
        seen.add(r.req_id)
        n = len(r.token_ids)
        start, end = r.num_computed_tokens, r.num_computed_tokens + len(r.token_ids)
        if n == 0 or start < 0:
            raise ValueError(f"request {r.req_id!r}: empty slice or negative num_computed_tokens")
        if end > max_model_len:
            raise ValueError(
                f"request {r.req_id!r}: {end} tokens exceed max_model_len {max_model_len}"
            )
        if len(r.block_table) * bs < end:
            raise ValueError(
                f"request {r.req_id!r}: block table of {len(r.block_table)} blocks cannot hold {end} tokens"
            )
        needed = list(r.block_table[: -(-end // bs)])
        if min(needed) < 0 or max(needed) >= num_blocks:
            raise ValueError(f"request {r.req_id!r}: block id outside [0, {num_blocks})")
        host.input_ids.extend(r.token_ids)
        host.positions.extend(range(start, end))
        # One range per block touched, not one Python step per token (long prefills).
        for j in range(start // bs, (end - 1) // bs + 1):
            base = needed[j] * bs - j * bs
            host.slots.extend(range(base + max(start, j * bs), base + min(end, (j + 1) * bs)))
        host.query_lens.append(n)
        host.seq_lens.append(end)
        host.block_tables.append(needed)
        if r.sample:
            host.logits_rows.append(len(host.input_ids) - 1)
            host.sample_req_ids.append(r.req_id)
    return host


def build_device_batch(host: HostBatch, block_size: int, device: torch.device) -> BatchInputs:
    """All per-step inputs in one host buffer and one (pinned, non-blocking) copy."""
    num_tokens, num_reqs = len(host.input_ids), len(host.query_lens)
    max_blocks = max(len(t) for t in host.block_tables)
    cu = [0]
    for n in host.query_lens:
        cu.append(cu[-1] + n)
    flat: list[int] = (
        host.input_ids + host.positions + host.slots + host.logits_rows + cu + host.seq_lens
    )
    for t in host.block_tables:
        flat.extend(t)
        flat.extend([0] * (max_blocks - len(t)))
    packed = to_device(flat, device)
    parts = packed.split(
        [
            num_tokens,
            num_tokens,
            num_tokens,
            len(host.logits_rows),
            num_reqs + 1,
            num_reqs,
            num_reqs * max_blocks,
        ]
    )
    metadata = AttentionMetadata(
        cu_seqlens_q=parts[4].to(torch.int32),
        seq_lens=parts[5].to(torch.int32),
        block_tables=parts[6].view(num_reqs, max_blocks).to(torch.int32),
        slot_mapping=parts[2],
        query_lens_cpu=host.query_lens,
        seq_lens_cpu=host.seq_lens,
        block_size=block_size,
        block_tables_cpu=host.block_tables,
    )
    return BatchInputs(
        input_ids=parts[0],
        positions=parts[1],
        metadata=metadata,
        logits_indices=parts[3],
        sample_req_ids=host.sample_req_ids,
    )


def to_device(
    values: list[int], device: torch.device, dtype: torch.dtype = torch.int64
) -> torch.Tensor:
    """``values`` as a tensor on ``device`` (through pinned memory, non-blocking, on CUDA)."""
    # array('q') converts a long int list several times faster than torch.tensor(list).
    host = (
        torch.frombuffer(array("q", values), dtype=torch.int64)
        if values
        else torch.empty(0, dtype=torch.int64)
    )
    host = host.to(dtype)
    if device.type == "cpu":
        return host
    # Pinned staging lets the host->device copy overlap with queued GPU work.
    return host.pin_memory().to(device, non_blocking=True)
