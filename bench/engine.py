"""Engine vs HF transformers on a GPU, same random bf16 weights, side by side in one run.

For each model shape (Llama-3-8B, Qwen2.5-7B by default) kvtier's model is built on the GPU
with random weights and HF's model is built on the meta device and pointed at the SAME
tensors (q/k/v and gate/up are row slices of the fused weights), so the 16 GB exist once.
Measured, each with HF's figure and the ratio:

- prefill time of 1K, 4K and 16K tokens (one request; HF: one forward, ``logits_to_keep=1``),
- decode ms/token at batch 1, 8 and 32 after 512-token prompts (engine: CUDA-graph decode
  steps through ``ModelRunner.execute_model``; HF: ``generate`` of 65 tokens minus 1, / 64),
- tokens/s of a batch of 32 requests, 512 tokens in and 256 out (engine: one prefill step then
  decode steps; HF: ``generate``),
- a correctness check: relative error of the last-position logits, engine vs HF.

Prints JSON (also written to ``--out``) and a one-line summary. GPU only.
Each engine variant runs in turn on the same weights: ``fused`` (Triton fused residual-add +
RMSNorm and SiLU*mul, engine/kernels, and the Triton split-KV decode attention in the decode
graphs), ``fused-fi`` (the same with FlashInfer's graph decode wrapper) and ``torch`` (the
plain path); the decode figures side by side give ``decode_fused_vs_torch`` and
``decode_fused_vs_fused_fi`` (ratio = the other's ms / fused ms).

Usage: python -m bench.engine [--models llama3-8b,qwen2.5-7b] [--sections check,prefill,decode,generate]
       [--variants fused,fused-fi,torch] [--no-hf] [--num-gpu-blocks N] [--out FILE] [--quick]
       python -m bench.engine --warm [--warm-parts prefill,decode,sampling]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import statistics
import sys
import time
from typing import Any

import torch

from bench.common import machine_info, random_weight_model
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core_types import ScheduledRequest, SchedulerOutput
from engine.models import ModelArchConfig
from engine.models.llama import _FUSED
from engine.models.loader import LoadedModel
from engine.runner.model_runner import ModelRunner
from engine.sampling_params import SamplingParams

SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        rms_norm_eps=1e-5,
        max_position_embeddings=32768,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        hidden_act="silu",
        bos_token_id=1,
        eos_token_id=2,
    ),
    "qwen2.5-7b": dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        hidden_act="silu",
        use_sliding_window=False,
        bos_token_id=1,
        eos_token_id=2,
    ),
}
GREEDY = SamplingParams(temperature=0.0)
MAX_LEN = 20480


def build_models(name: str, device: torch.device) -> tuple[LoadedModel, torch.nn.Module]:
    """kvtier's model with random bf16 weights on ``device`` and HF's model sharing them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = SHAPES[name]
    arch = ModelArchConfig.from_hf(cfg)
    ours = random_weight_model(arch, torch.bfloat16, device, MAX_LEN)
    hf_cfg = AutoConfig.for_model(
        cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"}
    )
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(
            hf_cfg, dtype=torch.bfloat16, attn_implementation="sdpa"
        )
    params = dict(ours.named_parameters())
    for hf_name, _ in list(hf.named_parameters()):
        target, shard = hf_name, None
        for hf_part, (our_part, idx) in _FUSED.items():
            if hf_part in hf_name:
                target, shard = hf_name.replace(hf_part, our_part), idx
                break
        tensor = params[target].data
        if shard is not None:
            sizes = ours._shard_sizes(target)
            tensor = tensor.narrow(0, sum(sizes[:shard]), sizes[shard])
        module_name, _, leaf = hf_name.rpartition(".")
        hf.get_submodule(module_name)._parameters[leaf] = torch.nn.Parameter(
            tensor, requires_grad=False
        )
    rotary = hf.model.rotary_emb
    hf.model.rotary_emb = type(rotary)(hf.config).to(device)  # real inv_freq buffers
    left = [n for n, t in list(hf.named_parameters()) + list(hf.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"HF tensors left on meta: {left[:5]}")
    loaded = LoadedModel(model=ours, arch=arch, dtype=torch.bfloat16, hf_config=cfg)
    return loaded, hf.eval()


def timed(fn, reps: int) -> float:
    """Median seconds of ``reps`` calls after one warm-up (device synchronized)."""
    fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (n, length), generator=g).tolist()


