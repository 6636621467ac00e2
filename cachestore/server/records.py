"""What a cache-daemon request leaves behind: its reply, a ``RequestRecord`` and a log line.

``RequestLog.new_request`` starts a request's record (counters the op fills in as it runs);
``ok`` and ``fail`` build the reply and ``finish`` it: the ``RequestRecord`` goes to
``on_request`` (metrics), and a successful lookup, get, put or delete is appended to the
JSON-lines access log (``--access-log``), one object per line (``ts``, ``op``, ``namespace``,
``keys``, ``hits``). A failure that is not a ``ProtocolError`` is a store failure: the client
gets ``INTERNAL`` (a miss), the daemon lives.

Thread-safe: the log file is written under a lock; ``on_request`` must be thread-safe.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from tiers.base import Value
from tiers.remote.protocol import (
    ErrorCode,
    ProtocolError,
    Reply,
    Request,
    RequestRecord,
    error_header,
)

_LOGGED_OPS = frozenset({"lookup", "get", "put", "delete"})


class RequestLog:
    """Replies, records and logs finished requests; never raises but for the log's I/O."""

    def __init__(
        self,
        on_request: Callable[[RequestRecord], None] | None,
        access_log_path: str | None,
    ) -> None:
        self._on_request = on_request
        self._lock = threading.Lock()
        self._file = open(access_log_path, "a", buffering=1) if access_log_path else None

    @staticmethod
    def new_request(frames: Sequence[Any]) -> Request:
        """A request not parsed yet: op and tenant ``?``, its record's counters at zero."""
        rec = {
            "num_keys": 0,
            "num_hits": 0,
            "bytes_in": 0,
            "bytes_out": 0,
            "path": "tcp",
            "keys": [],
        }
        return Request({}, "?", "?", [], frames, rec, time.perf_counter())

    def ok(self, req: Request, body: dict[str, Any], payloads: list[Value]) -> Reply:
        """The finished success reply: ``body``'s fields and ``payloads`` frames."""
        return self.finish(req, ErrorCode.OK, ok_reply(req, body, payloads))

    def fail(self, req: Request, exc: Exception) -> Reply:
        """The finished error reply: the ``ProtocolError``'s code, else ``INTERNAL``."""
        if isinstance(exc, ProtocolError):
            code, message = exc.code, exc.message
        else:
            code, message = ErrorCode.INTERNAL, f"store error: {exc!r}"[:500]
        return self.finish(
            req, code, Reply(error_header(req.header.get("id", -1), code, message), [])
        )

    def finish(self, req: Request, code: ErrorCode, reply: Reply) -> Reply:
        """Record and log a finished request; returns ``reply``."""
        rec = req.rec
        if self._on_request is not None:
            raced = code in (ErrorCode.OK, ErrorCode.PUT_RACED)
            self._on_request(
                RequestRecord(
                    req.op,
                    req.tenant,
                    code,
                    rec["num_keys"],
                    rec["num_hits"],
                    rec["bytes_in"],
                    rec["bytes_out"],
                    rec["path"],
                    time.perf_counter() - req.start,
                    rec.get("num_raced", 0) if raced else 0,
                )
            )
        if self._file is not None and code == ErrorCode.OK and req.op in _LOGGED_OPS:
            self._write(req)
        return reply

    def _write(self, req: Request) -> None:
        line = json.dumps(
            {
                "ts": round(time.time(), 6),
                "op": req.op,
                "namespace": req.tenant,
                "keys": req.rec["keys"],
                "hits": req.rec["num_hits"],
            }
        )
        with self._lock:
            if self._file is not None:
                self._file.write(line + "\n")

    def close(self) -> None:
        if self._file is not None:
            with self._lock:
                self._file.close()
                self._file = None


def ok_reply(req: Request, body: dict[str, Any], payloads: list[Value]) -> Reply:
    """A success reply to ``req`` (not recorded yet)."""
    return Reply({"id": req.header["id"], "code": 0, "error": "", **body}, payloads)
