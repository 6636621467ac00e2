"""Trace readers for ``kvtier analyze``: every format becomes one ``Trace`` of dense block ids.

Formats (docs/analyze.md has the exact schemas):
- ``mooncake``: JSONL ``{"timestamp" (ms), "input_length", "output_length", "hash_ids"}``.
- ``request-log``: the engine's ``--request-log`` JSONL (schema:
  ``cachestore.analyze.request_log``); read: ``ts``, ``prompt_tokens``, ``block_hashes`` (hex).
- ``access-log``: the cache server's JSONL (``ts``, ``op``, ``namespace``, ``keys``); ``get`` and
  ``lookup`` lines are requests, other ops are skipped.
- ``prompts``: JSONL of ``{"prompt": str}`` / ``{"messages": [...]}`` or plain text, one prompt a
  line; tokenized with a transformers tokenizer and hashed with cachestore/hashing.py.

Requests are put in timestamp order (stable). A block repeated within one request is kept once
(its first occurrence), so every request is a list of distinct blocks. Reading does I/O only;
the returned ``Trace`` is immutable by convention (its arrays are not written afterwards).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import IO, Any

import numpy as np

from cachestore.analyze.request_log import BLOCK_HASHES, PROMPT_TOKENS, TS

FORMATS = ("mooncake", "request-log", "access-log", "prompts")
DEFAULT_BLOCK_TOKENS = {"mooncake": 512, "request-log": 16, "access-log": 16, "prompts": 16}
ACCESS_LOG_READ_OPS = frozenset({"get", "lookup"})


@dataclass(frozen=True, slots=True)
class Trace:
    """Requests as runs of dense block ids: request ``r`` is ``block_ids[offsets[r]:offsets[r+1]]``.

    ``input_tokens[r]`` is the prompt length (the last block may be partial); ``block_tokens`` is
    the tokens per block the ids were made with.
    """

    format: str
    block_tokens: int
    block_ids: np.ndarray  # int64, length = total block references
    offsets: np.ndarray  # int64, length = requests + 1
    input_tokens: np.ndarray  # int64, per request
    timestamps_s: np.ndarray  # float64, per request, non-decreasing
    num_unique_blocks: int

    @property
    def num_requests(self) -> int:
        return len(self.input_tokens)

    @property
    def num_block_refs(self) -> int:
        return len(self.block_ids)

    def head(self, num_requests: int) -> Trace:
        """The first ``num_requests`` requests (ids keep their values; unique count recomputed)."""
        end = int(self.offsets[num_requests])
        ids = self.block_ids[:end]
        return Trace(
            self.format,
            self.block_tokens,
            ids,
            self.offsets[: num_requests + 1],
            self.input_tokens[:num_requests],
            self.timestamps_s[:num_requests],
            len(np.unique(ids)),
        )

    def block_token_counts(self) -> np.ndarray:
        """Tokens in each block reference: ``block_tokens``, less for a request's partial tail."""
        counts = np.full(self.num_block_refs, self.block_tokens, dtype=np.int64)
        lens = np.diff(self.offsets)
        last = self.offsets[1:][lens > 0] - 1
        tail = self.input_tokens[lens > 0] - (lens[lens > 0] - 1) * self.block_tokens
        counts[last] = np.clip(tail, 1, self.block_tokens)
        return counts


def open_text(path: Path) -> IO[str]:
    """Open a trace for reading as UTF-8 text; ``*.gz`` files are decompressed on the fly."""
    if str(path).endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def detect_format(path: Path) -> str:
    """Guess the format from the first non-empty line. Raises ValueError on an empty file."""
    with open_text(path) as fh:
        first = next((line for line in fh if line.strip()), None)
    if first is None:
        raise ValueError(f"{path}: empty trace")
    try:
        obj = json.loads(first)
    except json.JSONDecodeError:
        return "prompts"
    if not isinstance(obj, dict):
        return "prompts"
    if "hash_ids" in obj:
        return "mooncake"
    if BLOCK_HASHES in obj:
        return "request-log"
    if "keys" in obj and "op" in obj:
        return "access-log"
    if "prompt" in obj or "messages" in obj:
        return "prompts"
    raise ValueError(f"{path}: cannot tell the trace format from keys {sorted(obj)}; use --format")


def _dedup(keys: Sequence[Hashable]) -> Sequence[Hashable]:
    return keys if len(set(keys)) == len(keys) else list(dict.fromkeys(keys))


def _build(
    fmt: str, block_tokens: int, rows: Sequence[tuple[float, Sequence[Hashable], int]]
) -> Trace:
    """Order rows ``(timestamp_s, keys, input_tokens)`` by time (stable) and intern the keys."""
    ts = np.fromiter((r[0] for r in rows), np.float64, len(rows))
    order = np.argsort(ts, kind="stable")
    if not np.all(order[:-1] < order[1:]):
        rows = [rows[i] for i in order]
        ts = ts[order]
    keys = [_dedup(r[1]) for r in rows]
    lens = np.fromiter((len(k) for k in keys), np.int64, len(keys))
    offsets = np.zeros(len(keys) + 1, np.int64)
    np.cumsum(lens, out=offsets[1:])
    flat = chain.from_iterable(keys)
    if fmt == "mooncake":
        raw = np.fromiter(flat, np.int64, int(offsets[-1]))
        uniq, ids = np.unique(raw, return_inverse=True)
        num_unique = len(uniq)
    else:
        table: dict[Hashable, int] = {}
        ids = np.fromiter(
            (table.setdefault(k, len(table)) for k in flat), np.int64, int(offsets[-1])
        )
        num_unique = len(table)
    input_tokens = np.fromiter((r[2] for r in rows), np.int64, len(rows))
    return Trace(
        fmt, block_tokens, ids.astype(np.int64, copy=False), offsets, input_tokens, ts, num_unique
    )