class EngineDriver:
    """Hand-built steps on a ModelRunner: block ids handed out consecutively per request."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.bs = runner.kv_cache.block_size

    def tables(self, n: int, max_len: int) -> list[list[int]]:
        per = -(-max_len // self.bs)
        if n * per > self.runner.num_gpu_blocks:
            raise ValueError("KV cache too small for the benchmark")
        return [list(range(i * per, (i + 1) * per)) for i in range(n)]

    def prefill(
        self, prompts: list[list[int]], tables: list[list[int]], tag: str
    ) -> dict[str, int]:
        reqs = [
            ScheduledRequest(f"{tag}{i}", p, 0, t, True, GREEDY)
            for i, (p, t) in enumerate(zip(prompts, tables, strict=True))
        ]
        return self.runner.execute_model(
            SchedulerOutput(reqs, sum(len(p) for p in prompts))
        ).sampled_token_ids

    def decode(self, seqs: dict[str, list[int]], tables: list[list[int]], steps: int) -> None:
        for n in range(steps):
            reqs = [
                ScheduledRequest(rid, s[-1:], len(s) - 1, tables[i], True, GREEDY, n + 1)
                for i, (rid, s) in enumerate(seqs.items())
            ]
            out = self.runner.execute_model(SchedulerOutput(reqs, len(reqs)))
            for rid, tok in out.sampled_token_ids.items():
                seqs[rid].append(tok)


SECTIONS = ("check", "prefill", "decode", "generate")
# fused: Triton norm/activation kernels, graph decode attention by the backend's default
# (the Triton split-KV kernel); fused-fi: the same with FlashInfer's graph decode wrapper;
# torch: the plain path (FlashInfer graph decode).
VARIANTS = ("fused", "fused-fi", "torch")
_GRAPH_DECODE = {"fused": "auto", "fused-fi": "flashinfer", "torch": "flashinfer"}


def measure_decode(drv: EngineDriver, vocab: int, batch: int, steps: int) -> float:
    """Median ms per decode step (3 runs of ``steps`` steps) after 512-token prompts."""
    prompts = random_prompts(batch, 512, vocab, 100 + batch)
    tables = drv.tables(batch, 512 + 4 * steps + 8)
    first = drv.prefill(prompts, tables, f"d{batch}-")
    seqs = {rid: prompts[i] + [first[rid]] for i, rid in enumerate(first)}
    drv.decode(seqs, tables, 4)  # warm-up
    ms = decode_ms_per_step(drv, seqs, tables, steps)
    drv.runner.execute_model(SchedulerOutput([], 0, frozenset(seqs)))
    return ms


def decode_ms_per_step(
    drv: EngineDriver, seqs: dict[str, list[int]], tables: list[list[int]], steps: int
) -> float:
    """Median ms per step of 3 runs of ``steps`` decode steps (device synchronized)."""
    runs = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        drv.decode(seqs, tables, steps)
        torch.cuda.synchronize()
        runs.append((time.perf_counter() - t0) / steps * 1e3)
    return statistics.median(runs)


def bench_engine(
    runner: ModelRunner, hf: torch.nn.Module | None, sections: set[str], quick: bool
) -> dict[str, Any]:
    """The chosen sections on one runner; HF's figure beside each when ``hf`` is given."""
    device = torch.device("cuda")
    drv = EngineDriver(runner)
    vocab = runner.vocab_size
    res: dict[str, Any] = {"fused_kernels": runner.fused_kernels}
    reps = 2 if quick else 3
    if "check" in sections and hf is not None:
        # Correctness: last-position logits of a 1K prompt, engine vs HF on the same weights.
        check = random_prompts(1, 1024, vocab, 1)[0]
        [table] = drv.tables(1, 1024)
        req = ScheduledRequest("check", check, 0, table, True, GREEDY)
        ours_logits = runner.execute_model(SchedulerOutput([req], 1024), return_logits=True).logits[
            "check"
        ]
        runner.execute_model(SchedulerOutput([], 0, frozenset({"check"})))
        with torch.inference_mode():
            hf_logits = (
                hf(torch.tensor([check], device=device), logits_to_keep=1)
                .logits[0, -1]
                .float()
                .cpu()
            )
        res["logits_rel_err_vs_hf"] = float((ours_logits - hf_logits).norm() / hf_logits.norm())
    if "prefill" in sections:
        res["prefill"] = []
        for n in (1024, 4096, 16384):
            prompt = random_prompts(1, n, vocab, n)[0]
            [table] = drv.tables(1, n)
            ours_s = timed(lambda p=prompt, t=table: drv.prefill([p], [t], "p"), reps)
            row: dict[str, Any] = {"tokens": n, "engine_ms": round(ours_s * 1e3, 2)}
            if hf is not None:
                ids = torch.tensor([prompt], device=device)
                with torch.inference_mode():
                    hf_s = timed(lambda x=ids: hf(x, logits_to_keep=1), reps)
                row.update(hf_ms=round(hf_s * 1e3, 2), speedup=round(hf_s / ours_s, 2))
            res["prefill"].append(row)
            torch.cuda.empty_cache()
    if "decode" in sections:
        res["decode"] = []
        steps = 32 if quick else 64
        for batch in (1, 8, 32):
            ours_ms = measure_decode(drv, vocab, batch, steps)
            row = {"batch": batch, "engine_ms_per_step": round(ours_ms, 3)}
            if hf is not None:
                ids = torch.tensor(random_prompts(batch, 512, vocab, 100 + batch), device=device)
                gen = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
                with torch.inference_mode():
                    t_short = timed(
                        lambda x=ids, g=gen: hf.generate(
                            x, max_new_tokens=1, min_new_tokens=1, **g
                        ),
                        1,
                    )
                    t_long = timed(
                        lambda x=ids, g=gen: hf.generate(
                            x, max_new_tokens=steps + 1, min_new_tokens=steps + 1, **g
                        ),
                        1,
                    )
                hf_ms = (t_long - t_short) / steps * 1e3
                row.update(hf_ms_per_step=round(hf_ms, 3), speedup=round(hf_ms / ours_ms, 2))
            res["decode"].append(row)
    if "generate" in sections:
        # Batch generation: 32 x (512 in, n_out out).
        n_out = 64 if quick else 256
        prompts = random_prompts(32, 512, vocab, 7)
        tables = drv.tables(32, 512 + n_out)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        first = drv.prefill(prompts, tables, "g")
        seqs = {rid: prompts[i] + [first[rid]] for i, rid in enumerate(first)}
        drv.decode(seqs, tables, n_out - 1)
        torch.cuda.synchronize()
        ours_s = time.perf_counter() - t0
        total = 32 * n_out
        row = {"prompt": 512, "new_tokens": n_out, "engine_tok_s": round(total / ours_s, 1)}
        if hf is not None:
            ids = torch.tensor(prompts, device=device)
            with torch.inference_mode():
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                hf.generate(
                    ids,
                    max_new_tokens=n_out,
                    min_new_tokens=n_out,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=0,
                )
                torch.cuda.synchronize()
                hf_s = time.perf_counter() - t0
            row.update(hf_tok_s=round(total / hf_s, 1), speedup=round(hf_s / ours_s, 2))
        res["generate_batch32"] = row
    return res


