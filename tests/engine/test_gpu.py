"""The engine on a CUDA GPU (every test carries the ``gpu`` marker; skipped without CUDA).

- FlashInfer attention in bf16 against HF transformers on the same weights, for prefill,
  chunked prefill, decode and mixed batches. The bf16 tolerance is measured, not guessed: the
  engine's error against HF in float32 must stay within 3x HF's own bf16 error (or 1e-2).
- CUDA-graph decode equals eager decode (same kernels, padded batch).
- Greedy tokens on the GPU equal the engine's own CPU path (fp32 model).
- The KV budget comes from the memory profile; GPU sampling keeps its contracts.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core_types import ScheduledRequest, SchedulerOutput
from engine.runner.model_runner import ModelRunner
from engine.runner.sampler import Sampler, SampleRequest
from engine.sampling_params import SamplingParams
from tests.engine.hf_models import make_tiny_model

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0.0)
# GPU-sized tiny models: head_dim 128 (the kernels' real case), GQA groups 4 (decode kernel)
# and 7 (Qwen2.5-7B's group: decode through the prefill wrapper).
SHAPES = {
    "llama-g4": (
        "llama",
        dict(
            hidden_size=1024,
            intermediate_size=2048,
            num_attention_heads=8,
            num_key_value_heads=2,
            num_hidden_layers=3,
            max_position_embeddings=4096,
        ),
    ),
    "qwen2-g7": (
        "qwen2",
        dict(
            hidden_size=1792,
            intermediate_size=2048,
            num_attention_heads=14,
            num_key_value_heads=2,
            num_hidden_layers=2,
            max_position_embeddings=4096,
        ),
    ),
}


@pytest.fixture(scope="module", params=list(SHAPES))
def gpu_model(request, tmp_path_factory) -> tuple[str, str]:
    arch, overrides = SHAPES[request.param]
    return request.param, make_tiny_model(
        tmp_path_factory.mktemp(request.param), arch, seed=5, **overrides
    )


def hf_logits(
    model_dir: str, seqs: dict[str, list[int]], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    model = model.cuda().eval()
    with torch.inference_mode():
        out = {
            k: model(torch.tensor([v], device="cuda")).logits[0].float().cpu()
            for k, v in seqs.items()
        }
    del model
    torch.cuda.empty_cache()
    return out


def make_runner(model_dir: str, dtype: str = "bfloat16", device: str = "cuda", **kw) -> ModelRunner:
    cfg = EngineConfig(
        dtype=dtype,
        device=device,
        attention_backend=kw.pop("backend", "auto"),
        graph_decode=kw.pop("graph_decode", "auto"),
        small_query_attention=kw.pop("small_query", "flashinfer"),
        cache=CacheConfig(num_gpu_blocks=kw.pop("num_blocks", 96)),
        scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=1024),
    )
    return ModelRunner(cfg, model_dir, **kw)


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def req(
    rid: str, tokens: list[int], start: int, table: list[int], sample: bool = True, n_out: int = 0
):
    return ScheduledRequest(rid, tokens, start, table, sample, GREEDY, n_out)


def run_script(
    runner: ModelRunner,
) -> tuple[dict[str, list[int]], dict[str, dict[int, torch.Tensor]], list[str]]:
    """Prefill, chunked prefill, mixed and decode-only steps over shuffled block tables.
    Returns the sequences, the logits by position and the wrapper each step used."""
    seqs = {"a": prompt(1, 70), "b": prompt(2, 33), "c": prompt(3, 150)}
    tables = {
        "a": [9, 2, 40, 17, 5, 60],
        "b": [31, 8, 77],
        "c": [1, 50, 22, 3, 70, 12, 44, 6, 90, 15, 27],
    }
    got: dict[str, dict[int, torch.Tensor]] = {k: {} for k in seqs}
    wrappers: list[str] = []
    c_prompt = list(seqs["c"])
    seqs["c"] = c_prompt[:100]

    def step(*reqs: ScheduledRequest) -> None:
        out = runner.execute_model(
            SchedulerOutput(list(reqs), sum(len(r.token_ids) for r in reqs)), return_logits=True
        )
        wrappers.append(getattr(runner.attn_backend, "last_wrapper", "torch"))
        for rid, tok in out.sampled_token_ids.items():
            got[rid][len(seqs[rid]) - 1] = out.logits[rid]
            seqs[rid].append(tok)

    # 1: a and b prefill whole, c's first chunk (no sample) - a prefill-only step
    step(
        req("a", seqs["a"], 0, tables["a"]),
        req("b", seqs["b"], 0, tables["b"]),
        req("c", c_prompt[:100], 0, tables["c"], sample=False),
    )
    # 2: mixed - a and b decode while c's last chunk (after 100 cached tokens) runs
    seqs["c"] = c_prompt
    step(
        req("a", seqs["a"][-1:], 70, tables["a"], n_out=1),
        req("c", c_prompt[100:], 100, tables["c"]),
        req("b", seqs["b"][-1:], 33, tables["b"], n_out=1),
    )
    # 3..8: decode-only steps (3 rows: padded to 4 under CUDA graphs)
    for n in range(6):
        step(
            *[
                req(rid, seqs[rid][-1:], len(seqs[rid]) - 1, tables[rid], n_out=2 + n)
                for rid in ("c", "a", "b")
            ]
        )
    return seqs, got, wrappers


def errors_vs_hf(
    model_dir: str, seqs: dict[str, list[int]], got: dict[str, dict[int, torch.Tensor]]
) -> tuple[float, float, dict[str, torch.Tensor]]:
    """(engine rows' rel. error vs fp32 HF, HF bf16's own rel. error on the same rows, the fp32
    reference logits)."""
    ref32 = hf_logits(model_dir, seqs, torch.float32)
    ref16 = hf_logits(model_dir, seqs, torch.bfloat16)
    hf_rows = {rid: {pos: ref16[rid][pos] for pos in r} for rid, r in got.items()}
    return rel_err(got, ref32), rel_err(hf_rows, ref32), ref32


def rel_err(rows: dict[str, dict[int, torch.Tensor]], ref: dict[str, torch.Tensor]) -> float:
    num = sum(
        float((row - ref[rid][pos]).norm() ** 2)
        for rid, r in rows.items()
        for pos, row in r.items()
    )
    den = sum(float(ref[rid][pos].norm() ** 2) for rid, r in rows.items() for pos in r)
    return (num / den) ** 0.5


@pytest.mark.parametrize("graph_decode", ["triton", "flashinfer"])
def test_flashinfer_logits_match_hf_in_bf16(gpu_model, graph_decode: str) -> None:
    name, model_dir = gpu_model
    runner = make_runner(model_dir, backend="flashinfer", graph_decode=graph_decode)
    assert runner.attention_backend_name == "flashinfer"
    assert runner.attn_backend.graph_decode == graph_decode
    seqs, got, wrappers = run_script(runner)
    graphs = graph_decode == "triton" or name == "llama-g4"  # FlashInfer's: no group 7 kernel
    assert wrappers == ["prefill", "prefill"] + ["graph_decode" if graphs else "prefill"] * 6
    assert (runner.cuda_graphs is not None) == graphs
    engine_err, hf_err, ref32 = errors_vs_hf(model_dir, seqs, got)
    print(f"{name}: engine bf16 rel err {engine_err:.2e}, HF bf16 rel err {hf_err:.2e}")
    assert engine_err <= max(3 * hf_err, 1e-2), (engine_err, hf_err)
    assert {k: sorted(v) for k, v in got.items()} == {
        "a": list(range(69, 77)),
        "b": list(range(32, 40)),
        "c": list(range(149, 156)),
    }
    # Every step's row is right on its own too (a wrong chunk would hide in the total).
    for rid, rows in got.items():
        for pos, row in rows.items():
            err = float((row - ref32[rid][pos]).norm() / ref32[rid][pos].norm())
            assert err <= max(6 * hf_err, 2e-2), (rid, pos, err)


@pytest.mark.parametrize("graph_decode", ["triton", "flashinfer"])
def test_cuda_graph_decode_equals_eager_decode(gpu_model, graph_decode: str) -> None:
    name, model_dir = gpu_model
    if name != "llama-g4" and graph_decode == "flashinfer":
        pytest.skip("FlashInfer's graph decode needs the decode kernel's group sizes")
    graphs = make_runner(model_dir, backend="flashinfer", graph_decode=graph_decode)
    eager = make_runner(model_dir, backend="flashinfer", cuda_graphs=False)
    assert graphs.cuda_graphs is not None and graphs.cuda_graphs.sizes == [1, 2, 4, 8]
    assert eager.cuda_graphs is None
    seqs_g, got_g, wrappers_g = run_script(graphs)
    seqs_e, got_e, wrappers_e = run_script(eager)
    eager_decode = "decode" if name == "llama-g4" else "prefill"
    assert wrappers_g[2:] == ["graph_decode"] * 6 and wrappers_e[2:] == [eager_decode] * 6
    assert seqs_g == seqs_e
    a = seqs_g["a"]
    one = SchedulerOutput([req("a", a[-1:], len(a) - 1, [9, 2, 40, 17, 5, 60], n_out=9)], 1)
    one_g, one_e = graphs.execute_model(one, True), eager.execute_model(one, True)
    if graph_decode == "flashinfer":  # the eager step runs the same kernel: equal to rounding
        for rid in got_g:
            for pos in got_g[rid]:
                torch.testing.assert_close(got_g[rid][pos], got_e[rid][pos], atol=2e-2, rtol=2e-2)
        # A single row (graph size 1) after the 3-row batches still matches.
        torch.testing.assert_close(one_g.logits["a"], one_e.logits["a"], atol=2e-2, rtol=2e-2)
        return
    # Another kernel (other summation order), so bf16 noise through the layers: same tokens
    # (above) and logits within the bf16 bound the fused-vs-torch test uses; the per-row
    # error against fp32 HF is test_flashinfer_logits_match_hf_in_bf16[triton].
    rows = [(got_g[r][p], got_e[r][p]) for r in got_g for p in got_g[r]] + [
        (one_g.logits["a"], one_e.logits["a"])
    ]
    err = (
        sum(float((g - e).norm() ** 2) for g, e in rows)
        / sum(float(e.norm() ** 2) for _, e in rows)
    ) ** 0.5
    print(f"\n{name}: triton graph vs eager decode logits rel err {err:.2e} over {len(rows)} rows")
    assert err < 2e-2


def test_triton_small_query_steps_match_hf_and_flashinfer(gpu_model) -> None:
    """``small_query_attention="triton"`` (eager): decode-only steps and a short append over
    cached context run the Triton kernel; logits within bf16 noise of fp32 HF and of the
    FlashInfer wrappers, same tokens."""
    name, model_dir = gpu_model
    triton = make_runner(model_dir, backend="flashinfer", cuda_graphs=False, small_query="triton")
    plain = make_runner(model_dir, backend="flashinfer", cuda_graphs=False)
    seqs_t, got_t, wrappers_t = run_script(triton)
    seqs_p, got_p, _ = run_script(plain)
    assert wrappers_t == ["prefill", "prefill"] + ["triton"] * 6  # the mixed step has 50 tokens
    assert seqs_t == seqs_p
    err, hf_err, _ = errors_vs_hf(model_dir, seqs_t, got_t)
    print(f"\n{name}: triton small-query steps rel err {err:.2e}, HF bf16 {hf_err:.2e}")
    assert err <= max(3 * hf_err, 1e-2), (err, hf_err)
    # A 5-token append after a's cached context: same logits as the FlashInfer prefill path.
    a = seqs_t["a"]
    extra = prompt(9, 5)
    append = SchedulerOutput(
        [req("a", a[-1:] + extra, len(a) - 1, [9, 2, 40, 17, 5, 60], n_out=9)], 6
    )
    out_t, out_p = triton.execute_model(append, True), plain.execute_model(append, True)
    assert triton.attn_backend.last_wrapper == "triton"
    assert plain.attn_backend.last_wrapper == "prefill"
    diff = float((out_t.logits["a"] - out_p.logits["a"]).norm() / out_p.logits["a"].norm())
    assert diff < 2e-2, diff


def test_small_query_auto_takes_triton_from_the_context_threshold_on(
    gpu_model, monkeypatch
) -> None:
    """``small_query_attention="auto"`` (the default): the script's short contexts stay on the
    FlashInfer wrappers; with the threshold under them, its decode-only steps run Triton."""
    from engine.attention import flashinfer_backend

    _, model_dir = gpu_model
    short = make_runner(model_dir, backend="flashinfer", cuda_graphs=False, small_query="auto")
    _, _, wrappers = run_script(short)
    assert "triton" not in wrappers and short.attn_backend.small_query == "auto"
    monkeypatch.setattr(flashinfer_backend, "SMALL_QUERY_AUTO_MIN_CONTEXT", 100)
    long = make_runner(model_dir, backend="flashinfer", cuda_graphs=False, small_query="auto")
    _, _, wrappers = run_script(long)
    assert wrappers == ["prefill", "prefill"] + ["triton"] * 6  # c's context is >= 100


def test_greedy_on_gpu_matches_the_cpu_engine(tmp_path) -> None:
    model_dir = make_tiny_model(tmp_path, "llama", seed=7)
    outs = []
    for device in ("cpu", "cuda"):
        runner = make_runner(model_dir, dtype="float32", device=device, num_blocks=32)
        assert runner.attention_backend_name == "torch"  # fp32: FlashInfer has no fp32 kernels
        seqs = {"x": prompt(4, 40), "y": prompt(5, 17)}
        tables = {"x": [3, 7, 1, 20], "y": [11, 2, 30]}
        out = runner.execute_model(
            SchedulerOutput([req(r, seqs[r], 0, tables[r]) for r in seqs], 57)
        )
        for n in range(12):
            for r, tok in out.sampled_token_ids.items():
                seqs[r].append(tok)
            out = runner.execute_model(
                SchedulerOutput(
                    [req(r, seqs[r][-1:], len(seqs[r]) - 1, tables[r], n_out=n + 1) for r in seqs],
                    2,
                )
            )
        outs.append(seqs)
    assert outs[0] == outs[1]


def test_kv_budget_from_the_memory_profile(gpu_model) -> None:
    name, model_dir = gpu_model
    if name != "llama-g4":
        pytest.skip("one model is enough")
    cfg = EngineConfig(
        dtype="bfloat16",
        device="cuda",
        cache=CacheConfig(gpu_memory_utilization=0.2),
        scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=1024, max_num_batched_tokens=512),
    )
    runner = ModelRunner(cfg, model_dir)
    budget = runner.kv_budget
    assert budget is not None
    print(budget.summary())
    assert runner.num_gpu_blocks == budget.num_blocks - 1
    assert budget.kv_bytes == budget.num_blocks * runner.kv_cache.bytes_per_block
    assert budget.peak_activation_bytes > 0 and budget.persistent_bytes > 0
    assert (
        budget.kv_bytes
        + budget.persistent_bytes
        + budget.peak_activation_bytes
        + budget.non_torch_bytes
        + budget.cuda_graph_reserve_bytes
        <= 0.2 * budget.total_bytes
    )
    # The whole cache plus what was measured fits the device: allocated bytes agree.
    assert torch.cuda.memory_allocated() >= budget.kv_bytes


def _three_peaks(rows: int) -> torch.Tensor:
    """``rows`` rows of 300 logits on the GPU: 3.0, 2.9 and 2.8 at ids 10, 20, 30, -5 else."""
    logits = torch.full((rows, 300), -5.0, device="cuda")
    logits[:, 10], logits[:, 20], logits[:, 30] = 3.0, 2.9, 2.8
    return logits


def test_gpu_sampling_contracts() -> None:
    sampler = Sampler(seed=0, device="cuda")
    assert sampler.uses_flashinfer
    logits = _three_peaks(4)
    top1 = SampleRequest(SamplingParams(temperature=1.0, top_k=1), 0)
    top2 = SampleRequest(SamplingParams(temperature=1.0, top_k=2), 0)
    greedy = SampleRequest(GREEDY, 0)
    seen: set[int] = set()
    for _ in range(100):
        toks = sampler(logits, [top1, top2, greedy, top2])
        assert toks[0] == 10 and toks[2] == 10
        seen.update([toks[1], toks[3]])
    assert seen == {10, 20}
    # Seeded rows: same token whatever the batch, the device or the sampler instance.
    seeded = [
        SampleRequest(SamplingParams(temperature=1.0, top_p=0.9, seed=s), n)
        for s, n in [(1, 0), (2, 5), (3, 9)]
    ]
    alone = [Sampler(9, "cuda")(logits[:1], [r])[0] for r in seeded]
    batched = Sampler(1, "cuda")(logits[:3], seeded)
    on_cpu = Sampler(5)(logits[:3].cpu(), seeded)
    assert alone == batched == on_cpu


def test_gpu_min_p_and_token_masks() -> None:
    """vLLM's min_p and the allowed/banned masks on the FlashInfer sampling path: min_p 1 keeps
    only the top token, 0.9 keeps the tokens within 10% of it (exp(-0.1) = 0.905 of the top
    probability, not exp(-0.2)); a masked row samples only its allowed ids and never a banned
    one, its neighbours untouched; the same on CPU."""
    from engine.runner.logits_processors import MaskRow, mask_tokens

    sampler = Sampler(seed=0, device="cuda")
    assert sampler.uses_flashinfer
    logits = _three_peaks(3)
    only_top = SampleRequest(SamplingParams(temperature=1.0, min_p=1.0), 0)
    near_top = SampleRequest(SamplingParams(temperature=1.0, min_p=0.9), 0)
    free = SampleRequest(SamplingParams(temperature=1.0, top_k=3), 0)
    seen: list[set[int]] = [set(), set(), set()]
    for _ in range(200):
        for i, tok in enumerate(sampler(logits, [only_top, near_top, free])):
            seen[i].add(tok)
    assert seen == [{10}, {10, 20}, {10, 20, 30}]
    rows = [MaskRow(allowed=(30, 40)), None, MaskRow(banned=(10, 20))]
    masked = mask_tokens(logits, rows)
    assert torch.equal(masked[1], logits[1].float())
    picked: list[set[int]] = [set(), set(), set()]
    plain = [SampleRequest(SamplingParams(temperature=1.0, top_k=3), 0)] * 3
    for _ in range(100):
        for i, tok in enumerate(sampler(masked, plain)):
            picked[i].add(tok)
    assert picked[0] <= {30, 40} and 30 in picked[0]
    assert picked[1] == {10, 20, 30} and picked[2] <= {30, *range(300)} - {10, 20}
    assert torch.equal(mask_tokens(logits.cpu(), rows), masked.cpu())


def test_fused_kernels_equal_the_torch_path_on_gpu(gpu_model) -> None:
    """Triton fused norm/activation (the CUDA default) vs the torch path: same greedy tokens,
    logits within bf16 noise, through prefill, mixed and (graph) decode steps."""
    name, model_dir = gpu_model
    fused = make_runner(model_dir, backend="flashinfer")
    plain = make_runner(model_dir, backend="flashinfer", fused_kernels=False)
    assert fused.fused_kernels is True and plain.fused_kernels is False
    seqs_f, got_f, wrappers_f = run_script(fused)
    seqs_p, got_p, wrappers_p = run_script(plain)
    assert wrappers_f == wrappers_p
    # Compare logits up to each request's first differing token: a near-tie may flip one
    # greedy token in bf16 (seen once on qwen2-g7 in the H200 run), after which the contexts
    # differ. The prefill rows always compare; the error bound is bf16 noise (the engine's
    # own bf16 error against fp32 HF is ~1e-2 on these models).
    same: dict[str, list[int]] = {}
    for r in seqs_p:
        agree = next(
            (i for i, (a, b) in enumerate(zip(seqs_f[r], seqs_p[r], strict=False)) if a != b),
            len(seqs_p[r]),
        )
        same[r] = [p for p in got_p[r] if p < agree]
    compared = sum(len(v) for v in same.values())
    num = sum(float((got_f[r][p] - got_p[r][p]).norm() ** 2) for r in same for p in same[r])
    den = sum(float(got_p[r][p].norm() ** 2) for r in same for p in same[r])
    err = (num / den) ** 0.5 if den else float("nan")
    print(
        f"\n{name}: fused vs torch path logits rel err {err:.2e} over {compared} rows, "
        f"tokens identical: {seqs_f == seqs_p}"
    )
    assert all(same[r] for r in same), "a request's first sampled token already differs"
    assert err < 2e-2
