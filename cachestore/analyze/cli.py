"""``kvtier analyze TRACE``: hit ratios, tier traffic and prefill savings of a cache hierarchy.

Flags map one-to-one onto ``AnalyzeConfig``; capacities are parsed here, with the size grammar
of every other kvtier setting (``tiers.config.parse_quantity``) and converted to blocks. Reads the trace,
writes the requested outputs, prints the table unless ``--json -`` owns stdout. Returns 0, or
2 with a one-line error for bad input.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

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
from tiers.sizes import BLOCKS, BYTES, TOKENS, UNBOUNDED, Size, parse_quantity

if TYPE_CHECKING:
    from cachestore.analyze.summary import AnalyzeConfig

DEFAULT_PROFILE = "llama-3-8b"
CAPACITY_KINDS = (BYTES, BLOCKS, TOKENS, UNBOUNDED)


def to_blocks(
    size: Size, block_tokens: int, kv_bytes_per_token: int | None, what: str = "capacity"
) -> int | None:
    """Whole blocks in ``size`` (None: unbounded); tokens and bytes round down. Raises
    ValueError naming ``what`` for bytes without a known KV size per token."""
    if size.amount is None:
        return None
    if size.unit == BLOCKS:
        return size.amount
    if size.unit == TOKENS:
        return size.amount // block_tokens
    if kv_bytes_per_token is None:
        raise ValueError(
            f"{what}: {size.text!r} is in bytes: give --kv-bytes-per-token or --model-profile"
        )
    return size.amount // (kv_bytes_per_token * block_tokens)


def parse_capacity(
    text: str, block_tokens: int, kv_bytes_per_token: int | None, what: str = "capacity"
) -> int | None:
    """Blocks for ``text`` (``tiers.config.parse_quantity``'s grammar): ``inf`` -> None,
    ``1000blocks``, ``3Mtok`` tokens, ``64GiB`` bytes; a bare number is refused. Raises
    ValueError naming ``what``."""
    return to_blocks(
        parse_quantity(text, what, CAPACITY_KINDS), block_tokens, kv_bytes_per_token, what
    )


def parse_tier(
    text: str, default_policy: str, block_tokens: int, kv_bytes_per_token: int | None
) -> tuple[TierSpec, Size]:
    """``NAME=CAPACITY[:POLICY]`` -> the TierSpec and its capacity as written."""
    name, sep, rest = text.partition("=")
    if not sep or not name:
        raise ValueError(f"bad --tier {text!r}: use NAME=CAPACITY[:POLICY], e.g. host=64GiB")
    cap, _, policy = rest.partition(":")
    policy = policy or default_policy
    if policy not in POLICIES:
        raise ValueError(f"--tier {text!r}: unknown policy {policy!r}; choose {sorted(POLICIES)}")
    what = f"--tier {text}"
    size = parse_quantity(cap, what, CAPACITY_KINDS)
    blocks = to_blocks(size, block_tokens, kv_bytes_per_token, what)
    return TierSpec(name, blocks, policy), size


def parse_tier_cost(text: str) -> TierCost:
    """``NAME=LATENCY_S,BANDWIDTH_BYTES_PER_S`` -> TierCost."""
    name, sep, rest = text.partition("=")
    parts = rest.split(",")
    if not sep or len(parts) != 2:
        raise ValueError(f"bad --tier-cost {text!r}: use NAME=LATENCY_S,BYTES_PER_S")
    return TierCost(name, float(parts[0]), float(parts[1]))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Mutates ``parser``: adds every ``kvtier analyze`` argument, each with help text."""
    _add_trace_arguments(parser)
    _add_hierarchy_arguments(parser)
    _add_output_arguments(parser)


def _add_trace_arguments(parser: argparse.ArgumentParser) -> None:
    """The trace: its file, format, tokenizer and block size."""
    parser.add_argument(
        "trace", help="trace file (Mooncake JSONL, kvtier request/access log, or prompts)"
    )
    parser.add_argument(
        "--format",
        default="auto",
        choices=("auto",) + FORMATS,
        help="trace format (auto: from the file's first record)",
    )
    parser.add_argument(
        "--tokenizer", metavar="DIR", help="tokenizer directory for raw prompts; default: none"
    )
    parser.add_argument(
        "--block-tokens",
        type=int,
        default=None,
        help="tokens per block (default 512 for Mooncake traces, else 16)",
    )


def _add_hierarchy_arguments(parser: argparse.ArgumentParser) -> None:
    """The simulated tiers and the cost model that prices them."""
    parser.add_argument(
        "--tier",
        action="append",
        default=[],
        metavar="NAME=CAP[:POLICY]",
        help="a tier, top first; repeatable. CAP: bytes (64GiB, 500GB; "
        "Gi = 2^30, G = 10^9), blocks (1000blocks), tokens (3Mtok) or inf; a "
        "bare number is refused (default: host=inf)",
    )
    parser.add_argument(
        "--policy",
        default="lru",
        choices=sorted(POLICIES),
        help="eviction policy of tiers that name none",
    )
    parser.add_argument(
        "--model-profile",
        choices=sorted(MODEL_PROFILES),
        help=f"the model whose KV size per token turns byte capacities into "
        f"blocks and prices prefill (default: {DEFAULT_PROFILE}, unless "
        "--kv-bytes-per-token is given)",
    )
    parser.add_argument(
        "--kv-bytes-per-token",
        type=int,
        help="KV size per token, in bytes (default: the model profile's)",
    )
    parser.add_argument(
        "--kv-compression",
        default="none",
        choices=COMPRESSIONS,
        help="the format the tiers store (the engine's compression setting): "
        "lossless is 12-bit blocks, ~0.76x the bytes; needs a model profile",
    )
    parser.add_argument(
        "--tier-cost",
        action="append",
        default=[],
        metavar="NAME=LATENCY_S,BYTES_PER_S",
        help="override a tier's cost; repeatable (default: the built-in costs)",
    )


def _add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """What to run beyond the one hierarchy (a sweep, replays) and where results go."""
    parser.add_argument(
        "--sweep",
        metavar="TIER=CAP1,CAP2,...",
        help="one tier at each capacity, the others fixed: every tier's hit "
        "ratio, the total and net saved per point (plotted with --plot); "
        "default: no sweep",
    )
    parser.add_argument(
        "--replay",
        action="store_true",
        help="replay all-LRU hierarchies too (slower; same numbers)",
    )
    parser.add_argument(
        "--json", metavar="FILE", help="write the JSON document (- for stdout); default: none"
    )
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        help="one hit-ratio plot per tier (its "
        "capacity marked), the sweep, and the reuse-distance CDF; default: none",
    )
    parser.add_argument("--report", metavar="FILE.md", help="Markdown report; default: none")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def build_config(args: argparse.Namespace, trace: Trace) -> AnalyzeConfig:
    from cachestore.analyze.summary import AnalyzeConfig

    if args.kv_bytes_per_token is not None and args.kv_bytes_per_token <= 0:
        raise ValueError("--kv-bytes-per-token must be positive")
    compression = getattr(args, "kv_compression", "none")
    if compression != "none" and args.kv_bytes_per_token:
        raise ValueError(
            f"--kv-compression {compression} needs --model-profile, not "
            "--kv-bytes-per-token: the format's size depends on the layer count"
        )
    # Byte capacities need a KV size per token: --kv-bytes-per-token, else the profile's
    # (llama-3-8b when none is named, as --help says).
    explicit_kv = args.kv_bytes_per_token or _stored(
        get_model_profile(args.model_profile or DEFAULT_PROFILE), compression
    )
    bt = trace.block_tokens
    parsed = [parse_tier(t, args.policy, bt, explicit_kv) for t in args.tier or ["host=inf"]]
    tiers = tuple(spec for spec, _ in parsed)
    if len({t.name for t in tiers}) != len(tiers):
        raise ValueError("tier names must be distinct")
    costs = dict(DEFAULT_TIER_COSTS)
    for text in args.tier_cost:
        c = parse_tier_cost(text)
        costs[c.name] = c
    sweep_tier: str | None = None
    sweep_sizes: tuple[Size, ...] = ()
    if args.sweep:
        sweep_tier, sep, caps = args.sweep.partition("=")
        if not sep or not caps:
            raise ValueError(
                f"bad --sweep {args.sweep!r}: use TIER=CAP1,CAP2,..., e.g. host=16GiB,64GiB,256GiB"
            )
        sweep_sizes = tuple(
            parse_quantity(c, f"--sweep {sweep_tier}={c}", CAPACITY_KINDS) for c in caps.split(",")
        )
    sweep_caps = tuple(
        to_blocks(s, bt, explicit_kv, f"--sweep {sweep_tier}={s.text}") for s in sweep_sizes
    )
    profile = args.model_profile or (None if args.kv_bytes_per_token else DEFAULT_PROFILE)
    return AnalyzeConfig(
        tiers=tiers,
        kv_bytes_per_token=explicit_kv,
        model_profile=profile,
        kv_compression=compression,
        tier_costs=costs,
        sweep_tier=sweep_tier,
        sweep_capacities=sweep_caps,
        force_replay=args.replay,
        tier_sizes=tuple(s for _, s in parsed),
        sweep_sizes=sweep_sizes,
    )


