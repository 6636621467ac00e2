"""One client thread's doorbell connection to ``kvtier cache-server`` (``cachestore.server.doorbell``):
a Unix socket (or the daemon's TCP stream, ``address`` a (host, port) pair) attached with the
hello's one-time secret, over which the thread's requests go (``tiers.remote.conn.Connections``
decides when). With ``want_slab`` it asks for the daemon's
host slab: a sealed memfd that arrives with the attach reply (SCM_RIGHTS) and is mapped
read-only here (``tiers.host_memfd.map_readonly``), so that leased gets (``cachestore.server.leases``)
are read in place. Not thread-safe: one per client thread.
"""

from __future__ import annotations

import mmap
import os
import socket
import struct
from typing import Any

import msgpack

from tiers import host_memfd
from tiers.base import Value
from tiers.remote.bell_framing import BellClosed, MessageReader, send_message
from tiers.remote.protocol import PROTOCOL_VERSION, ErrorCode, pack

# Requests of one call are all sent before the first reply is read when they add up to no
# more than this (a socket buffer holds them, so neither side can block the other's send).
_PIPELINE_BYTES = 64 << 10
# Reply payloads of one call up to this much land in a reused buffer (``MessageReader``).
REPLY_ARENA_BYTES = 256 << 20


class Bell:
    """One thread's doorbell connection, attached with the hello's one-time secret.
    Raises OSError from the constructor when the daemon refuses or cannot be reached.
    ``slab``: a read-only view of the daemon's host slab when ``want_slab`` and it was given
    (leases), else None; ``leased``: the last call's replies hold leases not yet released."""

    def __init__(
        self,
        address: str | tuple[str, int],
        secret: str,
        timeout_s: float,
        spin_s: float,
        want_slab: bool = False,
    ) -> None:
        """``address``: the doorbell's socket path, or the TCP stream's (host, port)."""
        tcp = not isinstance(address, str)
        self.tcp = tcp
        self.sock = (
            socket.socket(
                socket.AF_INET6 if ":" in address[0] else socket.AF_INET, socket.SOCK_STREAM
            )
            if tcp
            else socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        )
        self.slab: memoryview | None = None
        self._mapping: mmap.mmap | None = None
        self.leased = False
        try:
            # Kernel timeouts keep the socket in blocking mode: one syscall per send/recv.
            tv = struct.pack("ll", int(timeout_s), int((timeout_s % 1) * 1e6))
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
            if tcp:
                self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.sock.connect(address)
            self.reader = MessageReader(self.sock, spin_s=spin_s, arena=REPLY_ARENA_BYTES)
            attach = {"v": PROTOCOL_VERSION, "id": 0, "op": "attach", "secret": secret}
            want_slab = want_slab and not tcp
            send_message(self.sock, pack({**attach, "lease": True} if want_slab else attach))
            if tcp:
                reply = msgpack.unpackb(self.reader.read()[0], raw=False)
                if reply.get("code") != ErrorCode.OK:
                    raise BellClosed(f"stream refused: {reply.get('error')}")
                return
            # The reply may carry the slab's fd: read its first bytes with their ancillary data.
            data, fds, _, _ = socket.recv_fds(self.sock, 1 << 16, 1, socket.MSG_CMSG_CLOEXEC)
            if not data:
                raise BellClosed("connection closed")
            self.reader.feed(data)
            reply = msgpack.unpackb(self.reader.read()[0], raw=False)
            if reply.get("code") != ErrorCode.OK:
                for fd in fds:
                    os.close(fd)
                raise BellClosed(f"doorbell refused: {reply.get('error')}")
            if fds and reply.get("slab") is True:
                try:
                    self._mapping = host_memfd.map_readonly(fds[0])  # closes the fd
                    self.slab = memoryview(self._mapping)
                except OSError:
                    self.slab = None  # not a sealed slab: never ask for leases, gets copy
            else:
                for fd in fds:
                    os.close(fd)
        except BaseException:
            self.sock.close()
            raise

    def call(self, messages: list[tuple[bytes, list[Value]]]) -> list[list[Any]]:
        """Send each message and read one reply per message, in order; reply payloads are
        views valid until the next call. Raises OSError."""
        out: list[list[Any]] = []
        self.reader.rewind()
        if sum(len(h) + sum(len(p) for p in ps) for h, ps in messages) <= _PIPELINE_BYTES:
            for header, payloads in messages:
                send_message(self.sock, header, payloads)
            return [self.reader.read() for _ in messages]
        for header, payloads in messages:  # lockstep: large frames in one direction or other
            send_message(self.sock, header, payloads)
            out.append(self.reader.read())
        return out

    def close(self) -> None:
        """Close the socket (the daemon releases this connection's leases) and unmap the slab
        unless views of it are still held (then it goes with the last one)."""
        self.sock.close()
        if self._mapping is not None and self.slab is not None:
            try:
                self.slab.release()
                self._mapping.close()
            except BufferError:
                pass
        self.slab = None
