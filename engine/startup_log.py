"""The engine's start-up summary: one INFO block saying what it loaded and where KV goes.

``LLMEngine`` logs ``describe_engine(self)`` once it is built (``kvtier serve`` shows it, in
its engine core process; ``LLM`` users see it with INFO logging on)::

    kvtier engine ready
      model       /models/llama (LlamaForCausalLM, bfloat16, 32 layers, cuda:0)
      KV cache    4096 blocks x 16 tokens = 65536 tokens (8GiB), max_model_len 8192
      KV offload  2 tiers, decision policy cost
        tier 0    host  8GiB
        tier 1    lmdb  max 32GiB at /root/.cache/kvtier/lmdb/LlamaForCausalLM-..., write_through

Capacities use ``tiers.sizes.config_size`` (approximate when not a whole unit); URLs lose
their password and secret query values (``redact_url``); tokens and keys are never shown.
Pure formatting: reads the engine's attributes, changes nothing.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from tiers.sizes import config_size

_SECRET_WORDS = ("pass", "secret", "token", "key", "auth", "credential")


def redact_url(url: str) -> str:
    """``url`` with its password (``redis://:pw@host`` -> ``redis://:***@host``) and the values
    of query parameters that look secret (``?password=``, ``?token=``) replaced by ``***``."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable URL>"
    netloc = parts.netloc
    if parts.password is not None:
        user = parts.username or ""
        host = netloc.rsplit("@", 1)[1]
        netloc = f"{user}:***@{host}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode(
            [(k, "***" if any(w in k.lower() for w in _SECRET_WORDS) else v) for k, v in pairs],
            safe="*",
        )
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def describe_tier(tier: Any) -> str:
    """One tier config (``tiers.config``'s dataclasses) as 'kind  capacity  where'."""
    kind = type(tier).kind
    capacity = getattr(tier, "capacity", None)
    if kind == "host":
        return f"host  {config_size(tier.capacity)} of host memory"
    if kind == "lmdb":
        return f"lmdb  max {config_size(tier.capacity)} at {tier.path}"
    if kind == "redis":
        size = config_size(capacity) if capacity else "bounded by the server's maxmemory"
        ttl = f", ttl {tier.ttl_s:g}s" if tier.ttl_s else ""
        cluster = " (cluster)" if tier.cluster else ""
        return f"redis {size} at {redact_url(tier.url)}{cluster}{ttl}"
    if kind == "s3":
        where = f"s3://{tier.bucket}/{tier.prefix}"
        endpoint = f" via {redact_url(tier.endpoint_url)}" if tier.endpoint_url else ""
        return f"s3    unbounded at {where}{endpoint}"
    if kind == "remote":
        auth = ", token set" if tier.token or tier.token_file else ""
        return f"remote at {redact_url(tier.url)}{auth}"
    return kind


def describe_offload(offload: Any) -> list[str]:
    """Lines for the offload connector: its tier stack from ``offload.config`` (duck-typed:
    engine/ does not import connectors/), each tier below the top with its write policy."""
    if offload is None:
        return ["  KV offload  off"]
    config = getattr(offload, "config", None)
    stack = getattr(getattr(config, "tiers", None), "tiers", None)
    if not stack:
        return [f"  KV offload  on ({type(offload).__name__})"]
    lines = [
        f"  KV offload  {len(stack)} tier(s), decision policy {getattr(config, 'decision', '?')}"
    ]
    for i, tier in enumerate(stack):
        policy = getattr(tier, "write_policy", None) if i > 0 else None
        lines.append(f"    tier {i}    {describe_tier(tier)}" + (f", {policy}" if policy else ""))
    return lines


def describe_engine(engine: Any) -> str:
    """The block for a built ``LLMEngine`` (see the module docstring)."""
    runner = engine.runner
    arch = runner.arch
    dtype = str(runner.dtype).removeprefix("torch.")
    source = engine.config.model
    model = (
        engine.model_dir
        if source in (None, engine.model_dir)
        else f"{engine.model_dir} (from {source})"
    )
    demo = ", the embedded demo model: random weights" if source is None else ""
    blocks = engine.pool.num_blocks
    block_size = engine.config.cache.block_size
    kv_bytes = blocks * runner.kv_cache.bytes_per_block
    lines = [
        "kvtier engine ready",
        f"  model       {model} ({arch.architecture}, {dtype}, {arch.num_layers} layers, "
        f"{runner.device}{demo})",
    ]
    if engine.config.tokenizer:
        lines.append(f"  tokenizer   {engine.config.tokenizer}")
    tp = engine.config.tensor_parallel_size
    if tp > 1:  # docs/tp.md; the KV cache line below is one rank's
        lines.append(
            f"  tensor par. {tp} ranks, {arch.num_kv_heads} KV heads and the KV cache below on each"
            + (
                " (and the host tier's capacity: each rank's share)"
                if engine.kv_connector is not None
                else ""
            )
        )
    caching = "on" if engine.config.cache.enable_prefix_caching else "off"
    lines.append(
        f"  KV cache    {blocks} blocks x {block_size} tokens = {blocks * block_size} "
        f"tokens ({config_size(kv_bytes)}), max_model_len {engine.max_model_len}, "
        f"prefix caching {caching}"
    )
    lines += describe_offload(engine.kv_connector)
    return "\n".join(lines)
