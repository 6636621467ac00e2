"""FlashInfer's paged-KV index, built on the host from the step's block tables.

``page_table`` is the CSR page table FlashInfer's wrappers plan with (``indptr`` / ``indices`` /
``last_page_len``); ``csr_offsets`` the CSR offsets of the query lengths; ``pinned`` a pinned
int32 host copy of a list, so that planning reads it without a device sync. ``graph_table``
refills the pinned buffer a CUDA graph of one batch size reads its page table from (one
allocation per size, never one per step). Torch on the host only; no FlashInfer import.
"""

from __future__ import annotations

import torch

from engine.attention.base import AttentionMetadata


def page_table(
    metadata: AttentionMetadata, page_size: int
) -> tuple[list[int], list[int], list[int]]:
    """``(indptr, indices, last_page_len)`` of FlashInfer's CSR page table, on the host.

    Request ``i`` owns pages ``indices[indptr[i]:indptr[i+1]]`` = the first
    ``ceil(seq_lens[i] / page_size)`` entries of its block table; its last page holds
    ``last_page_len[i]`` (1..page_size) tokens. Raises ValueError without host block tables."""
    tables = metadata.block_tables_cpu
    if tables is None:
        raise ValueError("FlashInfer planning needs AttentionMetadata.block_tables_cpu")
    indptr = [0]
    indices: list[int] = []
    last_page_len: list[int] = []
    for row, seq_len in zip(tables, metadata.seq_lens_cpu, strict=True):
        num_pages = -(-seq_len // page_size)
        indices.extend(row[:num_pages])
        indptr.append(len(indices))
        last_page_len.append(seq_len - (num_pages - 1) * page_size)
    return indptr, indices, last_page_len


def csr_offsets(lengths: list[int]) -> list[int]:
    """``[0, l0, l0 + l1, ...]``: CSR offsets of consecutive lengths."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def pinned(values: list[int]) -> torch.Tensor:
    """``values`` as a pinned int32 host tensor (copied to the device without a sync)."""
    return torch.tensor(values, dtype=torch.int32).pin_memory()


def graph_table(
    buffers: dict[int, torch.Tensor],
    batch_size: int,
    max_pages: int,
    indptr: list[int],
    last_page_len: list[int],
    indices: list[int],
) -> torch.Tensor:
    """Batch size ``batch_size``'s pinned int32 buffer in ``buffers`` (created with room for
    ``max_pages`` pages on first use), refilled in place as ``[indptr (P+1) | last_page_len
    (P) | indices]``, P = ``batch_size``. The caller fences the refill against the copies of
    the last one."""
    host = buffers.get(batch_size)
    if host is None:
        host = torch.empty(2 * batch_size + 1 + max_pages, dtype=torch.int32, pin_memory=True)
        buffers[batch_size] = host
    head = 2 * batch_size + 1
    rows = host.numpy()
    rows[: batch_size + 1] = indptr
    rows[batch_size + 1 : head] = last_page_len
    rows[head : head + len(indices)] = indices
    return host
