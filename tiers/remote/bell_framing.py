"""Framing of the same-host doorbell (``cachestore.server.doorbell``): one message on a Unix stream
socket is ``<II`` (header length, payload count), one ``<Q`` size per payload, the msgpack
header, the payloads. Both directions, daemon and client (``tiers.remote.conn``) alike.

A message may carry file descriptors (SCM_RIGHTS): the daemon's attach reply hands the client
its sealed host slab that way (``send_message(..., fds=...)``; the client reads that one reply
with ``socket.recv_fds`` and ``MessageReader.feed``s the bytes).

The daemon reads a connection's first message with ``read_attach``: only a small header with
no payloads, within a deadline, so a peer that never attaches costs a few hundred bytes and
a few seconds, never a buffer. Later messages are checked against ``ServerLimits`` before a
payload byte is read: header size, payload count, each payload's size and their sum.

Not thread-safe: one reader and one sender per socket.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Sequence
from typing import Any

from tiers.base import Value
from tiers.remote.protocol import ServerLimits

_PREFIX = struct.Struct("<II")
# The largest first message (the attach: op, secret, id, lease; ~80 bytes packed).
ATTACH_MAX_HEADER_BYTES = 512


class BellClosed(ConnectionError):
    """The peer closed the connection (or sent something that is not a message)."""


def send_message(
    sock: socket.socket, header: bytes, payloads: Sequence[Value] = (), fds: Sequence[int] = ()
) -> None:
    """Send one framed message (one ``sendmsg`` in the common case), with ``fds`` attached
    to its first byte when given. Raises OSError."""
    parts: list[Value] = [
        struct.pack(
            f"<II{len(payloads)}Q", len(header), len(payloads), *(len(p) for p in payloads)
        ),
        header,
        *payloads,
    ]
    total = sum(len(p) for p in parts)
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))]
    sent = sock.sendmsg(parts, ancillary if fds else [])
    if sent < total:  # the socket buffer did not take it whole: the rest, part by part
        for part in parts:
            size = len(part)
            if sent >= size:
                sent -= size
                continue
            view = memoryview(part)
            sock.sendall((view if view.format == "B" else view.cast("B"))[sent:])
            sent = 0


def read_attach(sock: socket.socket, timeout_s: float) -> bytes:
    """The header of a connection's first message, which must carry no payloads and at most
    ``ATTACH_MAX_HEADER_BYTES``, all of it within ``timeout_s`` (a total, not per read).
    Reads exactly that message (nothing after it). Raises BellClosed (too large, payloads,
    EOF) or TimeoutError; leaves the socket in blocking mode only on success."""
    deadline = time.monotonic() + timeout_s
    prefix = _recv_exactly(sock, _PREFIX.size, deadline)
    header_len, count = _PREFIX.unpack(prefix)
    if count != 0 or header_len > ATTACH_MAX_HEADER_BYTES:
        raise BellClosed("the first message must be a small attach without payloads")
    header = _recv_exactly(sock, header_len, deadline)
    sock.settimeout(None)
    return header


def _recv_exactly(sock: socket.socket, n: int, deadline: float) -> bytes:
    out = bytearray()
    while len(out) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no attach within the deadline")
        sock.settimeout(left)
        got = sock.recv(n - len(out))
        if not got:
            raise BellClosed("connection closed")
        out += got
    return bytes(out)


class MessageReader:
    """Reads framed messages from one socket into a reused buffer. Not thread-safe.

    ``read`` returns ``[header, payload...]`` (the header as bytes, payloads as bytearrays,
    or memoryviews of the arena);
    raises BellClosed at EOF or for a message over ``limits``, OSError on socket errors.
    """

    def __init__(
        self,
        sock: socket.socket,
        limits: ServerLimits | None = None,
        spin_s: float = 0.0,
        arena: int = 0,
    ) -> None:
        """``arena``: up to this many bytes of payloads between two ``rewind`` calls are views
        of one buffer reused from rewind to rewind (no allocation, no page faults per
        payload; a client's replies are valid until its next call, a daemon's request
        payloads until its reply); payloads past it, and all with 0, are bytearrays."""
        self._sock = sock
        self._limits = limits
        self._spin_s = spin_s
        self._buf = bytearray(1 << 16)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0
        self._arena_max = arena
        self._arena = memoryview(bytearray(0))
        self._arena_pos = 0

    def rewind(self) -> None:
        """Reuse the arena from its start: payloads read before are overwritten from now on."""
        self._arena_pos = 0

    def read(self) -> list[Any]:
        self._fill(_PREFIX.size)
        header_len, count = _PREFIX.unpack_from(self._buf, self._start)
        lim = self._limits
        if lim is not None and (
            header_len > lim.max_header_bytes or count > lim.max_keys_per_request
        ):
            raise BellClosed("message over the limits")
        head = _PREFIX.size + 8 * count + header_len
        self._fill(head)
        sizes = struct.unpack_from(f"<{count}Q", self._buf, self._start + _PREFIX.size)
        if lim is not None and (
            any(s > lim.max_frame_bytes for s in sizes) or sum(sizes) > lim.max_request_bytes
        ):
            raise BellClosed("payload over the limits")
        pos = self._start + head
        out: list[Any] = [bytes(self._view[pos - header_len : pos])]
        self._start = pos
        for size in sizes:
            out.append(self._take(size))
        return out

    def feed(self, data: bytes) -> None:
        """Take bytes already received from the socket (e.g. by ``socket.recv_fds``) as the
        next ones to read."""
        have = self._end - self._start
        new = bytearray(max(len(self._buf), have + len(data)))
        new[:have] = self._view[self._start : self._end]
        new[have : have + len(data)] = data
        self._buf, self._view = new, memoryview(new)
        self._start, self._end = 0, have + len(data)

    def _fill(self, n: int) -> None:
        """Make ``n`` bytes available at ``_start`` (compacting or growing the buffer)."""
        if self._end - self._start >= n:
            return
        if self._start + n > len(self._buf):
            have = self._end - self._start
            if n > len(self._buf):
                new = bytearray(max(n, 2 * len(self._buf)))
                new[:have] = self._view[self._start : self._end]
                self._buf, self._view = new, memoryview(new)
            else:
                self._view[:have] = self._view[self._start : self._end]
            self._start, self._end = 0, have
        while self._end - self._start < n:
            got = self._recv(self._view[self._end :])
            if got == 0:
                raise BellClosed("connection closed")
            self._end += got

    def _recv(self, into: memoryview) -> int:
        """One read: polled for up to ``spin_s`` (yielding between polls), then blocking."""
        if self._spin_s > 0:
            end = time.perf_counter() + self._spin_s
            while True:
                try:
                    return self._sock.recv_into(into, 0, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    if time.perf_counter() > end:
                        break
                    os.sched_yield()
        return self._sock.recv_into(into)

    def _take(self, size: int) -> bytearray | memoryview:
        end = self._arena_pos + size
        if end > self._arena_max:
            out: bytearray | memoryview = bytearray(size)
            view = memoryview(out)
        else:
            if end > len(self._arena):  # a new, larger arena; views of the old one keep it
                grown = min(max(2 * len(self._arena), end, 1 << 20), self._arena_max)
                self._arena = memoryview(bytearray(grown))  # alive
                self._arena_pos, end = 0, size
            out = view = self._arena[self._arena_pos : end]
            self._arena_pos = end
        have = min(size, self._end - self._start)
        view[:have] = self._view[self._start : self._start + have]
        self._start += have
        pos = have
        while pos < size:  # straight into the payload, not through the buffer
            got = self._recv(view[pos:])  # polled too: a large payload comes in many pieces
            if got == 0:
                raise BellClosed("connection closed")
            pos += got
        return out
