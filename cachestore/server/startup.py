"""``kvtier cache-server``'s start-up: the checks made before anything is built, the tier file
as the engine writes it, and the lines the daemon prints.

- ``check_binds``: every address the flags name (ZMQ port, TCP stream port, admin port) is
  bound once and released, before the store allocates its host tier or opens LMDB, so a
  taken port or an address this machine does not have is one line and exit code 2.
- ``load_daemon_tiers``: the engine's ``--kv-offload-config`` file works as is: its
  engine-only top-level settings (``decision``, ``compression``, ...) are named as ignored,
  and a host tier without ``slot_bytes`` takes ``--host-slot-bytes`` (the engine derives it
  from its block size; the daemon stores blocks of any size up to it).
- ``startup_block``: the listening line (first, as supervisors and tests read it) and one
  line per tier, top first, with its write policy.
- ``say``: a timestamped line on stdout (or stderr); ``setup_logging`` gives library log
  records the same timestamp.

Reads the YAML; touches sockets only to test-bind them. Torch-free.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from typing import IO, TYPE_CHECKING, Any

from tiers.config import (
    HostTierConfig,
    TierConfig,
    TierStackConfig,
    load_config_file,
    parse_tier_config,
)
from tiers.sizes import config_size

if TYPE_CHECKING:
    from cachestore.store.types import WritePolicy

TIME_FORMAT = "%Y-%m-%d %H:%M:%S"
_SECRET_FIELDS = ("token", "access_key_id", "secret_access_key")


def say(message: str, stream: IO[str] | None = None) -> None:
    """``message`` on ``stream`` (stdout) after a local timestamp, flushed at once."""
    stream = sys.stdout if stream is None else stream
    print(f"{time.strftime(TIME_FORMAT)} {message}", file=stream, flush=True)


def setup_logging(level: int = logging.INFO) -> None:
    """Library log records (the store's drain report, tier errors) on stderr, timestamped."""
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt=TIME_FORMAT
    )


def check_port(host: str, port: int, flag: str) -> None:
    """Raises ValueError (one line naming ``flag``) unless ``host:port`` can be bound now; the
    socket is closed again at once. Port 0 (any free port) only checks the address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    bind_host = "0.0.0.0" if host == "*" else host
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZMQ and uvicorn bind
        try:
            sock.bind((bind_host, port))
        except OSError as exc:
            raise ValueError(f"{flag}: cannot bind {host}:{port}: {exc.strerror or exc}") from None
        except (OverflowError, socket.gaierror) as exc:
            raise ValueError(f"{flag}: cannot bind {host}:{port}: {exc}") from None


def check_binds(args: Any) -> None:
    """``check_port`` for the ZMQ port, the TCP stream port and the admin port the flags
    name. Raises ValueError."""
    check_port(args.host, args.port, "--port")
    if not args.no_stream and args.stream_port:
        check_port(args.host, args.stream_port, "--stream-port")
    if args.admin_port >= 0:
        if args.admin_port == args.port and args.host == args.admin_host and args.port:
            raise ValueError(f"--admin-port {args.admin_port} is --port too")
        check_port(args.admin_host, args.admin_port, "--admin-port")


def load_daemon_tiers(path: str) -> tuple[TierStackConfig, list[str]]:
    """The tiers of the YAML file ``path`` and the names of its other top-level settings
    (the engine's, which the daemon ignores). Raises ConfigError naming the file."""

    def parse(data: object) -> tuple[TierStackConfig, list[str]]:
        if not isinstance(data, Mapping):
            return parse_tier_config(data), []
        ignored = sorted(str(k) for k in data if k != "tiers")
        return parse_tier_config({"tiers": data.get("tiers")}), ignored

    return load_config_file(path, parse)


def daemon_host_tier(cfg: HostTierConfig, slot_bytes: int) -> HostTierConfig:
    """A host tier as the daemon runs it: ``slot_bytes`` filled in when the file left it to
    the engine, and unpinned memory (no GPU reads the daemon's host tier)."""
    return dataclasses.replace(cfg, slot_bytes=cfg.slot_bytes or slot_bytes, pin_memory=False)


def describe_tier(cfg: TierConfig) -> str:
    """One tier for the start-up block: kind, size, where (passwords and tokens hidden)."""
    from tiers.config import redact_url

    kind = type(cfg).kind
    if isinstance(cfg, HostTierConfig):
        slot = f", slots of {config_size(cfg.slot_bytes)}" if cfg.slot_bytes else ""
        return f"host   {config_size(cfg.capacity)} of memory{slot}"
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    if kind == "lmdb":
        where = f"max {config_size(fields['capacity'])} at {fields['path']}"
    elif kind == "redis":
        cap = fields.get("capacity")
        where = (f"{config_size(cap)} at " if cap else "") + redact_url(fields["url"])
    elif kind == "s3":
        where = f"s3://{fields['bucket']}/{fields['prefix']}"
        if fields.get("endpoint_url"):
            where += f" via {redact_url(fields['endpoint_url'])}"
    elif kind == "remote":
        where = redact_url(fields["url"])
    else:
        where = ", ".join(f"{k}={v}" for k, v in fields.items() if k not in _SECRET_FIELDS)
    return f"{kind:<6} {where}"


def startup_block(
    bound_url: str | None,
    admin_url: str | None,
    configs: list[TierConfig],
    durable: int | None,
    ignored: list[str],
    source: str | None,
    policies: Sequence[WritePolicy] = (),
) -> list[str]:
    """The lines printed once the daemon listens: the listening line first, then each tier
    (the synchronous write-through target marked, the tiers below the top with the write
    policy the store applies, ``policies``, as the engine prints them), then what the tier
    file held for the engine only."""
    lines = [
        f"kvtier cache-server listening on {bound_url}"
        + (f", admin {admin_url}" if admin_url else ", admin port off")
    ]
    for i, cfg in enumerate(configs):
        note = f", {policies[i].policy}" if 0 < i < len(policies) else ""
        if i == durable:
            note = ", write-through (puts commit here first)"
        lines.append(f"  tier {i}  {describe_tier(cfg)}{note}")
    if ignored:
        lines.append(f"  {source}: engine settings ignored here: {', '.join(ignored)}")
    return lines