def bench_model(
    name: str,
    sections: set[str],
    variants: list[str],
    with_hf: bool,
    quick: bool,
    num_gpu_blocks: int | None,
) -> dict[str, Any]:
    """Each variant's runner in turn (built, measured, freed) on the same weights; HF's figures
    with the first variant only; a fused-vs-torch decode ratio when both ran."""
    device = torch.device("cuda")
    t0 = time.perf_counter()
    loaded, hf = build_models(name, device)
    res: dict[str, Any] = {
        "model": name,
        "build_s": round(time.perf_counter() - t0, 1),
        "variants": {},
    }
    cfg = EngineConfig(
        dtype="bfloat16",
        device="cuda",
        attention_backend="flashinfer",
        cache=CacheConfig(gpu_memory_utilization=0.55, num_gpu_blocks=num_gpu_blocks),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=16384, max_num_seqs=64, max_model_len=MAX_LEN
        ),
    )
    for i, variant in enumerate(variants):
        t0 = time.perf_counter()
        try:
            runner = ModelRunner.from_loaded(
                dataclasses.replace(cfg, graph_decode=_GRAPH_DECODE[variant]),
                loaded,
                f"bench-{name}",
                fused_kernels=variant != "torch",
            )
            row: dict[str, Any] = {
                "runner_init_s": round(time.perf_counter() - t0, 1),
                "graph_decode": getattr(runner.attn_backend, "graph_decode", None),
                "kv_budget": runner.kv_budget.summary() if runner.kv_budget else None,
                "num_gpu_blocks": runner.num_gpu_blocks,
                "cuda_graph_sizes": runner.cuda_graphs.sizes if runner.cuda_graphs else None,
            }
            row.update(bench_engine(runner, hf if with_hf and i == 0 else None, sections, quick))
        except Exception as exc:  # report and go on with the other variant
            logging.exception("variant %s failed", variant)
            row = {"error": f"{type(exc).__name__}: {exc}"}
        res["variants"][variant] = row
        print(json.dumps({"model": name, "variant": variant, **row}), flush=True)
        runner = None  # free the cache and the graph pool before the next variant
        gc.collect()
        torch.cuda.empty_cache()
    dec = {v: r["decode"] for v, r in res["variants"].items() if "decode" in r}
    for other, key in (
        ("torch", "decode_fused_vs_torch"),
        ("fused-fi", "decode_fused_vs_fused_fi"),
    ):
        if "fused" in dec and other in dec:
            res[key] = [
                {
                    "batch": f["batch"],
                    "fused_ms": f["engine_ms_per_step"],
                    f"{other}_ms": t["engine_ms_per_step"],
                    "speedup": round(t["engine_ms_per_step"] / f["engine_ms_per_step"], 3),
                }
                for f, t in zip(dec["fused"], dec[other], strict=True)
            ]
    del hf, loaded
    torch.cuda.empty_cache()
    return res


