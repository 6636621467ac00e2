"""Frozen configuration dataclasses, one per component, mapped one-to-one from CLI flags.

Components receive these explicitly; nothing reads a global config or the environment here.
``check_max_model_len`` and ``check_token_budget`` hold a config against what the model and
the KV pool turned out to be, once they are built.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = 16
    # None: derive from memory (GPU: profile + gpu_memory_utilization; CPU: cpu_kv_cache_bytes).
    num_gpu_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    # KV pool of a CPU engine. None: 256 MiB, or what one max_model_len sequence needs when
    # that is more (so the default never refuses the model's own context length).
    cpu_kv_cache_bytes: int | None = None
    enable_prefix_caching: bool = True
    cache_salt: str = ""
    hash_name: str = "sha256"

    def __post_init__(self) -> None:
        if self.block_size != 16:
            # FlashInfer page size, key scheme and tiers all assume 16 (DESIGN.md).
            raise ValueError(f"block_size must be 16, got {self.block_size}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be >= 1, got {self.num_gpu_blocks}")
        if self.cpu_kv_cache_bytes is not None and self.cpu_kv_cache_bytes < 1:
            raise ValueError(f"cpu_kv_cache_bytes must be >= 1, got {self.cpu_kv_cache_bytes}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    # None: the model's max_position_embeddings.
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    # A step that yields some request's first token from a short prefill (at most this many
    # tokens: a reloaded prefix's suffix, a short prompt) carries at most this many prefill
    # tokens in all, so that token is not held behind another request's long chunk; long
    # prompts still advance by what is left. 0: off (every step fills the budget).
    first_token_step_tokens: int = 512
    # Other prompts' chunks in such a step carry at most this many tokens (long prompts still
    # advance by it); -1 fills the step up to first_token_step_tokens, at least a quarter of
    # it (the default before the ninth session; docs/scheduling.md).
    first_token_step_others: int = 64
    # While a request waits for a KV load from a tier below the host (an asynchronous load),
    # steps carry at most this many prefill tokens, so the step that sees the load end comes
    # soon after it ends (docs/scheduling.md). 0: off.
    load_wait_step_tokens: int = 0

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if self.first_token_step_tokens < 0:
            raise ValueError("first_token_step_tokens must be >= 0")
        if self.first_token_step_others < -1:
            raise ValueError("first_token_step_others must be -1 (fill to the cap) or >= 0")
        if self.load_wait_step_tokens < 0:
            raise ValueError("load_wait_step_tokens must be >= 0")


# A ready engine core that sends nothing for this long is declared stalled (``CoreProcConfig``,
# ``kvtier serve --engine-stall-timeout``). Generous: one step is silent however long it runs,
# and a 4K-token prefill of a 135M model took ~15 s on a 2-core CPU; a request of a new shape
# may also build kernels inside its step. vLLM gives one step of its TP workers 300 s
# (VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS).
DEFAULT_STALL_TIMEOUT_S = 120.0

# Kernel choices of the flashinfer backend (engine/attention/flashinfer_backend.py).
GRAPH_DECODE_CHOICES = ("auto", "triton", "flashinfer")
SMALL_QUERY_CHOICES = ("auto", "flashinfer", "triton")


DEFAULT_GEMM_WARMUP = True


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str | None = None  # HF directory or .gguf file; None = the embedded demo model
    tokenizer: str | None = None  # tokenizer directory; None = the model's (vLLM's --tokenizer)
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    attention_backend: str = "auto"  # auto | torch | flashinfer
    # CUDA-graph decode kernel of the flashinfer backend: auto | triton | flashinfer
    # (engine/attention/flashinfer_backend.py says which "auto" takes).
    graph_decode: str = "auto"
    # Eager steps whose requests all have at most 64 / GQA-group new tokens (short appends over
    # cached context, decode steps outside the graphs): flashinfer (its prefill/decode
    # wrappers) | triton (engine/kernels/decode_attention.py, split-KV) | auto: triton when
    # the step's longest context reaches 8192 tokens (H200: 3.76x FlashInfer's prefill wrapper
    # for 16 tokens over 16K, parity at 4K; bench/attention.py --appends), else flashinfer.
    small_query_attention: str = "auto"
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_offload: bool = False
    kv_offload_config: str | dict | None = None  # YAML path or the same dict (tiers issue)
    # The registered KV connector (engine/kv_connector.py) ``kv_offload`` builds, with
    # ``kv_offload_config`` as its config.
    kv_connector: str = "offload"
    request_log: str | None = None
    step_log: str | None = None  # one JSON line per engine step (engine/step_log.py)
    # No CUDA graphs: every step runs eagerly (debugging; a backend that cannot capture).
    enforce_eager: bool = False
    # At start-up on CUDA, run the first layer's linears at every row count a step can have, so
    # no step loads a GEMM kernel mid-forward (engine/runner/gemm_warmup.py says why).
    gemm_warmup: bool = DEFAULT_GEMM_WARMUP
    # Ranks the model is split over (engine/runner/distributed.py, docs/tp.md): one process each, the
    # scheduler in rank 0's. 1: the single-process engine, no collective anywhere.
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if (
            isinstance(self.tensor_parallel_size, bool)
            or not isinstance(self.tensor_parallel_size, int)
            or self.tensor_parallel_size < 1
        ):
            raise ValueError(
                f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}"
            )
        if self.graph_decode not in GRAPH_DECODE_CHOICES:
            raise ValueError(
                f"graph_decode must be one of {GRAPH_DECODE_CHOICES}, got {self.graph_decode!r}"
            )
        if self.small_query_attention not in SMALL_QUERY_CHOICES:
            raise ValueError(
                f"small_query_attention must be one of {SMALL_QUERY_CHOICES}, "
                f"got {self.small_query_attention!r}"
            )


def check_max_model_len(config: EngineConfig, max_model_len: int, num_blocks: int) -> int:
    """The engine's ``max_model_len``: ``max_model_len`` (explicit, or the model's context
    length) when the pool of ``num_blocks`` holds one sequence that long. A sequence needing
    more blocks than the whole pool could never run, so a longer one is a ValueError saying
    what to change (as vLLM's start-up check), except for a pool fixed by ``num_gpu_blocks``
    under a derived length: tests and benchmarks size tiny pools on purpose, and there the
    length is cut to the pool with a warning. Never cut silently."""
    bs = config.cache.block_size
    pool_tokens = num_blocks * bs
    if max_model_len <= pool_tokens:
        return max_model_len
    explicit = config.scheduler.max_model_len is not None
    if not explicit and config.cache.num_gpu_blocks is not None:
        _log.warning(
            "max_model_len cut from %d (the model's context length) to %d: "
            "--num-gpu-blocks %d holds no longer sequence; pass --max-model-len to "
            "choose",
            max_model_len,
            pool_tokens,
            num_blocks,
        )
        return pool_tokens
    source = "--max-model-len" if explicit else "the model's context length (config.json)"
    more = (
        "--num-gpu-blocks"
        if config.cache.num_gpu_blocks is not None
        else "--gpu-memory-utilization (GPU) or --cpu-kv-cache-bytes (CPU)"
    )
    raise ValueError(
        f"max_model_len {max_model_len} ({source}) needs {-(-max_model_len // bs)} KV blocks, "
        f"but the KV cache holds {num_blocks} blocks ({pool_tokens} tokens): pass "
        f"--max-model-len {pool_tokens} or less, or give the KV cache more memory ({more})"
    )


def check_token_budget(config: SchedulerConfig, max_model_len: int) -> None:
    """Without chunked prefill a prompt runs in one step: the token budget must hold the
    longest. Raises ValueError saying so."""
    if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
        raise ValueError(
            "without chunked prefill max_num_batched_tokens "
            f"({config.max_num_batched_tokens}) must be >= max_model_len ({max_model_len})"
        )
