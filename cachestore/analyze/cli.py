"""``kvtier analyze TRACE``: hit ratios, tier traffic and prefill savings of a cache hierarchy.

Flags map one-to-one onto ``AnalyzeConfig``; capacities are parsed here. Reads the trace,
writes the requested outputs, prints the table unless ``--json -`` owns stdout. Returns 0, or
2 with a one-line error for bad input.
"""

from __future__ import annotations

import argparse
import re
import sys

from cachestore.analyze.policies import POLICIES
from cachestore.analyze.simulate import TierSpec
from cachestore.analyze.traces import FORMATS, Trace, read_trace
from cachestore.cost.model import (
    DEFAULT_TIER_COSTS,
    MODEL_PROFILES,
    ModelProfile,
    TierCost,
    get_model_profile,
)
from cachestore.kv_format import COMPRESSIONS, stored_bytes_per_token

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_CAP = re.compile(r"^(?P<num>\d+(?:\.\d+)?)\s*(?P<unit>[kmgt]i?)?(?P<kind>tok|b)?$", re.I)
DEFAULT_PROFILE = "llama-3-8b"


def parse_capacity(text: str, block_tokens: int, kv_bytes_per_token: int | None) -> int | None:
    """Blocks for ``text``: ``inf`` -> None, ``1000`` blocks, ``3Mtok`` tokens, ``64GiB`` bytes.

    Token and byte capacities round down to whole blocks. Raises ValueError on bad syntax or
    on bytes without a known KV size per token.
    """
    t = text.strip()
    if t.lower() in ("inf", "unbounded"):
        return None
    m = _CAP.match(t)
    if m is None:
        raise ValueError(f"bad capacity {text!r}: use blocks (1000), tokens (3Mtok), bytes (64GiB)"
                         " or inf")
    unit = (m["unit"] or "").lower()
    kind = (m["kind"] or "").lower()
    if not kind and unit:  # "64Gi" or "64G" alone: bytes are the only sensible reading
        kind = "b"
    value = float(m["num"]) * _UNITS[unit]
    if kind == "tok":
        return int(value // block_tokens)
    if kind == "b":
        if kv_bytes_per_token is None:
            raise ValueError(f"capacity {text!r} is in bytes: give --kv-bytes-per-token or "
                             "--model-profile")
        return int(value // (kv_bytes_per_token * block_tokens))
    if value != int(value):
        raise ValueError(f"capacity {text!r}: a block count must be an integer")
    return int(value)


def parse_tier(text: str, default_policy: str, block_tokens: int,
               kv_bytes_per_token: int | None) -> TierSpec:
    """``NAME=CAPACITY[:POLICY]`` -> TierSpec."""
    name, sep, rest = text.partition("=")
    if not sep or not name:
        raise ValueError(f"bad --tier {text!r}: use NAME=CAPACITY[:POLICY]")
    cap, _, policy = rest.partition(":")
    policy = policy or default_policy
    if policy not in POLICIES:
        raise ValueError(f"--tier {text!r}: unknown policy {policy!r}; choose {sorted(POLICIES)}")
    return TierSpec(name, parse_capacity(cap, block_tokens, kv_bytes_per_token), policy)


def parse_tier_cost(text: str) -> TierCost:
    """``NAME=LATENCY_S,BANDWIDTH_BYTES_PER_S`` -> TierCost."""
    name, sep, rest = text.partition("=")
    parts = rest.split(",")
    if not sep or len(parts) != 2:
        raise ValueError(f"bad --tier-cost {text!r}: use NAME=LATENCY_S,BYTES_PER_S")
    return TierCost(name, float(parts[0]), float(parts[1]))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", help="trace file (Mooncake JSONL, kvtier request/access log, "
                        "or prompts)")
    parser.add_argument("--format", default="auto", choices=("auto",) + FORMATS)
    parser.add_argument("--tokenizer", metavar="DIR", help="tokenizer directory for raw prompts")
    parser.add_argument("--block-tokens", type=int, default=None,
                        help="tokens per block (default 512 for Mooncake traces, else 16)")
    parser.add_argument("--tier", action="append", default=[], metavar="NAME=CAP[:POLICY]",
                        help="a tier, top first; repeatable. CAP: blocks, inf, 3Mtok, 64GiB "
                        "(default: host=inf)")
    parser.add_argument("--policy", default="lru", choices=sorted(POLICIES),
                        help="eviction policy of tiers that name none")
    parser.add_argument("--model-profile", choices=sorted(MODEL_PROFILES),
                        help=f"KV size per token (default {DEFAULT_PROFILE} for pricing)")
    parser.add_argument("--kv-bytes-per-token", type=int, help="KV size per token, in bytes")
    parser.add_argument("--kv-compression", default="none", choices=COMPRESSIONS,
                        help="the format the tiers store (the engine's compression setting): "
                        "lossless is 12-bit blocks, ~0.76x the bytes; needs a model profile")
    parser.add_argument("--tier-cost", action="append", default=[],
                        metavar="NAME=LATENCY_S,BYTES_PER_S", help="override a tier's cost")
    parser.add_argument("--sweep", metavar="TIER=CAP1,CAP2,...",
                        help="hit ratio at each capacity of one tier (others fixed)")
    parser.add_argument("--replay", action="store_true",
                        help="replay all-LRU hierarchies too (slower; same numbers)")
    parser.add_argument("--json", metavar="FILE", help="write the JSON document (- for stdout)")
    parser.add_argument("--plot", metavar="FILE.png", help="hit-ratio curve and reuse CDF")
    parser.add_argument("--report", metavar="FILE.md", help="Markdown report")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def build_config(args: argparse.Namespace, trace: Trace):  # -> AnalyzeConfig
    from cachestore.analyze.summary import AnalyzeConfig

    if args.kv_bytes_per_token is not None and args.kv_bytes_per_token <= 0:
        raise ValueError("--kv-bytes-per-token must be positive")
    compression = getattr(args, "kv_compression", "none")
    if compression != "none" and args.kv_bytes_per_token:
        raise ValueError(f"--kv-compression {compression} needs --model-profile, not "
                         "--kv-bytes-per-token: the format's size depends on the layer count")
    explicit_kv = args.kv_bytes_per_token or (
        _stored(get_model_profile(args.model_profile), compression) if args.model_profile
        else None)
    bt = trace.block_tokens
    tiers = tuple(parse_tier(t, args.policy, bt, explicit_kv) for t in args.tier or ["host=inf"])
    if len({t.name for t in tiers}) != len(tiers):
        raise ValueError("tier names must be distinct")
    costs = dict(DEFAULT_TIER_COSTS)
    for text in args.tier_cost:
        c = parse_tier_cost(text)
        costs[c.name] = c
    sweep_tier, sweep_caps = None, ()
    if args.sweep:
        sweep_tier, sep, caps = args.sweep.partition("=")
        if not sep or not caps:
            raise ValueError(f"bad --sweep {args.sweep!r}: use TIER=CAP1,CAP2,...")
        sweep_caps = tuple(parse_capacity(c, bt, explicit_kv) for c in caps.split(","))
    profile = args.model_profile or (None if args.kv_bytes_per_token else DEFAULT_PROFILE)
    kv = explicit_kv or _stored(get_model_profile(DEFAULT_PROFILE), compression)
    return AnalyzeConfig(tiers=tiers, kv_bytes_per_token=kv, model_profile=profile,
                         kv_compression=compression,
                         tier_costs=costs, sweep_tier=sweep_tier, sweep_capacities=sweep_caps,
                         force_replay=args.replay)


def _stored(profile: ModelProfile, compression: str) -> int:
    """Bytes a token of ``profile`` takes in the tiers when stored as ``compression``."""
    return stored_bytes_per_token(profile.kv_bytes_per_token, profile.num_layers, compression)


def main(args: argparse.Namespace) -> int:
    from cachestore.analyze import report
    from cachestore.analyze.summary import analyze

    try:
        trace = read_trace(args.trace, args.format, args.block_tokens, args.tokenizer)
        cfg = build_config(args, trace)
    except (OSError, ValueError) as exc:
        print(f"kvtier analyze: {exc}", file=sys.stderr)
        return 2
    bar = None
    if not args.quiet and sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=trace.num_requests, unit="req", file=sys.stderr, desc="replay")
    try:
        doc = analyze(trace, cfg, progress=bar.update if bar else None,
                      keep_distances=bool(args.plot))
    except ValueError as exc:
        print(f"kvtier analyze: {exc}", file=sys.stderr)
        return 2
    finally:
        if bar is not None:
            bar.close()
    doc["trace"] = str(args.trace)
    if args.json:
        report.write_json(doc, args.json)
    if args.plot:
        report.write_plot(doc, args.plot)
    if args.report:
        report.write_markdown(doc, args.report, plot_path=args.plot)
    if args.json != "-":
        print(report.format_table(doc))
    return 0