def _jsonl(path: Path) -> Iterable[tuple[int, dict[str, Any]]]:
    with open_text(path) as fh:
        for lineno, line in enumerate(fh, 1):
            if line.strip():
                try:
                    yield lineno, json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{lineno}: bad JSON: {exc}") from None


def _field(path: Path, lineno: int, obj: dict[str, Any], name: str) -> Any:
    try:
        return obj[name]
    except KeyError:
        raise ValueError(f"{path}:{lineno}: missing field {name!r}") from None


def read_mooncake(path: Path, block_tokens: int) -> Trace:
    rows = [
        (
            float(_field(path, n, o, "timestamp")) / 1000.0,
            _field(path, n, o, "hash_ids"),
            int(_field(path, n, o, "input_length")),
        )
        for n, o in _jsonl(path)
    ]
    return _build("mooncake", block_tokens, rows)


def read_request_log(path: Path, block_tokens: int) -> Trace:
    rows = [
        (
            float(_field(path, n, o, TS)),
            list(_field(path, n, o, BLOCK_HASHES)),
            int(_field(path, n, o, PROMPT_TOKENS)),
        )
        for n, o in _jsonl(path)
    ]
    return _build("request-log", block_tokens, rows)


def read_access_log(path: Path, block_tokens: int) -> Trace:
    rows: list[tuple[float, Sequence[Hashable], int]] = []
    for n, o in _jsonl(path):
        if _field(path, n, o, "op") not in ACCESS_LOG_READ_OPS:
            continue
        ns = str(_field(path, n, o, "namespace"))
        keys = [(ns, k) for k in _field(path, n, o, "keys")]
        rows.append((float(_field(path, n, o, "ts")), keys, len(keys) * block_tokens))
    return _build("access-log", block_tokens, rows)


def _prompt_texts(path: Path) -> list[object]:
    """Each line: a JSON prompt object, or plain text (a JSON string counts as text)."""
    out: list[object] = []
    with open_text(path) as fh:
        for line in fh:
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                obj = line.rstrip("\n")
            if isinstance(obj, dict):
                obj = obj.get("messages", obj.get("prompt"))
                if obj is None:
                    raise ValueError(f"{path}: a prompt line needs 'prompt' or 'messages'")
            out.append(obj)
    return out


def read_prompts(path: Path, block_tokens: int, tokenizer_dir: str | None) -> Trace:
    """Tokenize each prompt with ``AutoTokenizer`` (lazy import) and hash its full blocks."""
    if tokenizer_dir is None:
        raise ValueError("raw prompts need --tokenizer DIR to be tokenized")
    from transformers import AutoTokenizer  # lazy: heavy, and only this format needs it

    from cachestore.hashing import Namespace, hash_request_tokens

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    ns = Namespace(model_fingerprint=f"analyze:{Path(tokenizer_dir).name}", block_size=block_tokens)
    rows: list[tuple[float, Sequence[Hashable], int]] = []
    for i, p in enumerate(_prompt_texts(path)):
        ids: Any
        if isinstance(p, list):
            ids = tok.apply_chat_template(p, tokenize=True, add_generation_prompt=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
        else:
            ids = tok(str(p))["input_ids"]
        ids = list(ids)
        rows.append((float(i), hash_request_tokens(ns, ids), len(ids)))
    return _build("prompts", block_tokens, rows)


READERS: dict[str, Callable[[Path, int], Trace]] = {
    "mooncake": read_mooncake,
    "request-log": read_request_log,
    "access-log": read_access_log,
}


def read_trace(
    path: str | Path,
    fmt: str = "auto",
    block_tokens: int | None = None,
    tokenizer_dir: str | None = None,
) -> Trace:
    """Read any supported trace. Raises ValueError for an unknown format or malformed lines."""
    path = Path(path)
    if fmt == "auto":
        fmt = detect_format(path)
    if fmt not in FORMATS:
        raise ValueError(f"unknown trace format {fmt!r}; choose auto or one of {FORMATS}")
    bt = DEFAULT_BLOCK_TOKENS[fmt] if block_tokens is None else block_tokens
    if bt <= 0:
        raise ValueError(f"--block-tokens must be positive, got {bt}")
    if fmt == "prompts":
        return read_prompts(path, bt, tokenizer_dir)
    return READERS[fmt](path, bt)


def trace_from_requests(
    requests: list[list[Hashable]],
    block_tokens: int = 16,
    input_tokens: list[int] | None = None,
    timestamps_s: list[float] | None = None,
) -> Trace:
    """Build a trace in memory (tests, benchmarks): one list of block keys per request.

    ``input_tokens`` defaults to full blocks; ``timestamps_s`` to the request index.
    """
    n = len(requests)
    tokens = input_tokens or [len(r) * block_tokens for r in requests]
    ts = timestamps_s or [float(i) for i in range(n)]
    if len(tokens) != n or len(ts) != n:
        raise ValueError("input_tokens and timestamps_s need one entry per request")
    return _build("memory", block_tokens, [(ts[i], list(requests[i]), tokens[i]) for i in range(n)])