def warm_flashinfer(
    parts: set[str] = frozenset({"prefill", "decode", "sampling"}),
) -> dict[str, float]:
    """Build (JIT-compile or load from the cache dir) the FlashInfer modules the engine uses:
    bf16 head_dim 128 prefill and decode, and the sampling kernels. Returns seconds per part."""
    from engine.attention.base import AttentionMetadata
    from engine.attention.flashinfer_backend import FlashInferAttentionBackend
    from engine.runner.sampler import Sampler, SampleRequest

    device = torch.device("cuda")
    backend = FlashInferAttentionBackend(8, 2, 128, 128**-0.5)
    backend.bind(torch.bfloat16, device)
    cache = torch.zeros(4, 2, 16, 2, 128, dtype=torch.bfloat16, device=device)
    times = {}
    for kind, q_lens in (("prefill_s", [5]), ("decode_s", [1])):
        if kind[:-2] not in parts:
            continue
        t0 = time.perf_counter()
        n = sum(q_lens)
        meta = AttentionMetadata(
            cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([5], dtype=torch.int32, device=device),
            block_tables=torch.zeros(1, 1, dtype=torch.int32, device=device),
            slot_mapping=torch.arange(n, device=device),
            query_lens_cpu=q_lens,
            seq_lens_cpu=[5],
            block_size=16,
            block_tables_cpu=[[0]],
        )
        backend.plan(meta)
        q = torch.randn(n, 8, 128, dtype=torch.bfloat16, device=device)
        k = torch.randn(n, 2, 128, dtype=torch.bfloat16, device=device)
        backend.forward(0, q, k, k, cache)
        torch.cuda.synchronize()
        times[kind] = round(time.perf_counter() - t0, 1)
    if "sampling" not in parts:
        return times
    t0 = time.perf_counter()
    Sampler(0, device)(
        torch.randn(2, 64, device=device),
        [SampleRequest(SamplingParams(temperature=1.0, top_k=5), 0)] * 2,
    )
    times["sampling_s"] = round(time.perf_counter() - t0, 1)
    return times


