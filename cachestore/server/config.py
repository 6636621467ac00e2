"""``ServerConfig``: the cache daemon core's one frozen config (``cachestore.server.daemon``), mapped
one-to-one from ``kvtier cache-server`` flags (``cachestore.server.cli``), and the loopback
rule an open (token-less) daemon binds by. Pure data; thread-safe.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from tiers.remote.protocol import ServerLimits, is_loopback, url_host

__all__ = ["ServerConfig", "is_loopback"]


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Everything the daemon core needs; mapped one-to-one from ``kvtier cache-server`` flags."""

    url: str = "tcp://127.0.0.1:5555"
    limits: ServerLimits = field(default_factory=ServerLimits)
    num_workers: int = 4
    shm_enabled: bool = True
    max_shm_attached: int = 256
    max_shm_segment_bytes: int = 4 << 30
    drain_timeout_s: float = 10.0
    access_log_path: str | None = None
    # Serve host-tier gets/lookups (and small memory-only puts) on the loop thread
    # (False: every request via the pool; the doorbell runs them on its connection threads).
    inline_reads: bool = True
    # Same-host doorbell (a Unix socket next to the shm path); its socket lives in a fresh
    # 0700 directory under ``doorbell_dir`` (None: the system temp dir).
    doorbell: bool = True
    doorbell_dir: str | None = None
    max_doorbell_conns: int = 256  # per listener (the doorbell, the TCP stream)
    # A doorbell or stream connection that has not attached, or a ZMQ peer that has not
    # finished its (token-checked) handshake, within this many seconds is dropped.
    attach_timeout_s: float = 3.0
    # A ZMQ peer that has not finished its handshake within this many seconds is dropped
    # (ZMQ_HANDSHAKE_IVL; a PLAIN handshake is 2 round trips and a ZAP check).
    zmq_handshake_s: float = 1.0
    # At most this many ZMQ connections may be in their handshake (unauthenticated) at once;
    # past it, the ones that sent the most are cut (``tiers.remote.handshake_guard``). With
    # MAXMSGSIZE (~260 KiB) it bounds what unauthenticated ZMQ peers make the daemon hold.
    max_pending_handshakes: int = 64
    # TCP stream (``cachestore.server.doorbell``, ``tcp``): clients without a shared segment (another
    # host, or shm off) move requests and payload frames over a plain TCP connection served
    # by one thread each, instead of ZMQ. It binds the url's host at ``stream_port`` (0: a
    # free port, announced in the hello reply).
    stream: bool = True
    stream_port: int = 0
    # How long the loop (and a doorbell thread) polls for the next request before it blocks:
    # on a small VM a blocked thread's wake-up is most of a short request's round trip.
    spin_us: float = 100.0
    # Pin the loop thread and ZMQ's I/O thread to this CPU (None: unpinned). Their hand-offs
    # then never wake another CPU, which on a small VM costs more than the work itself
    # (docs/cache_server.md, "TCP"). Worker-pool and doorbell threads stay unpinned.
    loop_cpu: int | None = None
    # Zero-copy same-host gets (``cachestore.server.leases``): doorbell clients read a shared host
    # slab in place when it holds one namespace; leased bytes capped overall (and at most a
    # quarter of the slab) and per connection. Past a cap, gets copy.
    leases: bool = True
    max_leased_bytes: int = 1 << 30
    max_leased_conn_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        if self.num_workers <= 0:
            raise ValueError("num_workers must be positive")
        if self.loop_cpu is not None and self.loop_cpu not in os.sched_getaffinity(0):
            raise ValueError(
                f"loop_cpu {self.loop_cpu} is not one of this process's CPUs "
                f"{sorted(os.sched_getaffinity(0))}"
            )
        if not self.url.startswith(("tcp://", "ipc://")):
            raise ValueError(f"url must be tcp://HOST:PORT or ipc://PATH, got {self.url!r}")
        if self.attach_timeout_s <= 0 or self.zmq_handshake_s <= 0:
            raise ValueError(
                f"attach_timeout_s and zmq_handshake_s must be positive, got "
                f"{self.attach_timeout_s}, {self.zmq_handshake_s}"
            )
        if self.max_pending_handshakes < 1:
            raise ValueError(
                f"max_pending_handshakes must be >= 1, got {self.max_pending_handshakes}"
            )
        if not 0 <= self.stream_port <= 65535:
            raise ValueError(f"stream_port must be 0..65535, got {self.stream_port}")

    def stream_host(self) -> str | None:
        """The host the TCP stream binds: the url's (``*`` = every IPv4 interface), or None
        for an ipc:// url (no TCP to share)."""
        if not self.url.startswith("tcp://"):
            return None
        host = url_host(self.url)
        return "0.0.0.0" if host == "*" else host
