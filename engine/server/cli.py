"""``kvtier serve``: flags -> EngineConfig and CoreProcConfig (one-to-one), then uvicorn on the
FastAPI app. The engine core runs in its own process unless ``--engine-in-process``.

Start-up order: flags, the port (refused at once when busy), every file the flags name
(``engine.server.startup.preflight``), then the model load (progress on stderr) and the
engine's summary block (model, KV budget, tier stack; ``engine.startup_log``). A usage or
configuration error is one line naming the flag or file, exit code 2; any other start-up
failure one line, exit code 1; the traceback only with ``--log-level debug``."""

from __future__ import annotations

import argparse
import gc
import logging
from typing import Any

from engine.config import GRAPH_DECODE_CHOICES, CacheConfig, EngineConfig, SchedulerConfig
from engine.core.base import EngineClient
from engine.core.client import CoreProcConfig

logger = logging.getLogger(__name__)
# How long serve waits for the engine to stop after HTTP drained: its KV drain takes up to
# 2 x drain_timeout_s (10 s by default). A core still running then is killed (exit code 1).
ENGINE_STOP_TIMEOUT_S = 60.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Mutates ``parser``: adds every ``kvtier serve`` flag."""
    parser.add_argument(
        "model_positional",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="HF model directory, .gguf file or Hugging Face model id "
        "ORG/NAME, as `vllm serve MODEL` (same as --model)",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="HF model directory, .gguf file or Hugging Face model id "
        "ORG/NAME (from the HF cache; downloaded unless HF_HUB_OFFLINE=1)"
        "; default: the embedded random demo model",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="tokenizer directory, when not the model's (as vLLM's --tokenizer)",
    )
    parser.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE_OR_TEMPLATE",
        help="Jinja chat template for /v1/chat/completions and /tokenize: a "
        "file, or the template itself (default: the tokenizer's)",
    )
    parser.add_argument(
        "--config",
        action=_ConfigFile,
        metavar="FILE",
        help="YAML of serve flags (`port: 9000`, `kv-offload: true`, ...); flags "
        "given on the command line after it win",
    )
    parser.add_argument("--host", default="127.0.0.1", help="HTTP bind address")
    parser.add_argument("--port", type=port_number, default=8000, help="HTTP port (1..65535)")
    parser.add_argument(
        "--served-model-name", default=None, help="name clients use (default: the model's)"
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "float16", "bfloat16"),
        help="weights and KV cache dtype; auto: config.json's (a GGUF: bfloat16 on CUDA, "
        "float32 on CPU)",
    )
    parser.add_argument(
        "--device", default="auto", help="auto | cpu | cuda | cuda:N (auto: cuda when available)"
    )
    parser.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=None,
        help="fixed KV cache size in blocks of 16 tokens (default: from the "
        "memory profile on GPU, --cpu-kv-cache-bytes on CPU)",
    )
    parser.add_argument(
        "--cpu-kv-cache-bytes",
        type=_size,
        default=None,
        metavar="SIZE",
        help="KV cache of a CPU engine, e.g. 2GiB (default: 256MiB, or one "
        "max_model_len sequence when that needs more)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="fraction of the GPU the engine may use, KV cache included",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="tokens one engine step may carry (prefill chunks and decodes)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=64, help="requests running at once")
    parser.add_argument(
        "--first-token-step-tokens",
        type=int,
        default=512,
        metavar="N",
        help="a step yielding a first token from a short prefill carries at "
        "most N prefill tokens; 0: off (docs/scheduling.md)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt plus output, in tokens (default: the model's "
        "context length; a start-up error when the KV cache cannot hold it)",
    )
    parser.add_argument("--seed", type=int, default=0, help="sampling seed of the engine")
    parser.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="no prefix caching (every prompt computed whole)",
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="vLLM's spelling of prefix caching on/off (default on)",
    )
    parser.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="accepted for vLLM compatibility: kvtier logs no request by default",
    )
    parser.add_argument("--kv-offload", action="store_true", help="offload KV to lower tiers")
    parser.add_argument(
        "--kv-offload-config",
        default=None,
        metavar="FILE",
        help="tiers YAML (implies --kv-offload); default with --kv-offload: "
        "host memory and an LMDB in the cache directory",
    )
    parser.add_argument(
        "--request-log",
        default=None,
        metavar="FILE",
        help="JSONL log of every request (ids, lengths, cached tokens, timings); default: none",
    )
    parser.add_argument(
        "--enforce-eager", action="store_true", help="run every step eagerly (no CUDA graphs)"
    )
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        metavar="N",
        help="split the model over N processes (one GPU each; gloo on CPU); N must divide the "
        "model's KV heads (docs/tp.md)",
    )
    parser.add_argument(
        "--attention-backend",
        default="auto",
        choices=("auto", "torch", "flashinfer"),
        help="auto: flashinfer on CUDA when installed (bf16/fp16), else torch",
    )
    parser.add_argument(
        "--graph-decode",
        default="auto",
        choices=GRAPH_DECODE_CHOICES,
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
        "--log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug"),
        help="log level (debug adds tracebacks to start-up errors)",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on /v1/* (default: "
        "$KVTIER_API_KEY; unset: no key)",
    )
    parser.add_argument(
        "--allowed-origins",
        default=None,
        metavar="ORIGINS",
        help="comma-separated CORS origins (e.g. https://app.example,*); default: no CORS",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=_size,
        default="16MiB",
        help="largest HTTP request body; a larger one gets 413 (default 16MiB)",
    )


def port_number(text: str) -> int:
    """An HTTP port flag: 1..65535. argparse reports the error under ``kvtier serve``."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port {text!r}: a number 1..65535") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"invalid port {port}: a number 1..65535")
    return port