def summary(results: list[dict[str, Any]]) -> str:
    parts = []
    for r in results:
        bits = [r["model"] + ":"]
        for variant, v in r["variants"].items():
            if "error" in v:
                bits.append(f"{variant} FAILED")
                continue
            d1 = next((d for d in v.get("decode", []) if d["batch"] == 1), None)
            if d1:
                hf = f" (HF {d1['hf_ms_per_step']})" if "hf_ms_per_step" in d1 else ""
                bits.append(f"{variant} decode b1 {d1['engine_ms_per_step']} ms{hf}")
            if v.get("prefill"):
                p16 = v["prefill"][-1]
                bits.append(f"{variant} prefill {p16['tokens']} {p16['engine_ms']} ms")
            if "generate_batch32" in v:
                bits.append(f"{variant} b32 gen {v['generate_batch32']['engine_tok_s']} tok/s")
        for key, other in (
            ("decode_fused_vs_torch", "torch"),
            ("decode_fused_vs_fused_fi", "fused-fi"),
        ):
            for d in r.get(key, []):
                bits.append(
                    f"b{d['batch']} fused/{other} {d['fused_ms']}/{d[f'{other}_ms']} ms ({d['speedup']}x)"
                )
        parts.append(", ".join(bits))
    return " | ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama3-8b,qwen2.5-7b")
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and tokens")
    parser.add_argument("--warm", action="store_true", help="only build the FlashInfer kernels")
    parser.add_argument(
        "--warm-parts",
        default="prefill,decode,sampling",
        help="with --warm: which FlashInfer modules to build",
    )
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"subset of {SECTIONS}")
    parser.add_argument("--variants", default="fused,torch", help=f"subset of {VARIANTS}, in order")
    parser.add_argument(
        "--no-hf", action="store_true", help="engine figures only (no HF model runs)"
    )
    parser.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=None,
        help="fixed KV cache size instead of the memory profile",
    )
    args = parser.parse_args(argv)
    sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not sections <= set(SECTIONS) or not set(variants) <= set(VARIANTS) or not variants:
        parser.error(f"sections must be in {SECTIONS}, variants in {VARIANTS}")
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "needs CUDA", "machine": machine_info()}))
        return 0
    if args.warm:
        print(json.dumps({"flashinfer_warmup": warm_flashinfer(set(args.warm_parts.split(",")))}))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    results = []
    for name in args.models.split(","):
        results.append(
            bench_model(name, sections, variants, not args.no_hf, args.quick, args.num_gpu_blocks)
        )
        print(json.dumps(results[-1]), flush=True)
    report = {
        "benchmark": "engine",
        "machine": machine_info(),
        "quick": args.quick,
        "argv": sys.argv[1:] if argv is None else argv,
        "results": results,
        "summary": summary(results),
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    print(report["summary"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
