"""``kvtier serve``: flags (``engine.server.flags``) -> EngineConfig and CoreProcConfig
(one-to-one), then uvicorn on the FastAPI app. The engine core runs in its own process unless ``--engine-in-process``.

Start-up order: flags, the port (refused at once when busy), the device and every file the
flags name (``engine.server.startup.preflight``), then the model load (progress on stderr) and
the engine's summary block (model, KV budget, tier stack; ``engine.startup_log``). A usage or
configuration error is one line naming the flag or file, exit code 2; any other start-up
failure one line, exit code 1; the traceback only with ``--log-level debug``.

Stop order (SIGTERM/SIGINT): uvicorn stops accepting, lets the requests in flight run for up
to ``--shutdown-timeout`` seconds (counted from the signal), then the watchdog ends the rest
(``end_in_flight``: aborted in the core, which frees their blocks; each client gets a 503 or, on
a stream, an error event and ``[DONE]``); uvicorn cancels whatever is still open
``STOP_GRACE_S`` later. Only then is the engine shut down, and its core drains the KV offload
(engine.core.drain)."""

from __future__ import annotations

import argparse
import gc
import logging

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core.base import EngineClient, EngineStalledError
from engine.core.client import CoreProcConfig
from engine.server.flags import add_arguments as add_arguments  # ``kvtier serve``'s flags

logger = logging.getLogger(__name__)
# How long serve waits for the engine to stop after HTTP drained: its KV drain takes up to
# 2 x drain_timeout_s (10 s by default). A core still running then is killed (exit code 1).
ENGINE_STOP_TIMEOUT_S = 60.0


