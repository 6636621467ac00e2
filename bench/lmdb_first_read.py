"""Where a page-cached LMDB read loses its speed: the first read of freshly written values.

An engine reloads blocks it wrote moments ago (write-through), so every LMDB reload maps those
map pages into the process for the first time; ``bench/tiers.py`` times warm passes. This one
writes ``--blocks`` values of ``--block-bytes`` through ``LmdbTier`` (its writer thread), then
reads them in the same process, each line the same bytes, in this order:

    tier_first      LmdbTier.get_many_into, first touch of the map pages, into the destination
    tier_again      the same, the pages now mapped
    plain_again     a plain read transaction (buffers=True) copying into the same destination
    plain_fresh     a plain read transaction in a fresh subprocess (first touch there)

then, for each thread count of ``--threads`` (the load pipeline splits a chunk over reader
threads), the same blocks in chunks of ``--chunk-blocks`` split over T threads (``threads``):

    tier_tT         LmdbTier.get_many_into per part, as the pipeline's readers
    tier_xxh_tT     the same plus the xxh3 checksum of each block (the store's check)
    memcpy_tT       np.copyto from anonymous memory into the same destination (the medium-free
                    ceiling of a CPU copy on this machine)
    pipe_tT         the load pipeline's read step itself (``LoadPipeline.read_chunk`` with T
                    readers): encoded blocks of the Llama-3-8B shape read through a
                    ``HierarchicalStore`` (a 2-slot host tier over LMDB), checked, into pinned
                    staging rows; no engine around it

The destination is pinned host memory when CUDA is present (as the load pipeline's staging),
else a numpy buffer. Prints JSON (GB/s per line, machine, file system of the path) and a
one-line summary.

    python -m bench.lmdb_first_read [--dir /tmp] [--blocks 256] [--block-bytes 2MiB]
        [--threads 1,2,4,8] [--chunk-blocks 8]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import machine_info  # noqa: E402
from tiers.config import parse_size  # noqa: E402
from tiers.lmdb import LmdbTier  # noqa: E402


def _dest(nbytes: int) -> tuple[np.ndarray, str]:
    try:
        import torch

        if torch.cuda.is_available():
            t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            return t.numpy(), "pinned"
    except ImportError:
        pass
    return np.empty(nbytes, np.uint8), "pageable"


def _plain_read(path: str, keys: list[str], dest: np.ndarray, block: int) -> float:
    import lmdb

    env = lmdb.open(path, readonly=True, lock=False, max_dbs=4, subdir=True)
    try:
        db = env.open_db(b"blocks", create=False)
        t0 = time.perf_counter()
        with env.begin(db=db, buffers=True) as txn:
            for i, key in enumerate(keys):
                buf = txn.get(key.encode())
                dest[i * block : i * block + len(buf)] = np.frombuffer(buf, np.uint8)
        return time.perf_counter() - t0
    finally:
        env.close()


def _split_reads(
    pool: cf.ThreadPoolExecutor, threads: int, keys: list[str], rows: list, chunk: int, part_fn
) -> float:
    """Seconds to run ``part_fn(keys, rows)`` over ``chunk``-block chunks, each chunk split into
    ``threads`` parts run at once (the load pipeline's reader split)."""
    t0 = time.perf_counter()
    for c in range(0, len(keys), chunk):
        ks, rs = keys[c : c + chunk], rows[c : c + chunk]
        step = -(-len(ks) // threads)
        parts = [
            pool.submit(part_fn, ks[i : i + step], rs[i : i + step])
            for i in range(0, len(ks), step)
        ]
        for p in parts:
            p.result()
    return time.perf_counter() - t0


def _thread_scaling(
    tier: LmdbTier, keys: list[str], rows: list, block: int, threads: list[int], chunk: int
) -> dict[str, float]:
    import xxhash

    src = np.random.default_rng(1).integers(0, 255, len(keys) * block, dtype=np.uint8)
    srcs = {k: src[i * block : (i + 1) * block] for i, k in enumerate(keys)}

    def tier_part(ks: list[str], rs: list) -> None:
        got = tier.get_many_into(ks, rs)
        assert all(g == block for g in got), "a value went missing"

    def tier_xxh_part(ks: list[str], rs: list) -> None:
        tier_part(ks, rs)
        for r in rs:
            xxhash.xxh3_64_intdigest(r)

    def memcpy_part(ks: list[str], rs: list) -> None:
        for k, r in zip(ks, rs, strict=True):
            np.copyto(r, srcs[k])

    res: dict[str, float] = {}
    for t in threads:
        with cf.ThreadPoolExecutor(t) as pool:
            for name, fn in (
                ("tier", tier_part),
                ("tier_xxh", tier_xxh_part),
                ("memcpy", memcpy_part),
            ):
                _split_reads(pool, t, keys, rows, chunk, fn)  # warm
                res[f"{name}_t{t}"] = _split_reads(pool, t, keys, rows, chunk, fn)
    return res


def _pipeline_reads(work: str, n: int, threads: list[int], chunk: int) -> dict[str, float]:
    """``pipe_tT`` (module docstring): seconds per thread count."""
    import torch

    from cachestore.codec import HeaderTemplate, encode_block, encoded_size
    from cachestore.store.hierarchical import HierarchicalStore, StoreConfig
    from connectors.offload.pipeline import LoadPipeline
    from connectors.offload.worker import block_meta
    from engine.kv_cache import KVCache, KVCacheSpec
    from tiers import build_tiers
    from tiers.config import parse_tier_config

    spec = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    kv = KVCache(spec, 2, torch.device("cpu"))  # the rows' shape only: nothing is copied in
    meta = block_meta(kv, "bench-first-read")
    slot = encoded_size(meta, keyed=True)
    tiers = {
        "tiers": [
            {"kind": "host", "capacity": f"{2 * slot}B"},
            {"kind": "lmdb", "path": os.path.join(work, "pipe"), "capacity": f"{(n + 8) * slot}B"},
        ]
    }
    store = HierarchicalStore(
        build_tiers(parse_tier_config(tiers), host_slot_bytes=slot),
        StoreConfig(namespace=meta.namespace, promote_on_get=False),
    )
    headers = HeaderTemplate(meta, keyed=True)
    keys = [f"{meta.namespace}/{i:064x}" for i in range(n)]
    payload = np.random.default_rng(2).integers(0, 255, meta.payload_bytes, np.uint8).tobytes()
    lmdb = store.tiers[1]
    for i in range(0, n, 32):
        lmdb.put_many([(k, encode_block(payload, meta, key=k)) for k in keys[i : i + 32]])
    rows = torch.empty((chunk, slot), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    res: dict[str, float] = {}
    gc.collect()
    gc.freeze()  # as the engine does once loaded: no full collection of torch's objects mid-read
    try:
        for t in threads:
            pipe = LoadPipeline(
                kv, store, None, chunk_blocks=chunk, depth=1, headers=headers, readers=t
            )
            try:
                for name in ("warm", f"pipe_t{t}"):
                    t0 = time.perf_counter()
                    for c in range(0, n, chunk):
                        ks = tuple(keys[c : c + chunk])
                        got = pipe.read_chunk(ks, rows[: len(ks)])
                        assert got == len(ks), f"the pipeline read {got} of {len(ks)} blocks"
                    res[name] = time.perf_counter() - t0
            finally:
                pipe.close()
    finally:
        store.close()
    res.pop("warm", None)
    return res


def _fs_type(path: str) -> str:
    best, kind = "", "?"
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) > 2 and path.startswith(parts[1]) and len(parts[1]) > len(best):
                best, kind = parts[1], parts[2]
    return f"{kind} ({best})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--block-bytes", default="2MiB")
    ap.add_argument("--threads", default="1,2,4,8", help="reader thread counts (comma list)")
    ap.add_argument("--chunk-blocks", type=int, default=8, help="blocks a pipeline chunk reads")
    ap.add_argument("--fresh-child", nargs=3, help=argparse.SUPPRESS)  # path, blocks, block
    args = ap.parse_args(argv)
    if args.fresh_child:
        path, n, block = args.fresh_child[0], int(args.fresh_child[1]), int(args.fresh_child[2])
        dest, _ = _dest(n * block)
        dest[:] = 0  # fault the destination in first: only the map's first touch is timed
        print(_plain_read(path, [f"k{i}" for i in range(n)], dest, block))
        return 0
    block = parse_size(args.block_bytes)
    n = args.blocks
    work = tempfile.mkdtemp(prefix="kvtier-lmdb-first-", dir=args.dir)
    path = os.path.join(work, "db")
    tier = LmdbTier(path, 2 * n * block + (64 << 20))
    rng = np.random.default_rng(0)
    keys = [f"k{i}" for i in range(n)]
    payload = rng.integers(0, 255, block, dtype=np.uint8).tobytes()
    t0 = time.perf_counter()
    for i in range(0, n, 32):
        tier.put_many([(k, payload) for k in keys[i : i + 32]])
    write_s = time.perf_counter() - t0
    dest, kind = _dest(n * block)
    dest[:] = 0
    rows = [dest[i * block : (i + 1) * block] for i in range(n)]
    res: dict[str, float] = {}
    for name in ("tier_first", "tier_again"):
        t0 = time.perf_counter()
        got = tier.get_many_into(keys, rows)
        res[name] = time.perf_counter() - t0
        assert all(g == block for g in got), "a value went missing"
    threads = [int(t) for t in args.threads.split(",") if t.strip()]
    res.update(_thread_scaling(tier, keys, rows, block, threads, args.chunk_blocks))
    tier.close()
    pipe = _pipeline_reads(work, n, threads, args.chunk_blocks)
    res["plain_again"] = _plain_read(path, keys, dest, block)
    child = [
        sys.executable,
        "-m",
        "bench.lmdb_first_read",
        "--fresh-child",
        path,
        str(n),
        str(block),
    ]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(child, capture_output=True, text=True, cwd=root, check=True)
    res["plain_fresh"] = float(out.stdout.strip().splitlines()[-1])
    total = n * block
    gbps = {k: round(total / v / 1e9, 2) for k, v in res.items()}
    gbps.update({k: round(n * (2 << 20) / v / 1e9, 2) for k, v in pipe.items()})
    doc = {
        "machine": machine_info(),
        "path": path,
        "file_system": _fs_type(work),
        "destination": kind,
        "blocks": n,
        "block_bytes": block,
        "write_gbps": round(total / write_s / 1e9, 2),
        "read_gbps": gbps,
    }
    print(json.dumps(doc, indent=1))
    print(
        f"lmdb_first_read ({doc['file_system']}, {n} x {block} B into {kind}): "
        + ", ".join(f"{k} {v} GB/s" for k, v in gbps.items())
        + f"; write {doc['write_gbps']} GB/s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
