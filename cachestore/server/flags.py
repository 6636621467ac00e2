"""``kvtier cache-server``'s flags: their parsers, their help, and the checks across flags.

``add_arguments`` adds every flag, in four groups (binds, tiers, tenants and limits, transports);
``require_a_tier`` refuses a daemon with no tier (one of three flags is required);
``admin_token`` reads ``--admin-token-file`` and refuses an exposed admin port without one;
``server_config`` maps the flags one-to-one onto ``ServerConfig`` (``cachestore.server.config``).
Reads no file but the admin token's. Raises ValueError with a one-line message naming the flag.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from tiers.config import parse_size

if TYPE_CHECKING:
    from cachestore.server.config import ServerConfig


# Which flags give the daemon a tier: at least one of them is required (``require_a_tier``).
TIER_REQUIRED = "one of --data-dir, --config or --host-capacity is required"


def port_number(text: str) -> int:
    """A TCP port flag: 0..65535 (0: any free port). argparse reports the error."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port {text!r}: a number 0..65535") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"invalid port {port}: a number 0..65535")
    return port


def admin_port_number(text: str) -> int:
    """``--admin-port``: a port, or -1 for no admin port."""
    return -1 if text.strip() == "-1" else port_number(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Mutates ``parser``: adds every ``kvtier cache-server`` flag, each with help text (the
    ``kvtier`` parser shows the defaults)."""
    _add_bind_flags(parser)
    _add_tier_flags(parser)
    _add_tenant_flags(parser)
    _add_transport_flags(parser)


def _add_bind_flags(parser: argparse.ArgumentParser) -> None:
    """Where the daemon listens: the ZMQ socket and the admin port."""
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="ZMQ bind address (anything but loopback needs --tokens)",
    )
    parser.add_argument(
        "--port", type=port_number, default=5555, help="ZMQ port (0: any free port)"
    )
    parser.add_argument(
        "--admin-port",
        type=admin_port_number,
        default=5556,
        help="HTTP admin port: /health /metrics /stats (-1: off)",
    )
    parser.add_argument(
        "--admin-host",
        default="127.0.0.1",
        help="admin bind address (anything but loopback needs "
        "--admin-token-file: the admin port lists every tenant's usage)",
    )
    parser.add_argument(
        "--admin-token-file",
        default=None,
        metavar="FILE",
        help="file holding the admin port's bearer token (needed by /stats, "
        "/namespaces, /metrics; /health stays open); default: no token",
    )


def _add_tier_flags(parser: argparse.ArgumentParser) -> None:
    """The tier stack: LMDB under --data-dir, a host tier on top, a tiers YAML."""
    parser.add_argument(
        "--data-dir",
        default=None,
        metavar="DIR",
        help=f"LMDB directory (persistence); default: none, but {TIER_REQUIRED}",
    )
    parser.add_argument(
        "--lmdb-capacity",
        default="10GiB",
        help="LMDB capacity under --data-dir (bytes with a unit: 10GiB, 200GB)",
    )
    parser.add_argument(
        "--host-capacity",
        default=None,
        help="host-memory tier on top of the others, e.g. 4GiB (Gi = 2^30, "
        "G = 10^9; a bare number is refused); default: none",
    )
    parser.add_argument(
        "--host-slot-bytes",
        default="4MiB",
        help="host tier slot: the largest block it holds (larger: LMDB only); "
        "also a --config host tier's when its file sets none",
    )
    parser.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="tiers YAML (tiers.config; the engine's --kv-offload-config file "
        "works as is: its engine-only settings are ignored)",
    )


def _add_tenant_flags(parser: argparse.ArgumentParser) -> None:
    """Who may ask what: tokens, the access log, workers and per-request limits."""
    parser.add_argument(
        "--tokens",
        default=None,
        metavar="FILE",
        help="file of 'TOKEN NAMESPACE [KEY_PREFIX...]' lines; default: open daemon, loopback only",
    )
    parser.add_argument(
        "--access-log",
        default=None,
        metavar="FILE",
        help="JSONL access log (ts, op, namespace, keys); default: none",
    )
    parser.add_argument("--workers", type=int, default=4, help="request worker threads")
    parser.add_argument("--max-frame-bytes", default="64MiB", help="largest block accepted")
    parser.add_argument("--max-keys", type=int, default=4096, help="keys per request")
    parser.add_argument(
        "--namespace-quota", default=None, help="bytes per namespace, e.g. 10GiB; default: none"
    )


def _add_transport_flags(parser: argparse.ArgumentParser) -> None:
    """The fast paths: shared memory, inline reads, doorbell, stream, leases, the loop."""
    parser.add_argument("--no-shm", action="store_true", help="disable the shared-memory path")
    parser.add_argument(
        "--no-inline-reads",
        action="store_true",
        help="send every request to the worker pool (no loop-thread host reads)",
    )
    parser.add_argument(
        "--no-doorbell",
        action="store_true",
        help="no same-host Unix-socket doorbell (shm clients stay on ZMQ)",
    )
    parser.add_argument(
        "--no-stream",
        action="store_true",
        help="no TCP stream (clients without shared memory stay on ZMQ)",
    )
    parser.add_argument(
        "--stream-port",
        type=port_number,
        default=0,
        help="TCP stream port on --host (0: a free port, announced to clients in the hello reply)",
    )
    parser.add_argument(
        "--no-leases",
        action="store_true",
        help="no zero-copy same-host gets (doorbell clients mapping the host "
        "slab; only ever offered when it holds one namespace)",
    )
    parser.add_argument(
        "--spin-us",
        type=float,
        default=100.0,
        help="microseconds the loop polls for a next request before blocking",
    )
    parser.add_argument(
        "--loop-cpu",
        type=int,
        default=None,
        metavar="CPU",
        help="run the ZMQ loop thread and ZMQ's I/O thread on this one CPU "
        "(faster TCP on small VMs); default: unpinned",
    )


def require_a_tier(args: argparse.Namespace) -> None:
    """Raises ValueError (one line naming the flags) when no flag gives the daemon a tier; the
    first check, as argparse checks required flags before anything else."""
    if not (args.data_dir or args.config or args.host_capacity):
        raise ValueError(f"{TIER_REQUIRED} (LMDB, a tiers YAML, host memory)")


def admin_token(args: argparse.Namespace) -> str | None:
    """The admin port's bearer token (None: none). Raises ValueError for an admin port on a
    non-loopback address without one, or an empty or unreadable token file."""
    from tiers.remote.protocol import is_loopback

    token = None
    if args.admin_token_file:
        try:
            token = Path(args.admin_token_file).read_text().strip()
        except OSError as exc:
            raise ValueError(
                f"--admin-token-file: cannot read {args.admin_token_file}: {exc.strerror}"
            ) from None
        if len(token) < 16:
            raise ValueError(
                f"--admin-token-file {args.admin_token_file}: the token must be "
                "at least 16 characters"
            )
    host = f"[{args.admin_host}]" if ":" in args.admin_host else args.admin_host
    if args.admin_port >= 0 and token is None and not is_loopback(f"tcp://{host}:0"):
        raise ValueError(
            f"--admin-host {args.admin_host} exposes every tenant's name and usage: "
            "give --admin-token-file, or keep the admin port on loopback"
        )
    return token


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The daemon's ``ServerConfig`` from the flags (sizes need a unit: ``parse_size``)."""
    from cachestore.server.config import ServerConfig
    from tiers.remote.protocol import ServerLimits

    quota = parse_size(args.namespace_quota, "--namespace-quota") if args.namespace_quota else None
    limits = ServerLimits(
        max_keys_per_request=args.max_keys,
        max_frame_bytes=parse_size(args.max_frame_bytes, "--max-frame-bytes"),
        max_namespace_bytes=quota,
    )
    host = f"[{args.host}]" if ":" in args.host else args.host
    return ServerConfig(
        url=f"tcp://{host}:{args.port}",
        limits=limits,
        num_workers=args.workers,
        shm_enabled=not args.no_shm,
        access_log_path=args.access_log,
        inline_reads=not args.no_inline_reads,
        doorbell=not args.no_doorbell,
        spin_us=args.spin_us,
        stream=not args.no_stream,
        stream_port=args.stream_port,
        loop_cpu=args.loop_cpu,
        leases=not args.no_leases,
    )