def _size(text: str) -> int:
    from tiers.config import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class _ConfigFile(argparse.Action):
    """``--config FILE``: sets every flag the YAML mapping names (``max-model-len`` or
    ``max_model_len``) that the command line has not set before it; later flags override.
    Unknown keys and unreadable files are argparse errors naming the file."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        from tiers.yaml_file import read_yaml

        try:
            data = read_yaml(values) or {}
        except ValueError as exc:  # "FILE: line L, column C: problem"
            parser.error(f"--config {exc}")
        if not isinstance(data, dict):
            parser.error(f"--config {values}: expected a mapping of flag names to values")
        actions = {a.dest: a for a in parser._actions if a.option_strings}
        for key, value in data.items():
            dest = str(key).lstrip("-").replace("-", "_")
            action = actions.get(dest)
            if action is None or dest == "config":
                parser.error(f"--config {values}: unknown serve flag {key!r}")
            if getattr(namespace, dest, None) == action.default:  # not given before --config
                if action.type is not None and value is not None and not isinstance(value, bool):
                    value = action.type(value)
                setattr(namespace, dest, value)
        setattr(namespace, self.dest, values)


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
    """``--api-key``, else ``$KVTIER_API_KEY`` (the one place serve reads the environment)."""
    import os

    env = os.environ if environ is None else environ
    return getattr(args, "api_key", None) or env.get("KVTIER_API_KEY") or None


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
        ),
        # A tier file is a request for offload: vLLM's --kv-transfer-config needs no second flag.
        kv_offload=args.kv_offload or args.kv_offload_config is not None,
        kv_offload_config=args.kv_offload_config,
        request_log=args.request_log,
        enforce_eager=args.enforce_eager,
        tensor_parallel_size=args.tensor_parallel_size,
        attention_backend=args.attention_backend,
        graph_decode=args.graph_decode,
    )


def core_proc_config_from_args(args: argparse.Namespace) -> CoreProcConfig:
    """Pure mapping of the engine-process flags; raises ValueError on bad values."""
    return CoreProcConfig(num_threads=args.engine_num_threads, log_level=args.log_level)


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
    engine's KV offload drained; 1 when the engine died first, was killed, or its drain lost
    blocks (or any start-up failure); 2 for a usage or configuration error."""
    import signal

    import uvicorn

    from engine.server.api import build_app
    from engine.server.lifecycle import EngineWatchdog, Terminated, raise_terminated
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
    name = args.served_model_name or engine.model_name
    # uvicorn stops gracefully on SIGTERM, then raises the signal again under the handler that
    # was in place before it: with the default one this process would die there, before the
    # engine is shut down and the KV offload drained (write-through queues, host-only blocks).
    signal.signal(signal.SIGTERM, raise_terminated)
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
        )
        # The API process holds the tokenizer, FastAPI and (imported) torch/transformers for
        # its whole life: keep them out of the collector's full passes, as the engine does.
        gc.collect()
        gc.freeze()
        logger.info("serving %s on http://%s:%d/v1", name, args.host, args.port)
        server = uvicorn.Server(
            uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level)
        )
        watchdog = EngineWatchdog(engine, server)
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
