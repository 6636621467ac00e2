"""The tensor-parallel process group: one process per rank, ``torch.distributed`` between them.

Two channels (as vLLM): the *device* group carries the model's all-reduces (NCCL on CUDA, gloo
on CPU); the *control* group (always gloo, on the CPU) carries what the driver (rank 0, where
the scheduler runs) sends each step and what the ranks send back (``broadcast``, ``gather``).
On CPU both are the one default group.

Nothing here runs when ``tensor_parallel_size`` is 1: the single-process engine never imports
``torch.distributed``.
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass
from typing import Any

import torch

from engine.models.parallel import TPShard

# Long enough for a worker's model load and (CUDA) graph capture before its first collective.
DEFAULT_TIMEOUT_S = 600.0


def free_port() -> int:
    """A TCP port free on the loopback now (the rendezvous of a group on one machine)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(slots=True)
class TPGroup:
    """This process's rank in the group and the two channels. Not thread-safe: the engine
    thread (driver) or the worker loop calls it, every rank in the same order."""

    rank: int
    size: int
    device_group: Any
    control_group: Any

    @property
    def shard(self) -> TPShard:
        return TPShard(self.rank, self.size)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x``."""
        import torch.distributed as dist

        dist.all_reduce(x, group=self.device_group)
        return x

    def broadcast(self, obj: object = None) -> Any:
        """Rank 0's ``obj`` on every rank (pickled over the control group)."""
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control_group)
        return box[0]

    def gather(self, obj: object) -> list[Any] | None:
        """Every rank's ``obj``, in rank order, on rank 0 (None on the others)."""
        import torch.distributed as dist

        out: list[Any] | None = [None] * self.size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.control_group)
        return out

    def close(self) -> None:
        """Leave the group (idempotent; never another engine's group formed since)."""
        import torch.distributed as dist

        if dist.is_initialized() and dist.group.WORLD is self.device_group:
            dist.destroy_process_group()


def init_tp_group(
    rank: int, size: int, port: int, device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S
) -> TPGroup:
    """Join the group of ``size`` ranks meeting at ``127.0.0.1:port`` (blocks until all have).
    NCCL for a CUDA device (this process's GPU set first), else gloo."""
    import torch.distributed as dist

    if dist.is_initialized():  # the group is per process (torch's default group)
        raise RuntimeError("this process already runs a tensor-parallel engine: close it first")
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size, timeout=timeout
    )
    world = dist.group.WORLD
    control = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else world
    return TPGroup(rank, size, world, control)
