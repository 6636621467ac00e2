"""The API process's half of the request log: what happened to a request's first token after
the engine core sampled it (``kvtier serve --request-log FILE`` writes it beside FILE, see
``return_log_path``).

One JSON line per request, keyed like the core's log (``req_id``: the engine request id):
``return_s`` (the core's first-token time -> the API hands the first chunk to the HTTP
response) and ``first_text_s`` (-> the first chunk with text, which a streaming client such as
the production-stack QA client takes as its first token; the finishing one if none has any).
The core's log cannot hold them: it is written by another process, before they are known.
Joined with it (``bench/qa_rounds.py``), a client's TTFT splits into the time before the
engine's arrival stamp, the engine's TTFT, the return and the wait for text. Each line is
flushed at once. Not thread-safe: the event loop writes it.
"""

from __future__ import annotations

import json
from pathlib import Path

from engine.request_log import RequestLog

SUFFIX = ".api.jsonl"


def return_log_path(request_log: str | Path) -> Path:
    """``run.jsonl`` -> ``run.api.jsonl``; any other name gets ``.api.jsonl`` appended."""
    path = Path(request_log)
    if path.suffix == ".jsonl":
        return path.with_suffix(SUFFIX)
    return path.with_name(path.name + SUFFIX)


class ReturnLog:
    """Appends one line per request to ``path`` (through ``engine.request_log.RequestLog``:
    its directory created, each line flushed). Raises OSError at construction when the file
    cannot be opened."""

    def __init__(self, path: str | Path) -> None:
        self._file = RequestLog(path)
        self.path = self._file.path

    def write(self, req_id: str, return_s: float, first_text_s: float) -> None:
        """One request's line. A closed log ignores it."""
        line = {
            "req_id": req_id,
            "return_s": round(return_s, 7),
            "first_text_s": round(first_text_s, 7),
        }
        self._file.write_line(json.dumps(line, separators=(",", ":")))

    def close(self) -> None:
        """Idempotent."""
        self._file.close()
