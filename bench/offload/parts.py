"""Building blocks of bench/offload/main.py: the run's sizes (``Setup``), the random-weight model
(the Llama-3-8B shape built on the device, or a tiny config for CPU runs of the full path),
and engine helpers with a stall guard (bench/offload/qa.py and bench/offload/sweep.py hold
the QA driver and the sweep's parts).

Nothing here measures a section by itself; bench/offload/main.py composes these into sections.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import json
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from bench.common import random_weight_model
from engine.kv_cache import KVCacheSpec
from engine.sampling_params import SamplingParams

GREEDY1 = SamplingParams(max_tokens=1, temperature=0.0)
RANDOM_MARKER = "kvtier_bench_random_weights.json"
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}
HOST_CAPACITY = 8 << 30  # pinned; holds the TTFT prefixes (3 x 16K = 6 GiB) and all QA histories
TINY = {
    **LLAMA3_8B,
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 32768,
}  # room for 16K prefixes on CPU
# The tiny model with Llama-3-8B's KV layout per layer over 16 layers: blocks of a real size
# (1 MiB at float32), so CPU runs of LMDB reloads move bytes as the GPU runs do, per block.
TINY_WIDE = {
    **TINY,
    "hidden_size": 256,
    "num_hidden_layers": 16,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 128,
}
TOKEN_RANGE = (10, 500)


# -- set-up --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Setup:
    """What every section needs: the model, where it runs, and the sizes of this run."""

    model_dir: str | None  # None: the embedded demo model
    device: torch.device
    workdir: str
    lengths: tuple[int, ...]  # TTFT / sweep prefix lengths (multiples of 16)
    transfer_blocks: int
    qa: dict[str, int]  # users, rounds, concurrency, system, context, question, answer (tokens)
    sweep_factors: tuple[tuple[float, float], ...]  # (x break-even bandwidth, x prefill latency)
    max_batched_tokens: int
    request_timeout_s: float  # a generate call taking longer means the engine is stuck
    dtype: str = "auto"
    reps: int = 3  # TTFT repetitions per (mode, length); the median is reported
    # Unmeasured repetitions before them: a length's first reload meets kernels (Triton, the
    # FlashInfer plan) that the 64-token warm-up request did not, in every engine of the run.
    warmup_reps: int = 0
    lmdb_max_len: int = 1 << 30  # the LMDB TTFT mode skips longer prefixes
    sweep_lengths: tuple[int, ...] = ()  # () = lengths
    host_capacity: int = 512 << 20
    reload_modes: tuple[str, ...] = ()  # bench/offload/main.py's reload_steps modes (RELOAD_MODES)
    qa_lossless: bool = False  # the QA section also runs offload with compression: lossless
    qa_decision: str = "cost"  # the QA section's offload decision (tests: "load", timing-free)
    ttft_modes: tuple[str, ...] = ()  # the ttft section's modes (() = every one of TTFT_MODES)
    # New tokens after the reloaded prefix: 16 is a short question; a multi-round QA turn
    # (question + the previous answer) computes a few hundred.
    ttft_suffix: int = 16
    # The ttft section's engines write their request logs here (``ttft_<mode>.jsonl``: each
    # request's phases, plan and load read/copy seconds); None: no log.
    request_log_dir: str | None = None
    interleave: bool = False  # ttft: the modes' engines alive at once, taking turns each rep


def _random_model_dir(workdir: str, config: dict[str, Any]) -> str:
    """config.json, the demo tokenizer and a marker; the weights are made on the device."""
    from safetensors.torch import save_file

    from engine.models.demo_model import save_demo_tokenizer

    out = os.path.join(workdir, f"llama-random-{config['hidden_size']}")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2}, f)
    save_demo_tokenizer(out)
    # model_fingerprint hashes safetensors headers: one tiny tensor names this random model.
    save_file({"bench_seed": torch.zeros(1)}, os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, RANDOM_MARKER), "w") as f:
        json.dump({"init": "normal(0, 0.02), norms 1", "seed": 0}, f)
    return out


def _install_random_loader() -> None:
    """Wrap ``load_model`` so a marked directory gets random weights built on the device once
    per (dir, dtype, device, max_positions) and shared by every engine of this process."""
    import engine.models.loader as ml
    import engine.runner.model_runner as mr

    real = ml.load_model
    cache: dict[tuple[Any, ...], Any] = {}

    def load(
        model_dir: str, dtype: str, device: Any, max_positions: int | None = None, tp: Any = None
    ) -> Any:
        # A tensor-parallel rank loads its own slice: only the whole model is built here.
        sharded = tp is not None and getattr(tp, "size", 1) > 1
        if sharded or not os.path.exists(os.path.join(model_dir, RANDOM_MARKER)):
            return real(model_dir, dtype, device, max_positions, tp)
        key = (model_dir, dtype, str(device), max_positions)
        if key not in cache:
            from engine.models import ModelArchConfig

            hf = ml.read_hf_config(model_dir)
            arch = ModelArchConfig.from_hf(hf)
            torch_dtype = ml.resolve_dtype(dtype, hf)
            model = random_weight_model(arch, torch_dtype, device, max_positions)
            cache[key] = ml.LoadedModel(model=model, arch=arch, dtype=torch_dtype, hf_config=hf)
        return cache[key]

    ml.load_model = load
    mr.load_model = load  # imported by name there


def build_setup(mode: str, workdir: str, args: argparse.Namespace | None = None) -> Setup:
    """``quick``: the demo model; ``tiny``: the full path on a tiny random Llama (``tiny_wide``:
    its KV blocks of a real size, ``TINY_WIDE``); ``full``: the
    Llama-3-8B shape (CUDA only). ``args`` overrides sizes (see main's flags)."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        torch.set_num_threads(1)  # tiny models on a shared CPU: threads only add contention
    if mode == "quick":
        setup = Setup(
            None,
            device,
            workdir,
            (256, 1024),
            32,
            {
                "users": 6,
                "rounds": 3,
                "concurrency": 2,
                "system": 64,
                "context": 320,
                "question": 16,
                "answer": 8,
            },
            ((0.25, 0.0), (4.0, 0.0), (16.0, 0.5)),
            2048,
            60.0,
        )
    elif mode in ("tiny", "tiny_wide"):
        _install_random_loader()
        setup = Setup(
            _random_model_dir(workdir, TINY if mode == "tiny" else TINY_WIDE),
            device,
            workdir,
            (256, 1024),
            16,
            {
                "users": 6,
                "rounds": 3,
                "concurrency": 2,
                "system": 64,
                "context": 320,
                "question": 16,
                "answer": 4,
            },
            ((0.25, 0.0), (16.0, 0.5)),
            2048,
            60.0,
            dtype="bfloat16" if cuda else "float32",
            reps=1,
            lmdb_max_len=256,
            sweep_lengths=(256,),
        )
    else:
        if not cuda:
            raise SystemExit(
                "the full benchmark needs CUDA (Llama-3-8B shape); use --quick or --tiny on CPU"
            )
        _install_random_loader()
        setup = Setup(
            _random_model_dir(workdir, LLAMA3_8B),
            device,
            workdir,
            (1024, 4096, 16384),
            256,
            {
                "users": 12,
                "rounds": 6,
                "concurrency": 4,
                "system": 1024,
                "context": 6144,
                "question": 64,
                "answer": 32,
            },
            ((0.25, 0.0), (1.0, 0.0), (4.0, 0.0), (16.0, 0.5)),
            16384 + 256,
            120.0,
            dtype="bfloat16",
            reps=3,
            lmdb_max_len=16384,
            sweep_lengths=(1024, 4096),
            host_capacity=HOST_CAPACITY,
            warmup_reps=1,
        )
    if args is not None:
        over: dict[str, Any] = {}
        if args.lengths:
            over["lengths"] = tuple(int(x) for x in args.lengths.split(","))
        if args.sweep_lengths:
            over["sweep_lengths"] = tuple(int(x) for x in args.sweep_lengths.split(","))
        if args.reps:
            over["reps"] = args.reps
        if getattr(args, "warmup_reps", None) is not None:
            over["warmup_reps"] = args.warmup_reps
        if args.lmdb_max_len:
            over["lmdb_max_len"] = args.lmdb_max_len
        if getattr(args, "suffix_tokens", None):
            over["ttft_suffix"] = args.suffix_tokens
        if getattr(args, "interleave", False):
            over["interleave"] = True
        if getattr(args, "request_log_dir", None):
            os.makedirs(args.request_log_dir, exist_ok=True)
            over["request_log_dir"] = args.request_log_dir
        qa = {**setup.qa}
        if args.qa_users:
            qa["users"] = args.qa_users
        if args.qa_concurrency:
            qa["concurrency"] = args.qa_concurrency
        if min(qa["users"], qa["concurrency"]) < 1:
            raise SystemExit("--qa-users and --qa-concurrency must be at least 1")
        over["qa"] = qa
        setup = dataclasses.replace(setup, **over)
    if any(n % 16 for n in setup.lengths + setup.sweep_lengths):
        raise SystemExit("prefix lengths must be multiples of 16")
    return setup


def make_llm(
    setup: Setup, num_gpu_blocks: int, offload: dict[str, Any] | None, **extra: Any
) -> Any:
    """An ``LLM`` of the setup's model; ``extra`` goes to ``LLM`` as is (e.g. request_log)."""
    from engine.llm import LLM

    kwargs: dict[str, Any] = {
        "num_gpu_blocks": num_gpu_blocks,
        "max_num_batched_tokens": setup.max_batched_tokens,
        "max_num_seqs": 64,
        "seed": 0,
        **extra,
    }
    if setup.model_dir is not None:
        kwargs["dtype"] = setup.dtype
    if offload is not None:
        kwargs.update(kv_offload=True, kv_offload_config=offload)
    return LLM(setup.model_dir, **kwargs)


def two_byte_kv(setup: Setup) -> bool:
    """Whether the setup's KV is 2-byte (what ``compression: lossless`` needs): not the CPU
    quick run's float32 demo model."""
    return setup.model_dir is not None and setup.dtype in ("auto", "bfloat16", "float16")


def close_llm(llm: Any) -> None:
    llm.close()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def bytes_per_block(setup: Setup) -> int:
    """KV bytes of one block of the benchmarked model, from its config.json."""
    from engine.models import ModelArchConfig
    from engine.models.demo_model import ensure_demo_model
    from engine.models.loader import read_hf_config, resolve_dtype

    hf = read_hf_config(setup.model_dir or ensure_demo_model())
    arch = ModelArchConfig.from_hf(hf)
    spec = KVCacheSpec(arch.num_layers, arch.num_kv_heads, arch.head_dim, resolve_dtype("auto", hf))
    return spec.bytes_per_block


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*TOKEN_RANGE) for _ in range(n)]


