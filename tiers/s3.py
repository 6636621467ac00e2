"""S3 tier: encoded blocks grouped into objects, so a long chain costs a few requests, not n.

Object layout under ``prefix`` in ``bucket`` (any S3-compatible endpoint: AWS, MinIO, Ceph, moto):

- ``{prefix}g/{uuid}`` — a *group*: up to ``blocks_per_object`` values of one ``put_many``
  call, consecutive in chain order, concatenated. Immutable once written (a fresh uuid each time).
- ``{prefix}k/{key}`` — a *pointer* per block key: a small msgpack map ``{"g": group object,
  "k": [the group's keys], "o": [offsets], "n": [lengths]}``. Every pointer of a group carries
  the group's whole manifest, so reading ONE pointer locates every key of its group.

Reads walk the chain: the pointer of the first unresolved key resolves it and the following
keys that the manifest lists in the same order; then the next unresolved key. Pointers of the
likely next groups (every ``blocks_per_object`` keys) are fetched in parallel speculatively, so
``lookup`` of n chain keys written together costs about n / blocks_per_object GETs in one or two
round trips; ``get_many`` adds range GETs of the groups touched, each span cut into pieces of at
most ``read_chunk_bytes`` so that one large group still uses the whole pool, all in parallel and
read (``readinto``) straight into one recycled buffer per call (``tiers.buffers``): no copy after
the socket. ``get_many_into`` is the protocol's default on top (one memcpy per value, far below
the network's cost; one range GET per key instead would multiply requests). Keys written by
different ``put_many`` calls, or looked up out of chain order, still resolve correctly, at up to
one pointer GET per key.

Trade-offs, and why:
- Writes cost 1 + blocks_per_object PUTs per group (pointers are ~1-2 KiB each): the tier sits
  at the bottom of the hierarchy and is written by background demotion, while reads sit on a
  request's critical path. A ``put_many`` is two rounds of parallel PUTs on the pool: its groups,
  then all their pointers. Pointers are written after their group, so a crash between the two
  leaves an unreachable group (garbage for a lifecycle rule), never a dangling pointer.
- A key reached through a group-mate's manifest is served from that group even if the key was
  overwritten later in another group. Keys are content hashes of (namespace, token chain), so
  both values encode the same block; a key read through its own pointer always gets the latest.
- ``delete_many`` removes the keys' pointers and rewrites the pointers of their group-mates so
  that no manifest lists a deleted key (exact for the normal write-once case). Group objects are
  not deleted (other keys may still live in them); expire ``g/`` and ``k/`` with an S3 lifecycle
  rule of equal age — an expired group turns its keys into misses, never into wrong data.
- ``usage`` LISTs the prefix (one request per 1000 objects): for dashboards, not a hot path.
- No ``capacity``: the tier never evicts (``put_many`` returns no ``Evicted``). S3 is the
  bottom of the hierarchy, where the store would drop evictions anyway, and LRU bookkeeping
  would cost a write per read. Bound the bucket with a lifecycle rule expiring ``{prefix}g/``
  and ``{prefix}k/`` after the same age (e.g. 7 days); what expires becomes a miss.

Every botocore error (timeouts, connection refused, HTTP errors other than "no such key") and
``OSError`` becomes ``TierError``. Thread-safe: one boto3 client (thread-safe) from a private
session, a thread pool for parallel requests; no other shared mutable state.
``get_many`` returns memoryviews into downloaded buffers, valid for as long as they are held.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

from tiers.base import Evicted, Tier, TierError, TierUsage, Value
from tiers.buffers import ReadBuffers
from tiers.config import S3TierConfig  # noqa: F401  (re-exported beside its tier)
from tiers.s3_layout import Location, Pointer, resolve
from tiers.shared import backend_errors, last_value_wins

T = TypeVar("T")
R = TypeVar("R")


class S3Tier(Tier):
    """Tier over an S3 bucket prefix. See the module docstring for the layout and semantics."""

    name = "s3"
    owns_read_values = True  # get_many: views of recycled buffers (tiers.buffers)

    def __init__(self, config: S3TierConfig) -> None:
        import boto3
        from botocore.config import Config
        from botocore.exceptions import BotoCoreError, ClientError

        self.config = config
        self._client_error = ClientError
        self._errors: tuple[type[BaseException], ...] = (BotoCoreError, ClientError, OSError)
        creds: dict[str, Any] = {}
        if config.access_key_id is not None:
            creds = {"aws_access_key_id": config.access_key_id,
                     "aws_secret_access_key": config.secret_access_key}  # fmt: skip
        boto_config = Config(
            connect_timeout=config.connect_timeout_s,
            read_timeout=config.timeout_s,
            retries={"max_attempts": config.max_attempts, "mode": "standard"},
            max_pool_connections=config.max_pool_connections,
        )
        # A private session: boto3's default session is not thread-safe to create clients from.
        session = boto3.session.Session(region_name=config.region, **creds)
        self._s3 = session.client("s3", endpoint_url=config.endpoint_url, config=boto_config)
        self._pool = ThreadPoolExecutor(config.max_pool_connections, thread_name_prefix="kv-s3")
        self._buffers = ReadBuffers()
        self._closed = False

    @classmethod
    def from_config(cls, config: S3TierConfig) -> S3Tier:
        """Registry factory (``tiers.s3:S3Tier.from_config``)."""
        return cls(config)

    def __repr__(self) -> str:
        return f"S3Tier({self.config!r})"

    # -- object names and requests ---------------------------------------------------------

    def _pointer_name(self, key: str) -> str:
        return f"{self.config.prefix}k/{key}"

    def _call(self, op: str, fn: Callable[[], T]) -> T:
        where = f"on {self.config.bucket}/{self.config.prefix}"
        with backend_errors(self._errors, "s3", op, where, closed=self._closed):
            return fn()

    def _get(self, name: str) -> bytes | None:
        """Object body, or None if absent. Raises TierError on any other failure."""
        try:
            body: bytes = self._call("get", lambda: self._s3.get_object(
                Bucket=self.config.bucket, Key=name)["Body"].read())  # fmt: skip
            return body
        except TierError as exc:
            cause = exc.__cause__
            if isinstance(cause, self._client_error):
                code = cause.response.get("Error", {}).get("Code")
                if code in ("NoSuchKey", "404", "NotFound"):
                    return None
            raise

    def _get_into(self, name: str, start: int, dest: memoryview) -> bool:
        """Bytes ``start .. start + len(dest)`` of object ``name`` into ``dest``; False if the
        object is absent or shorter. Raises TierError on any other failure."""

        def read() -> bool:
            body = self._s3.get_object(
                Bucket=self.config.bucket,
                Key=name,
                Range=f"bytes={start}-{start + dest.nbytes - 1}",
            )["Body"]
            got = 0
            with body:
                while got < dest.nbytes:
                    n = body.readinto(dest[got:])
                    if not n:
                        return False
                    got += n
            return True

        try:
            return self._call("get", read)
        except TierError as exc:
            cause = exc.__cause__
            if isinstance(cause, self._client_error):
                code = cause.response.get("Error", {}).get("Code")
                if code in ("NoSuchKey", "404", "NotFound", "InvalidRange"):
                    return False
            raise

    def _put(self, name: str, body: bytes | memoryview) -> None:
        self._call("put", lambda: self._s3.put_object(
            Bucket=self.config.bucket, Key=name, Body=body))  # fmt: skip

    def _parallel(self, fn: Callable[[T], R], args: Iterable[T]) -> list[R]:
        """``fn`` over ``args`` on the pool, results in order; the first TierError propagates."""
        futures = [self._pool.submit(fn, a) for a in args]
        return [f.result() for f in futures]

    def _read_pointer(self, key: str) -> Pointer | None:
        raw = self._get(self._pointer_name(key))
        return None if raw is None else Pointer.unpack(raw)

    # -- resolution ------------------------------------------------------------------------

    def _resolve(self, keys: Sequence[str], stop_at_miss: bool) -> list[Location | None]:
        """``s3_layout.resolve`` with this tier's pointer reads (parallel, on the pool)."""
        return resolve(
            keys,
            lambda names: self._parallel(self._read_pointer, names),
            self.config.blocks_per_object,
            max(1, self.config.max_pool_connections // 2),
            stop_at_miss,
        )

    # -- Tier API --------------------------------------------------------------------------

    def lookup(self, keys: Sequence[str]) -> int:
        """Leading keys present (pointer GETs only; about len/blocks_per_object of them)."""
        return len(self._resolve(keys, stop_at_miss=True))

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """Pointer GETs only (parallel), past a missing key too."""
        return [loc is not None for loc in self._resolve(keys, stop_at_miss=False)]

    def get_many(self, keys: Sequence[str]) -> list[Value | None]:
        """Resolve, then range GETs of the groups' spans, in parallel pieces of at most
        ``read_chunk_bytes``, into one buffer. A missing group or short read -> None."""
        locs = self._resolve(keys, stop_at_miss=False)
        spans: dict[str, tuple[int, int]] = {}
        for loc in locs:
            if loc is not None:
                lo, hi = spans.get(loc.group, (loc.offset, loc.offset + loc.length))
                spans[loc.group] = (min(lo, loc.offset), max(hi, loc.offset + loc.length))
        dest = self._buffers.take(sum(hi - lo for lo, hi in spans.values()))
        base: dict[str, int] = {}  # group -> where its span starts in ``dest``
        pieces: list[tuple[str, int, memoryview]] = []
        pos, chunk = 0, self.config.read_chunk_bytes
        for group, (lo, hi) in spans.items():
            base[group] = pos
            for start in range(lo, hi, chunk):
                end = min(hi, start + chunk)
                pieces.append((group, start, dest[pos + start - lo : pos + end - lo]))
            pos += hi - lo
        ok = self._parallel(lambda p: self._get_into(*p), pieces)
        failed = {group for (group, _, _), good in zip(pieces, ok, strict=True) if not good}
        out: list[Value | None] = []
        for loc in locs:
            if loc is None or loc.group in failed:
                out.append(None)
                continue
            start = base[loc.group] + loc.offset - spans[loc.group][0]
            out.append(dest[start : start + loc.length])
        return out

    def put_many(self, items: Sequence[tuple[str, Value]]) -> list[Evicted]:
        """Write groups of ``blocks_per_object`` consecutive items, then their pointers.

        A key given twice keeps its last value. Never evicts (capacity is the bucket's).
        """
        unique = last_value_wins(items)
        bpo = self.config.blocks_per_object
        chunks = [unique[s : s + bpo] for s in range(0, len(unique), bpo)]
        groups = [f"{self.config.prefix}g/{uuid.uuid4().hex}" for _ in chunks]
        # Two rounds of parallel PUTs: every group, then every pointer (a pointer never names
        # a group that is not stored yet). One pointer after another behind each group made a
        # put_many of 32 blocks 1 + 16 requests deep: with 20 ms added to every request
        # (bench/tiers.py --s3-latency-ms 20), 0.45x raw boto3 at 2 MiB, now 0.65-0.70x.
        self._parallel(
            lambda gc: self._put(gc[0], b"".join(v for _, v in gc[1])),
            zip(groups, chunks, strict=True),
        )
        pointers: list[tuple[str, bytes]] = []
        for group, chunk in zip(groups, chunks, strict=True):
            body = Pointer.for_group(group, chunk).pack()
            pointers += [(self._pointer_name(key), body) for key, _ in chunk]
        self._parallel(lambda nb: self._put(*nb), pointers)
        return []

    def delete_many(self, keys: Sequence[str]) -> int:
        """Delete pointers; rewrite group-mates' pointers so no manifest lists a deleted key."""
        wanted = list(dict.fromkeys(keys))
        pointers = self._parallel(self._read_pointer, wanted)
        present = {
            k: p for k, p in zip(wanted, pointers, strict=True) if p is not None and k in p.keys
        }
        if not present:
            return 0
        names = [{"Key": self._pointer_name(k)} for k in present]
        for s in range(0, len(names), 1000):  # DeleteObjects takes at most 1000 keys
            self._call(
                "delete",
                partial(
                    self._s3.delete_objects,
                    Bucket=self.config.bucket,
                    Delete={"Objects": names[s : s + 1000], "Quiet": True},
                ),
            )
        mates = list({m: None for p in present.values() for m in p.keys if m not in present})
        for mate, ptr in zip(mates, self._parallel(self._read_pointer, mates), strict=True):
            if ptr is None or not set(ptr.keys) & present.keys():
                continue
            self._put(self._pointer_name(mate), ptr.without(present).pack())
        return len(present)

    def ping(self) -> None:
        self._call("ping", lambda: self._s3.head_bucket(Bucket=self.config.bucket))

    def usage(self) -> TierUsage:
        """Bytes in group objects (including superseded values) and the number of pointers."""
        used, entries = 0, 0
        pages = self._call("usage", lambda: list(self._s3.get_paginator("list_objects_v2")
                                                 .paginate(Bucket=self.config.bucket,
                                                           Prefix=self.config.prefix)))  # fmt: skip
        for page in pages:
            for obj in page.get("Contents", []):
                rest = obj["Key"][len(self.config.prefix) :]
                if rest.startswith("g/"):
                    used += int(obj["Size"])
                elif rest.startswith("k/"):
                    entries += 1
        return TierUsage(used_bytes=used, capacity_bytes=None, num_entries=entries)

    def close(self) -> None:
        """Stop the request pool and close the client's connections. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        self._s3.close()
