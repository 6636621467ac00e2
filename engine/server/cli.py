"""``kvtier serve``: flags -> EngineConfig and CoreProcConfig (one-to-one), then uvicorn on the
FastAPI app. The engine core runs in its own process unless ``--engine-in-process``."""

from __future__ import annotations

import argparse
import gc
import logging
import threading
from typing import Any

from engine.config import GRAPH_DECODE_CHOICES, CacheConfig, EngineConfig, SchedulerConfig
from engine.core.base import EngineClient
from engine.core.client import CoreProcConfig

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Mutates ``parser``: adds every ``kvtier serve`` flag."""
    parser.add_argument("--model", default=None,
                        help="HF model directory or .gguf file (default: demo model)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--served-model-name", default=None, help="name clients use (default: the model's)"
    )
    parser.add_argument(
        "--dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16")
    )
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    parser.add_argument("--num-gpu-blocks", type=int, default=None,
                        help="fixed KV cache size in blocks (default: from the memory profile)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="fraction of the GPU the engine may use, KV cache included")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--kv-offload", action="store_true", help="offload KV to lower tiers")
    parser.add_argument("--kv-offload-config", default=None, metavar="FILE", help="tiers YAML")
    parser.add_argument("--request-log", default=None, metavar="FILE")
    parser.add_argument(
        "--enforce-eager", action="store_true", help="run every step eagerly (no CUDA graphs)"
    )
    parser.add_argument(
        "--attention-backend", default="auto", choices=("auto", "torch", "flashinfer"),
        help="auto: flashinfer on CUDA when installed (bf16/fp16), else torch",
    )
    parser.add_argument(
        "--graph-decode", default="auto", choices=GRAPH_DECODE_CHOICES,
        help="decode attention kernel inside CUDA graphs (flashinfer backend; docs/gpu.md)",
    )
    parser.add_argument(
        "--engine-in-process",
        action="store_true",
        help="run the engine core on a thread of the HTTP process instead of its own process",
    )
    parser.add_argument(
        "--engine-num-threads",
        type=int,
        default=None,
        metavar="N",
        help="torch threads of the engine core process (default: torch's choice)",
    )
    parser.add_argument(
        "--log-level", default="info", choices=("critical", "error", "warning", "info", "debug")
    )
    parser.add_argument(
        "--max-body-bytes",
        type=_size,
        default="16MiB",
        help="largest HTTP request body; a larger one gets 413 (default 16MiB)",
    )


def _size(text: str) -> int:
    from cachestore.sizes import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Pure mapping of parsed flags to EngineConfig; raises ValueError on bad values."""
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        cache=CacheConfig(
            num_gpu_blocks=args.num_gpu_blocks,
            gpu_memory_utilization=args.gpu_memory_utilization,
            enable_prefix_caching=not args.no_prefix_caching,
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
        ),
        kv_offload=args.kv_offload,
        kv_offload_config=args.kv_offload_config,
        request_log=args.request_log,
        enforce_eager=args.enforce_eager,
        attention_backend=args.attention_backend,
        graph_decode=args.graph_decode,
    )


def core_proc_config_from_args(args: argparse.Namespace) -> CoreProcConfig:
    """Pure mapping of the engine-process flags; raises ValueError on bad values."""
    return CoreProcConfig(num_threads=args.engine_num_threads)


def start_engine(
    config: EngineConfig, proc_config: CoreProcConfig, *, in_process: bool = False
) -> EngineClient:
    """Loads the model and returns a running engine: the core in its own process by default,
    on a thread of this process with ``in_process``. The caller must ``shutdown()`` it.
    Raises EngineStartupError (core process) or the load error (in process)."""
    if in_process:
        from engine.server.async_engine import AsyncEngine

        return AsyncEngine.from_config(config)
    from engine.core.client import EngineCoreClient

    return EngineCoreClient.start(config, proc_config)


def _exit_after_sigterm(signum: int, frame: object) -> None:
    """SIGTERM outside uvicorn's own handling: leave ``main`` through its ``finally`` (the
    engine's graceful shutdown) with exit code 0."""
    raise SystemExit(0)


def main(args: argparse.Namespace) -> int:
    import signal

    import uvicorn

    from engine.core.client import EngineStartupError
    from engine.server.api import build_app

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s"
    )
    try:
        config = engine_config_from_args(args)
        proc_config = core_proc_config_from_args(args)
    except ValueError as exc:
        logger.error("bad arguments: %s", exc)
        return 2
    try:
        engine = start_engine(config, proc_config, in_process=args.engine_in_process)
    except EngineStartupError as exc:
        logger.error("%s", exc)
        return 1
    name = args.served_model_name or engine.model_name
    # uvicorn stops gracefully on SIGTERM, then raises the signal again under the handler that
    # was in place before it: with the default one this process would die there, before the
    # engine is shut down and the KV offload drained (write-through queues, host-only blocks).
    signal.signal(signal.SIGTERM, _exit_after_sigterm)
    app = build_app(engine, name, args.max_body_bytes)
    # The API process holds the tokenizer, FastAPI and (imported) torch/transformers for its
    # whole life: keep them out of the collector's full passes, as the engine does.
    gc.collect()
    gc.freeze()
    logger.info("serving %s on http://%s:%d/v1", name, args.host, args.port)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level))
    watchdog = EngineWatchdog(engine, server)
    watchdog.start()
    try:
        server.run()
    except KeyboardInterrupt:
        pass  # uvicorn re-raises the SIGINT it handled after a graceful shutdown
    finally:
        watchdog.stop()
        engine.shutdown()
    if watchdog.engine_error is not None:
        logger.error("exiting: the engine died (%s)", watchdog.engine_error)
        return 1
    return 0


class EngineWatchdog:
    """Stops the HTTP server once the engine can no longer run (its core process or thread
    died), so that ``kvtier serve`` exits non-zero within ``interval_s`` and a supervisor
    restarts it, as vLLM's API server does. Requests in flight have already been failed by the
    engine client (503). ``engine_error`` is the engine's error once that happened."""

    def __init__(self, engine: Any, server: Any, interval_s: float = 0.5) -> None:
        self._engine = engine
        self._server = server
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="kvtier-engine-watchdog", daemon=True)
        self.engine_error: BaseException | str | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        while not self._stop.wait(self._interval_s):
            if not self._engine.is_running:
                self.engine_error = self._engine.dead_error or "the engine stopped"
                logger.error("engine is not running (%s): stopping the HTTP server", self.engine_error)
                self._server.should_exit = True
                return
