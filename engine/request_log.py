"""The engine's JSONL request log (``--request-log FILE``): the file writer.

The schema (``RequestLogEntry``, its JSON field names) is ``cachestore.analyze.request_log``,
beside its reader (``kvtier analyze``). Each line is written and flushed at once, so a crash
loses at most the line being written. Not thread-safe: the engine thread writes it.
"""

from __future__ import annotations

from pathlib import Path
from typing import IO

from cachestore.analyze.request_log import RequestLogEntry

__all__ = ["RequestLog", "RequestLogEntry"]


class RequestLog:
    """Appends entries to ``path`` (created with its parent directory; appended to if it
    exists). Raises OSError at construction when the file cannot be opened."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh: IO[str] | None = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        self.num_written = 0

    def write(self, entry: RequestLogEntry) -> None:
        """Append one line and flush. A closed log ignores the entry."""
        self.write_line(entry.to_json())

    def write_line(self, line: str) -> None:
        """Append ``line`` (one JSON object, no newline) and flush; ignored once closed."""
        if self._fh is None:
            return
        self._fh.write(line + "\n")
        self._fh.flush()
        self.num_written += 1

    def close(self) -> None:
        """Idempotent."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None
