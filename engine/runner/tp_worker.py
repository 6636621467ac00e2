"""Tensor-parallel execution: rank 0's ``TPDriver`` beside the scheduler, one worker process per
other rank (``worker_main``).

The driver starts ranks ``1..N-1`` (``spawn``), joins the group as rank 0 and builds its own
``ModelRunner`` over its slice. Every step, ``execute_model`` broadcasts the ``SchedulerOutput``
(the runner inputs are derived from it identically on every rank, the offload connector's
metadata riding along) over the control group, then runs rank 0's share; the model's
all-reduces keep the ranks in lock step and only rank 0 samples. With a KV connector on every
rank, each rank's report of the step (``ModelRunnerOutput.kv_connector_output``) is gathered
and joined by rank 0's worker side (``RankedKVConnectorWorker.join_ranks``) into the one
report rank 0's output carries to the scheduler.

Commands a worker obeys, in the order the driver broadcasts them: ``step``, ``offload`` (build
this rank's connector), ``offload_call`` (save / flush / close its connector, then acknowledge),
``stop``. A worker that fails at start-up sends its error down a pipe, so the driver raises it
instead of waiting on a rendezvous that never completes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import os
import threading
import time
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import torch

from engine.config import EngineConfig
from engine.core_types import ModelRunnerOutput, SchedulerOutput
from engine.runner.distributed import TPGroup, free_port, init_tp_group
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.kv_connector import RankedKVConnectorWorker

logger = logging.getLogger(__name__)
_READY_TIMEOUT_S = 600.0


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """The config rank ``rank`` runs with: on CUDA, GPU ``rank`` (each rank one GPU)."""
    from engine.runner.model_setup import resolve_device

    device = resolve_device(config.device)
    if device.type != "cuda":
        return config
    return dataclasses.replace(config, device=f"cuda:{(device.index or 0) + rank}")


class TPDriver:
    """Rank 0: presents the ``ModelRunner`` surface ``LLMEngine`` uses (the other attributes
    are rank 0's runner's). Not thread-safe: the engine thread drives it."""

    def __init__(self, config: EngineConfig, model_dir: str, *, cuda_graphs: bool = True) -> None:
        from engine.models.base import ModelArchConfig
        from engine.models.loader import read_hf_config
        from engine.models.parallel import check_tp_size
        from engine.runner.model_runner import ModelRunner
        from engine.runner.model_setup import resolve_device

        size = config.tensor_parallel_size
        # A degree that cannot split the model: one clear error before any process starts.
        check_tp_size(ModelArchConfig.from_hf(read_hf_config(model_dir)), size)
        port = free_port()
        ctx = mp.get_context("spawn")
        self._procs: list[Any] = []
        self._pipes: list[Any] = []
        with _children_allowed():
            for rank in range(1, size):
                parent, child = ctx.Pipe(duplex=False)
                proc = ctx.Process(
                    target=worker_main,
                    name=f"kvtier-tp{rank}",
                    daemon=True,
                    args=(
                        rank,
                        size,
                        port,
                        rank_config(config, rank),
                        model_dir,
                        cuda_graphs,
                        child,
                    ),
                )
                proc.start()
                child.close()
                self._procs.append(proc)
                self._pipes.append(parent)
        # An engine that fails after this point (or is dropped unclosed) still ends its ranks.
        self._closed = False
        self._groups: list[TPGroup] = []  # the group once joined (for the finalizer)
        weakref.finalize(self, _abandon, self._procs, self._groups)
        try:
            self.group: TPGroup = init_tp_group(0, size, port, resolve_device(config.device))
            self._groups.append(self.group)
            self.runner = ModelRunner(
                rank_config(config, 0), model_dir, cuda_graphs=cuda_graphs, tp=self.group
            )
            self._wait_ready()
        except BaseException:
            self._kill()
            raise
        self.offload_ranks = False  # the ranks have connectors: gather their reports

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["runner"], name)

    @property
    def size(self) -> int:
        return self.group.size

    def execute_model(self, out: SchedulerOutput, return_logits: bool = False) -> ModelRunnerOutput:
        """Send the step to every rank, run rank 0's share; rank 0's sampled tokens, and
        every rank's connector report joined."""
        self.group.broadcast(("step", _for_workers(out)))
        try:
            result = self.runner.execute_model(out, return_logits)
        except BaseException:
            if self.offload_ranks:  # a step refused on every rank still gathers
                self.group.gather(None)
            raise
        if self.offload_ranks:
            parts = self.group.gather(result.kv_connector_output) or []
            worker = self.runner._kv_connector  # None before it is attached (calibration)
            if worker is not None:
                ranked = cast("RankedKVConnectorWorker", worker)
                result.kv_connector_output = ranked.join_ranks(parts)
        return result

    def command(self, name: str, arg: object = None) -> list[Any]:
        """Broadcast a command to the workers (``offload``, ``offload_call``); each answers,
        its answers in rank order (rank 0's slot None)."""
        self.group.broadcast((name, arg))
        return (self.group.gather(None) or [None])[1:]

    def close(self) -> None:
        """Stop the workers and leave the group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.group.broadcast(("stop", None))
        except Exception:
            logger.exception("tensor-parallel stop failed")
        for proc in self._procs:
            proc.join(timeout=30)
        self._kill()
        self.group.close()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + _READY_TIMEOUT_S
        for rank, (proc, pipe) in enumerate(zip(self._procs, self._pipes, strict=True), 1):
            while not pipe.poll(0.1):
                if not proc.is_alive():
                    raise RuntimeError(
                        f"tensor-parallel rank {rank} exited at start-up "
                        f"(exit code {proc.exitcode})"
                    )
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"tensor-parallel rank {rank} not ready after {_READY_TIMEOUT_S:.0f} s"
                    )
            status, detail = pipe.recv()
            if status != "ready":
                raise RuntimeError(f"tensor-parallel rank {rank} failed at start-up: {detail}")

    def _kill(self) -> None:
        _kill(self._procs)


def exit_with_parent(rank: int) -> None:
    """End this rank's process as soon as the process that started it is gone.

    A driver that exits normally stops its ranks (``close``, the finalizer); one that is killed
    (``kill -9``, the OOM killer, the API's stall watch killing a stuck core) cannot. A rank
    waiting on the control group then fails at once on gloo's closed socket, but one inside an
    NCCL collective, or stuck on its GPU, waits for the group's timeout while it holds its GPU's
    memory, and the supervisor's restart of ``kvtier serve`` cannot allocate the cache it needs.
    A daemon thread waits on the parent's sentinel (readable once the parent is gone) and exits
    the process from under whatever the main thread is stuck in."""
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        from multiprocessing.connection import wait

        wait([parent.sentinel])
        logger.error(
            "tensor-parallel rank %d: its driver (pid %s) is gone; exiting", rank, parent.pid
        )
        os._exit(1)

    threading.Thread(target=watch, name=f"kvtier-tp{rank}-parent", daemon=True).start()


_PLAIN = SamplingParams()


def _for_workers(out: SchedulerOutput) -> SchedulerOutput:
    """The step as the other ranks need it: they neither sample nor take logprobs, so each
    request's sampling parameters (which may hold unpicklable logits processors) and token
    history (penalties, grammars: long) stay on rank 0."""
    requests = [
        r
        if r.sampling is _PLAIN and not r.all_token_ids
        else dataclasses.replace(r, sampling=_PLAIN, all_token_ids=[], min_tokens_stop_ids=())
        for r in out.requests
    ]
    return dataclasses.replace(out, requests=requests)


@contextlib.contextmanager
def _children_allowed() -> Iterator[None]:
    """Let a daemonic process (``kvtier serve``'s engine core, engine/core/launch.py) start the
    ranks: multiprocessing refuses because a daemon's children are not waited for at exit.
    Here they need not be: they are killed by ``close``, by the finalizer, or end on their own
    once the driver's process is gone (``exit_with_parent``)."""
    me = mp.current_process()
    daemonic = me.daemon
    if daemonic:
        me._config["daemon"] = False  # type: ignore[attr-defined]
    try:
        yield
    finally:
        if daemonic:
            me._config["daemon"] = True  # type: ignore[attr-defined]


def _abandon(procs: list[Any], groups: list[TPGroup]) -> None:
    """An engine dropped without ``close`` (or failing after its ranks started): kill the
    ranks and leave its group, so that another engine in this process can form one."""
    _kill(procs)
    for group in groups:
        group.close()


def _kill(procs: list[Any]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)


def worker_main(
    rank: int,
    size: int,
    port: int,
    config: EngineConfig,
    model_dir: str,
    cuda_graphs: bool,
    pipe: Any,
) -> None:
    """Rank ``rank``'s process: join the group, build its runner, obey the driver until
    ``stop``."""
    from engine.runner.model_runner import ModelRunner
    from engine.runner.model_setup import resolve_device

    exit_with_parent(rank)
    try:
        device = resolve_device(config.device)
        if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            # The ranks share the machine's cores (rank 0 keeps its own plan).
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
            os.environ["OMP_NUM_THREADS"] = str(torch.get_num_threads())
        group = init_tp_group(rank, size, port, device)
        runner = ModelRunner(config, model_dir, cuda_graphs=cuda_graphs, tp=group)
    except BaseException as exc:
        pipe.send(("error", f"{type(exc).__name__}: {exc}"))
        raise
    pipe.send(("ready", None))
    pipe.close()
    ranked: Any = None  # this rank's offload connector (connectors/offload/tp.py)
    while True:
        name, arg = group.broadcast()
        if name == "step":
            report = None  # this step's connector report, for rank 0 to join
            try:
                report = runner.execute_model(arg).kv_connector_output
            except Exception:  # rank 0 raises the same error to its caller; stay in step
                logger.exception("tensor-parallel rank %d: step failed", rank)
            if ranked is not None:
                group.gather(report)
        elif name == "offload":
            from engine.kv_connector import kv_connector_class

            connector, spec = arg
            ranked = kv_connector_class(connector).create_rank(spec, runner.kv_cache, rank, size)
            runner.set_kv_connector(ranked.worker)
            group.gather(None)
        elif name == "offload_call":
            ranked.call(*arg)
            group.gather(None)
        elif name == "stop":
            break
    if ranked is not None:
        ranked.close()
    group.close()