def _stored(profile: ModelProfile, compression: str) -> int:
    """Bytes a token of ``profile`` takes in the tiers when stored as ``compression``."""
    return stored_bytes_per_token(profile.kv_bytes_per_token, profile.num_layers, compression)


def check_outputs(args: argparse.Namespace) -> None:
    """Raises ValueError (one line naming the flag) when an output file's directory is
    missing or not writable: found before minutes of analysis, not after."""
    import os

    for flag, path in (("--json", args.json), ("--plot", args.plot), ("--report", args.report)):
        if not path or path == "-":
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise ValueError(f"{flag} {path}: no such directory {folder}")
        if not os.access(folder, os.W_OK):
            raise ValueError(f"{flag} {path}: directory {folder} is not writable")


def main(args: argparse.Namespace) -> int:
    from cachestore.analyze import report
    from cachestore.analyze.summary import analyze

    try:
        check_outputs(args)
        trace = read_trace(args.trace, args.format, args.block_tokens, args.tokenizer)
        cfg = build_config(args, trace)
    except OSError as exc:  # the trace (or --tokenizer) cannot be read: name it, one line
        where = exc.filename or args.trace
        print(f"kvtier analyze: cannot read {where}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"kvtier analyze: {exc}", file=sys.stderr)
        return 2
    bar = None
    if not args.quiet and sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=trace.num_requests, unit="req", file=sys.stderr, desc="replay")
    try:
        doc = analyze(
            trace,
            cfg,
            progress=bar.update if bar else None,
            keep_distances=bool(args.plot),
            curves=bool(args.plot),
        )
    except ValueError as exc:
        print(f"kvtier analyze: {exc}", file=sys.stderr)
        return 2
    finally:
        if bar is not None:
            bar.close()
    doc["trace"] = str(args.trace)
    try:
        if args.json:
            report.write_json(doc, args.json)
        if args.plot:
            report.write_plot(doc, args.plot)
        if args.report:
            report.write_markdown(doc, args.report, plot_path=args.plot)
    except OSError as exc:  # the directory went away, a full disk: checked ones pass above
        print(
            f"kvtier analyze: cannot write {exc.filename or 'output'}: {exc.strerror or exc}",
            file=sys.stderr,
        )
        return 1
    if args.json != "-":
        print(report.format_table(doc))
    return 0
