"""``kvtier serve``'s command line: every flag (``add_arguments``), the value types that check
them (a port, a byte size) and ``--config FILE``, a YAML mapping of flags that later flags
override. Turning the parsed flags into configs is ``engine.server.cli``'s.
"""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

from engine.config import DEFAULT_GEMM_WARMUP, DEFAULT_STALL_TIMEOUT_S, GRAPH_DECODE_CHOICES


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
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="HTTP bind address; loopback only unless told, as SGLang's (vLLM binds every "
        "interface): pass 0.0.0.0 in a container or behind a load balancer",
    )
    parser.add_argument("--port", type=port_number, default=8000, help="HTTP port (1..65535)")
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="names clients use, as vLLM's: any is accepted as a request's model, the first "
        "is in responses and metrics (default: the model's)",
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
        "--first-token-step-others",
        type=int,
        default=64,
        metavar="N",
        help="other prompts' chunks in such a step carry at most N tokens; -1: fill the "
        "step up to --first-token-step-tokens (docs/scheduling.md)",
    )
    parser.add_argument(
        "--load-wait-step-tokens",
        type=int,
        default=0,
        metavar="N",
        help="while a request waits for a KV load from below the host tier, steps carry at "
        "most N prefill tokens, so its load's end is seen sooner; 0: off (docs/scheduling.md)",
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
        "--step-log",
        default=None,
        metavar="FILE",
        help="JSONL log of every engine step (prompt chunks, decodes, finished loads, the "
        "runner's times); for reading a slow request against its steps; default: none",
    )
    parser.add_argument(
        "--enable-request-id-headers",
        action="store_true",
        help="every response carries X-Request-Id (the request's own, else a new one), as "
        "vLLM's flag; a request's X-Request-Id (or body request_id) names its response id "
        "either way",
    )
    parser.add_argument(
        "--vllm-metric-names",
        action="store_true",
        help="/metrics also carries the families that have a vLLM equivalent under vLLM's "
        "names (vllm:num_requests_running ...), for routers and dashboards built for vLLM",
    )
    parser.add_argument(
        "--enforce-eager", action="store_true", help="run every step eagerly (no CUDA graphs)"
    )
    parser.add_argument(
        "--gemm-warmup",
        action=argparse.BooleanOptionalAction,
        default=DEFAULT_GEMM_WARMUP,
        help="on CUDA, load every step size's GEMM kernels at start-up (no kernel loads mid-step)",
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
        "--engine-stall-timeout",
        type=_seconds,
        default=int(DEFAULT_STALL_TIMEOUT_S),
        metavar="SECONDS",
        help="declare the engine core stalled when it has sent nothing for this long (a step "
        "stuck in a CUDA call, the process stopped): requests fail with 503, /health turns "
        "503, the core is killed and serve exits 1 for its supervisor to restart it. One "
        "step is silent however long it runs: keep this above the longest step (a big "
        "prefill on CPU); an idle core is asked for a sign of life, so idle is never a "
        "stall. 0: off. Not with --engine-in-process (docs/offload.md)",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=_seconds,
        default=10,
        metavar="SECONDS",
        help="on SIGTERM/SIGINT, how long the requests in flight may still run; those left "
        "then are aborted and answered 503 (a stream: an error event, then [DONE]) before "
        "the engine drains its KV offload; 0: at once. 10 s plus the drain's 2 x "
        "drain_timeout_s fits a 30 s stop grace (Docker, Kubernetes) and systemd's "
        "TimeoutStopSec=90 (docs/offload.md)",
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
        "$KVTIER_API_KEY, else vLLM's $VLLM_API_KEY; unset: no key)",
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


def _seconds(text: str) -> int:
    """A whole number of seconds, 0 or more (uvicorn's ``timeout_graceful_shutdown``)."""
    try:
        seconds = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid seconds {text!r}: a whole number >= 0") from None
    if seconds < 0:
        raise argparse.ArgumentTypeError(f"invalid seconds {seconds}: a whole number >= 0")
    return seconds


def _size(text: str) -> int:
    from tiers.config import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _config_error(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    """Exits 2 with ``kvtier serve: error: MESSAGE`` alone on stderr, one line naming the file
    as ``--kv-offload-config`` errors do. Not ``parser.error``: its 26 lines of usage come
    first, bury that line, and say nothing about what the YAML may hold."""
    parser.exit(2, f"{parser.prog}: error: {message}\n")


class _ConfigFile(argparse.Action):
    """``--config FILE``: sets every flag the YAML mapping names (``max-model-len`` or
    ``max_model_len``) that the command line has not set before it; later flags override.
    Unknown keys, unreadable files and bad values are one-line errors naming the file (exit
    code 2); a value goes through the flag's own check (``config_value``)."""

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
            _config_error(parser, f"--config {exc}")
        if not isinstance(data, dict):
            _config_error(parser, f"--config {values}: expected a mapping of flag names to values")
        actions = {
            a.dest: a
            for a in parser._actions
            if a.option_strings and not isinstance(a, argparse._HelpAction)
        }
        for key, value in data.items():
            dest = str(key).lstrip("-").replace("-", "_")
            action = actions.get(dest)
            if action is None or dest == "config":
                _config_error(parser, f"--config {values}: unknown serve flag {key!r}")
            if getattr(namespace, dest, None) == action.default:  # not given before --config
                try:
                    value = config_value(action, value)
                except ValueError as exc:
                    _config_error(parser, f"--config {values}: {key}: {exc}")
                setattr(namespace, dest, value)
        setattr(namespace, self.dest, values)


def config_value(action: argparse.Action, value: Any) -> Any:
    """``value`` of a ``--config`` key checked as the command line checks the flag's text.
    A switch takes only a YAML boolean (the string "no" is truthy: it would turn a switch
    on); any other flag one scalar (a flag of several values: a list, or one), converted by
    the flag's type and held to its choices.
    Raises ValueError saying why, in one line."""
    if action.nargs == 0:  # store_true, store_false, --flag/--no-flag
        if not isinstance(value, bool):
            raise ValueError(f"expected true or false, got {value!r}")
        return value if not isinstance(action, argparse._StoreFalseAction) else not value
    if value is None:
        if action.default is not None:
            raise ValueError("expected a value, got nothing (null)")
        return None
    if action.nargs == "+":  # a list of values, or one
        items = value if isinstance(value, list) else [value]
        if not items:
            raise ValueError("expected at least one value, got an empty list")
        return [_scalar_value(action, item) for item in items]
    return _scalar_value(action, value)


def _scalar_value(action: argparse.Action, value: Any) -> Any:
    """One value of a ``--config`` key, converted by the flag's type, held to its choices."""
    if isinstance(value, (bool, list, dict)):
        raise ValueError(f"expected a single value, got {_yaml_kind(value)}")
    text = str(value)
    if action.type is not None:
        try:
            converted = action.type(text)
        except argparse.ArgumentTypeError as exc:
            raise ValueError(str(exc)) from None
        except (TypeError, ValueError):
            name = getattr(action.type, "__name__", repr(action.type))
            raise ValueError(f"invalid {name} value: {text!r}") from None
    else:
        converted = text
    if action.choices is not None and converted not in action.choices:
        choices = ", ".join(map(repr, action.choices))
        raise ValueError(f"invalid choice: {converted!r} (choose from {choices})")
    return converted


def _yaml_kind(value: Any) -> str:
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    return "a list" if isinstance(value, list) else "a mapping"
