"""Strided (2-D) copies from host memory into a device buffer: ``height`` rows of ``width``
bytes, source rows ``src_pitch`` apart, destination rows ``dst_pitch`` apart.

What lets a load take one layer of many blocks at once: a block's payload keeps each layer's
bytes at a fixed offset, so layer ``l`` of a run of slab slots is one 2-D copy (as many rows
as blocks), where per-block copies would be thousands of calls.

- CUDA: ``cuMemcpy2DAsync`` from the driver library (``libcuda.so.1``, which every CUDA
  process has loaded), on the current torch stream. DMA engines do the work, so the SMs stay
  free for the forward that runs beside the copy. The source must be pinned.
- Elsewhere (and for tests): a torch copy from a strided view, with the same semantics.

``copy2d_available()`` says whether the CUDA route can be used.

``copy_h2d_many`` issues many 1-D host -> device copies of one size through the driver's
``cuMemcpyHtoDAsync_v2``: about 1-2 us of host time a copy where a torch ``copy_`` between two
tensor slices costs ~10 (two views, the pinned-memory event bookkeeping), which is what lets a
load move each block in several pieces (a group of layers at a time) without the issue itself
becoming the step's longest part.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch


class _Memcpy2D(ctypes.Structure):
    """``CUDA_MEMCPY2D`` (cuda.h), field for field."""

    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t),
        ("srcY", ctypes.c_size_t),
        ("srcMemoryType", ctypes.c_int),
        ("srcHost", ctypes.c_void_p),
        ("srcDevice", ctypes.c_uint64),
        ("srcArray", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t),
        ("dstY", ctypes.c_size_t),
        ("dstMemoryType", ctypes.c_int),
        ("dstHost", ctypes.c_void_p),
        ("dstDevice", ctypes.c_uint64),
        ("dstArray", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t),
        ("Height", ctypes.c_size_t),
    ]


_HOST, _DEVICE = 1, 2  # CUmemorytype


def _driver_fn(name: str, argtypes: list[object]) -> object | None:
    """``name`` from the driver library (returns CUresult), or None where there is none."""
    try:
        fn = getattr(ctypes.CDLL("libcuda.so.1"), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn


@cache
def _driver_copy() -> object | None:
    return _driver_fn("cuMemcpy2DAsync_v2", [ctypes.POINTER(_Memcpy2D), ctypes.c_void_p])


@cache
def _driver_copy1d() -> object | None:
    return _driver_fn(
        "cuMemcpyHtoDAsync_v2", [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    )


def copy_many_available() -> bool:
    """Whether ``copy_h2d_many`` can run (CUDA and the driver library)."""
    return torch.cuda.is_available() and _driver_copy1d() is not None


def copy_h2d_many(
    dst_addrs: list[int], src_addrs: list[int], nbytes: int, device: torch.device
) -> None:
    """Copy ``nbytes`` from host address ``src_addrs[i]`` to device address ``dst_addrs[i]``
    for every ``i``, asynchronously on ``device``'s current torch stream, in order. The caller
    owns the bounds (the addresses come from tensors it checked) and keeps the host memory
    pinned and untouched until the stream ran. Raises RuntimeError when the driver refuses a
    copy (the ones before it were issued) or is not there."""
    fn = _driver_copy1d()
    if fn is None:
        raise RuntimeError("copy_h2d_many needs the CUDA driver library")
    stream = ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)
    # The driver copies in the thread's current context: ``device``'s (torch's guards leave
    # the thread's device where it was, and an engine on cuda:1 would otherwise be in cuda:0's).
    with torch.cuda.device(device):
        for dst, src in zip(dst_addrs, src_addrs, strict=True):
            rc = fn(dst, src, nbytes, stream)  # type: ignore[operator]
            if rc != 0:
                raise RuntimeError(f"cuMemcpyHtoDAsync failed with CUresult {rc}")


def copy2d_available() -> bool:
    """Whether ``copy2d`` can run host->CUDA copies through the driver."""
    return torch.cuda.is_available() and _driver_copy() is not None


def copy2d(
    dst: torch.Tensor,
    dst_offset: int,
    dst_pitch: int,
    src: torch.Tensor,
    src_offset: int,
    src_pitch: int,
    width: int,
    height: int,
) -> None:
    """Copy ``height`` rows of ``width`` bytes from ``src`` (1-D uint8, host) at byte
    ``src_offset + r * src_pitch`` to ``dst`` (1-D uint8) at ``dst_offset + r * dst_pitch``.
    CUDA ``dst``: asynchronous on the current stream (``src`` pinned and untouched until it
    ran). Raises ValueError when a row runs outside either buffer, RuntimeError when the
    driver refuses the copy."""
    if height <= 0 or width <= 0:
        return
    if width > src_pitch and height > 1 or width > dst_pitch and height > 1:
        raise ValueError("copy2d: rows overlap (width above a pitch)")
    for buf, off, pitch, name in (
        (src, src_offset, src_pitch, "src"),
        (dst, dst_offset, dst_pitch, "dst"),
    ):
        if buf.dtype != torch.uint8 or buf.dim() != 1:
            raise ValueError(f"copy2d: {name} must be a 1-D uint8 tensor")
        if off < 0 or off + (height - 1) * pitch + width > buf.numel():
            raise ValueError(f"copy2d: a row runs past the end of {name}")
    if dst.is_cuda:
        fn = _driver_copy()
        if fn is None or src.is_cuda or not src.is_pinned():
            raise ValueError("copy2d to CUDA needs the driver library and a pinned host source")
        p = _Memcpy2D(
            srcMemoryType=_HOST,
            srcHost=src.data_ptr() + src_offset,
            srcPitch=src_pitch if height > 1 else width,
            dstMemoryType=_DEVICE,
            dstDevice=dst.data_ptr() + dst_offset,
            dstPitch=dst_pitch if height > 1 else width,
            WidthInBytes=width,
            Height=height,
        )
        stream = torch.cuda.current_stream(dst.device).cuda_stream
        with torch.cuda.device(dst.device):  # the driver copies in the current context
            rc = fn(ctypes.byref(p), ctypes.c_void_p(stream))  # type: ignore[operator]
        if rc != 0:
            raise RuntimeError(f"cuMemcpy2DAsync failed with CUresult {rc}")
        return
    rows = src.as_strided((height, width), (src_pitch, 1), src.storage_offset() + src_offset)
    dst.as_strided((height, width), (dst_pitch, 1), dst.storage_offset() + dst_offset).copy_(rows)