def port_in_use(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be bound now (e.g. "address already in use"), or None. The
    socket is closed again at once; uvicorn binds it for real after the model loaded."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds it
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def api_key_from(args: argparse.Namespace, environ: dict[str, str] | None = None) -> str | None:
    """``--api-key``, else ``$KVTIER_API_KEY``, else ``$VLLM_API_KEY`` (the one place serve
    reads the environment). vLLM's variable too, so that a deployment moved from ``vllm serve``
    keeps its key rather than silently serving without one."""
    import os

    env = os.environ if environ is None else environ
    return (
        getattr(args, "api_key", None)
        or env.get("KVTIER_API_KEY")
        or env.get("VLLM_API_KEY")
        or None
    )


def origins_from(args: argparse.Namespace) -> tuple[str, ...]:
    raw = getattr(args, "allowed_origins", None) or ""
    return tuple(o.strip() for o in raw.split(",") if o.strip())


def resolve_model(args: argparse.Namespace) -> str | None:
    """The model of ``kvtier serve MODEL`` or ``--model MODEL``. Raises ValueError when both
    are given and differ."""
    positional = getattr(args, "model_positional", None)
    if positional and args.model and positional != args.model:
        raise ValueError(f"two models given: {positional!r} and --model {args.model!r}")
    return positional or args.model


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Pure mapping of parsed flags to EngineConfig; raises ValueError on bad values."""
    prefix_caching = not args.no_prefix_caching
    if getattr(args, "enable_prefix_caching", None) is not None:
        if args.no_prefix_caching and args.enable_prefix_caching:
            raise ValueError("--no-prefix-caching and --enable-prefix-caching contradict")
        prefix_caching = args.enable_prefix_caching
    return EngineConfig(
        model=resolve_model(args),
        tokenizer=getattr(args, "tokenizer", None),
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        cache=CacheConfig(
            num_gpu_blocks=args.num_gpu_blocks,
            gpu_memory_utilization=args.gpu_memory_utilization,
            cpu_kv_cache_bytes=getattr(args, "cpu_kv_cache_bytes", None),
            enable_prefix_caching=prefix_caching,
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
            first_token_step_tokens=args.first_token_step_tokens,
            first_token_step_others=args.first_token_step_others,
            load_wait_step_tokens=args.load_wait_step_tokens,
        ),
        # A tier file is a request for offload: vLLM's --kv-transfer-config needs no second flag.
        kv_offload=args.kv_offload or args.kv_offload_config is not None,
        kv_offload_config=args.kv_offload_config,
        request_log=args.request_log,
        step_log=args.step_log,
        enforce_eager=args.enforce_eager,
        gemm_warmup=args.gemm_warmup,
        tensor_parallel_size=args.tensor_parallel_size,
        attention_backend=args.attention_backend,
        graph_decode=args.graph_decode,
    )


def core_proc_config_from_args(args: argparse.Namespace) -> CoreProcConfig:
    """Pure mapping of the engine-process flags; raises ValueError on bad values."""
    stall = args.engine_stall_timeout
    return CoreProcConfig(
        num_threads=args.engine_num_threads,
        log_level=args.log_level,
        stall_timeout_s=float(stall) if stall else None,  # 0: off
    )


def start_engine(
    config: EngineConfig, proc_config: CoreProcConfig, *, in_process: bool = False
) -> EngineClient:
    """Loads the model and returns a running engine: the core in its own process by default,
    on a thread of this process with ``in_process``. The caller must ``shutdown()`` it.
    Raises EngineStartupError (core process) or the load error (in process)."""
    if in_process:
        from engine.core.async_engine import AsyncEngine

        return AsyncEngine.from_config(config)
    from engine.core.client import EngineCoreClient

    return EngineCoreClient.start(config, proc_config)


def main(args: argparse.Namespace) -> int:
    """Runs ``kvtier serve``. Exit codes: 0 once a SIGTERM/SIGINT stopped the server and the
    engine's KV offload drained; 1 when the engine died first, stalled (killed after
    ``--engine-stall-timeout`` of silence), was killed, or its drain lost blocks (or any
    start-up failure); 2 for a usage or configuration error."""
    import faulthandler
    import signal

    import uvicorn

    from engine.server.api import build_app
    from engine.server.lifecycle import (
        STOP_GRACE_S,
        EngineWatchdog,
        QuietShutdownCancel,
        Terminated,
        raise_terminated,
    )
    from engine.server.return_log import return_log_path
    from engine.server.startup import FAILURE_EXIT, USAGE_EXIT, UsageError, one_line, preflight

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s"
    )
    try:
        config = engine_config_from_args(args)
        proc_config = core_proc_config_from_args(args)
    except ValueError as exc:
        logger.error("bad arguments: %s", exc)
        return USAGE_EXIT
    busy = port_in_use(args.host, args.port)
    if busy is not None:  # before minutes of model loading and calibration
        logger.error("cannot serve on %s:%d: %s", args.host, args.port, busy)
        return USAGE_EXIT
    try:
        checked = preflight(config, getattr(args, "chat_template", None))
    except UsageError as exc:
        logger.error("%s", exc)
        return USAGE_EXIT
    logger.info("loading %s", checked.model_info.get("path"))
    try:
        engine = start_engine(config, proc_config, in_process=args.engine_in_process)
    except Exception as exc:  # noqa: BLE001 - EngineStartupError, or the in-process load's
        logger.debug("engine start-up failed", exc_info=True)
        logger.error("%s", one_line(exc))
        return FAILURE_EXIT
    names = args.served_model_name or [engine.model_name]
    name = names[0]
    # uvicorn stops gracefully on SIGTERM, then raises the signal again under the handler that
    # was in place before it: with the default one this process would die there, before the
    # engine is shut down and the KV offload drained (write-through queues, host-only blocks).
    signal.signal(signal.SIGTERM, raise_terminated)
    # ``kill -USR1`` dumps every thread's stack to stderr and goes on (the core does too).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    watchdog: EngineWatchdog | None = None
    try:
        app = build_app(
            engine,
            name,
            args.max_body_bytes,
            api_key=api_key_from(args),
            allowed_origins=origins_from(args),
            chat_template=checked.chat_template,
            model_info=checked.model_info,
            return_log=str(return_log_path(args.request_log)) if args.request_log else None,
            model_aliases=tuple(names[1:]),
            vllm_metric_names=args.vllm_metric_names,
            request_id_headers=args.enable_request_id_headers,
        )
        # The API process holds the tokenizer, FastAPI and (imported) torch/transformers for
        # its whole life: keep them out of the collector's full passes, as the engine does.
        gc.collect()
        gc.freeze()
        logger.info("serving %s on http://%s:%d/v1", name, args.host, args.port)
        server = uvicorn.Server(
            uvicorn.Config(
                app,
                host=args.host,
                port=args.port,
                log_level=args.log_level,
                # Bounded: the KV drain below must still fit the supervisor's stop timeout. The
                # watchdog ends the requests still running at --shutdown-timeout; uvicorn's
                # deadline only cancels what did not finish STOP_GRACE_S after that.
                timeout_graceful_shutdown=args.shutdown_timeout + STOP_GRACE_S,
            )
        )
        logging.getLogger("uvicorn.error").addFilter(QuietShutdownCancel())
        watchdog = EngineWatchdog(engine, server, shutdown_timeout_s=args.shutdown_timeout)
        watchdog.start()
        server.run()
    except (KeyboardInterrupt, Terminated):
        pass  # uvicorn re-raises the signal it handled after a graceful shutdown
    finally:
        # A second SIGTERM (a supervisor's repeat) must not cut the drain short; a stuck drain
        # is the supervisor's SIGKILL to end (TimeoutStopSec), or a second Ctrl-C's.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if watchdog is not None:
            watchdog.stop()
        problem = engine.shutdown(ENGINE_STOP_TIMEOUT_S)
    if watchdog is not None and isinstance(watchdog.engine_error, EngineStalledError):
        # shutdown() killed it; its answer names the stall, how long, and the kill.
        logger.error("exiting: %s (--engine-stall-timeout)", problem)
        return FAILURE_EXIT
    if watchdog is not None and watchdog.engine_error is not None:
        # The core's own exit (killed by a signal, drain incomplete) says more than the
        # stream's end: give both, whichever the API saw first.
        why = f"; {problem}" if problem is not None else ""
        logger.error("exiting: the engine died (%s)%s", watchdog.engine_error, why)
        return FAILURE_EXIT
    if problem is not None:
        logger.error("exiting: %s", problem)
        return FAILURE_EXIT
    return 0