_REQ_IDS = itertools.count()


def run_requests(
    llm: Any, prompts: list[list[int]], params: SamplingParams, timeout_s: float
) -> list[Any]:
    """``LLM.generate`` with a deadline: a stalled engine (no request can progress) raises
    RuntimeError with its stats instead of hanging the whole benchmark."""
    eng = llm.engine
    ids = [f"bench-{next(_REQ_IDS)}" for _ in prompts]
    for rid, prompt in zip(ids, prompts, strict=True):
        eng.add_request(rid, prompt, params)
    finals: dict[str, Any] = {}
    deadline = time.monotonic() + timeout_s
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                finals[out.req_id] = out
        if time.monotonic() > deadline:
            stats = eng.stats()
            for rid in ids:
                eng.abort_request(rid)
            for _ in range(100):  # let the aborts land; a wedged engine may never drain
                if not eng.has_unfinished_requests():
                    break
                eng.step()
            raise RuntimeError(
                f"engine stalled: {len(finals)}/{len(ids)} requests finished "
                f"after {timeout_s:.0f} s; stats {stats}"
            )
    return [finals[r] for r in ids]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_time(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Best wall time of ``fn`` over ``repeats`` runs after one warm-up, the device synchronized
    before and after each run."""
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return min(times)


@dataclass(frozen=True, slots=True)
class FirstToken:
    """One request timed step by step from ``add_request`` to its first token."""

    ttft_s: float
    steps: int  # engine steps until the step that returned the first token, that one included
    step_ms: tuple[float, ...]  # wall time of each of those steps
    schedule_ms: float  # in Scheduler.schedule (hashing, GPU hit, store lookup, allocation)
    load_ms: float  # in the worker's start_load_kv (saves + load copies, before the forward)
    execute_ms: float  # in ModelRunner.execute_model (start_load_kv and the forward included)
    cached_tokens: int


def first_token_steps(llm: Any, prompt: list[int], timeout_s: float) -> FirstToken:
    """Add ``prompt`` (one token wanted) and step the engine until it yields, timing each step
    and, inside them, the scheduler, the runner and the connector worker's pre-forward hook
    (wrapped on the instances for this call only)."""
    eng = llm.engine
    spent = {"schedule": 0.0, "load": 0.0, "execute": 0.0}
    worker = eng.offload.worker if eng.offload is not None else None
    targets = [(eng.scheduler, "schedule", "schedule"), (eng.runner, "execute_model", "execute")]
    if worker is not None:
        targets.append((worker, "start_load_kv", "load"))

    def timed(fn: Any, key: str) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - t0

        return run

    for obj, name, key in targets:
        setattr(obj, name, timed(getattr(obj, name), key))
    rid = f"bench-{next(_REQ_IDS)}"
    steps: list[float] = []
    try:
        t0 = time.perf_counter()
        eng.add_request(rid, prompt, GREEDY1)
        out = None
        while out is None:
            s0 = time.perf_counter()
            outs = eng.step()
            steps.append(time.perf_counter() - s0)
            out = next((o for o in outs if o.req_id == rid), None)
            if time.perf_counter() - t0 > timeout_s:
                raise RuntimeError(f"no first token after {len(steps)} steps")
        while eng.has_unfinished_requests():
            eng.step()
    finally:
        for obj, name, _ in targets:
            delattr(obj, name)  # the class's method again
    ttft = out.metrics.ttft_s if out.metrics is not None and out.metrics.ttft_s else sum(steps)
    return FirstToken(
        ttft,
        len(steps),
        tuple(x * 1e3 for x in steps),
        spent["schedule"] * 1e3,
        spent["load"] * 1e3,
        spent["execute"] * 1e3,
        out.num_cached_tokens,
    )


def _ttft_once(llm: Any, prompt: list[int], timeout_s: float) -> tuple[float, int]:
    t0 = time.perf_counter()
    out = run_requests(llm, [prompt], GREEDY1, timeout_s)[0]
    wall = time.perf_counter() - t0
    ttft = out.metrics.ttft_s if out.metrics is not None and out.metrics.ttft_s else wall
    return ttft, out.num_cached_tokens
