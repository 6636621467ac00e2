"""Long contexts on the GPU (every test carries the ``gpu`` marker; skipped without CUDA).

- The pinned plan buffers that every step refills (FlashInfer's page-locked plan buffer, the
  decode graphs' inputs) survive a host that runs steps ahead of the device: the cause of the
  illegal memory accesses past ~4.5K tokens (engine/attention/staging.py).
- ``LLM.generate`` with CUDA graphs equals the eager path token for token at 4K, 8K, 32K and
  ``max_model_len`` tokens of context, batch 1 and mixed with short sequences, with chunked
  prefill; the first token's logits after a 32K prompt match HF transformers in float32 within
  bf16 noise; a long prefix reloaded from the host tier decodes as if computed.
- The Triton decode kernel alone at 40K tokens of context and at the widest block table the pool
  allows, eager and inside a CUDA graph replayed at several lengths.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core_types import ScheduledRequest, SchedulerOutput
from engine.llm import LLM
from engine.runner.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from tests.engine.hf_models import make_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

MAX_LEN = 40960
# head_dim 128 and GQA group 4 (the kernels' real case), 3 layers: a 32K prefill is cheap.
SHAPE = dict(
    hidden_size=1024,
    intermediate_size=2048,
    num_attention_heads=8,
    num_key_value_heads=2,
    num_hidden_layers=3,
    max_position_embeddings=MAX_LEN,
)
NUM_BLOCKS = 2 * MAX_LEN // 16 + 64  # a 32K sequence beside short ones, and the widest table
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("long"), "llama", seed=11, **SHAPE)


def ids(seed: int, n: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def llm(model_dir: str, **kw) -> LLM:
    kw.setdefault("num_gpu_blocks", NUM_BLOCKS)
    return LLM(model_dir, dtype="bfloat16", device="cuda", **kw)


def generate(engine: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in engine.generate(prompts, params)]


def test_plan_buffers_survive_a_host_that_runs_ahead() -> None:
    """FlashInfer's ``plan`` writes its plan into page-locked memory and enqueues a copy of it
    to the device. Two chunks planned back to back while the device is still busy (a step that
    samples nothing never synchronizes): the first chunk's copy must still carry the first
    chunk's plan, not the second's (without the fence it read the second's: a chunk of 2048
    queries over 2K keys then ran with the geometry of 904 queries over 5000 keys)."""
    from engine.attention.base import AttentionMetadata
    from engine.attention.flashinfer_backend import FlashInferAttentionBackend

    backend = FlashInferAttentionBackend(32, 8, 128, 128**-0.5, small_query="flashinfer")
    backend.bind(torch.bfloat16, torch.device("cuda"))

    def meta(q_len: int, kv_len: int) -> AttentionMetadata:
        pages = -(-kv_len // 16)
        i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device="cuda")  # noqa: E731
        return AttentionMetadata(
            i32([0, q_len]),
            i32([kv_len]),
            i32([list(range(pages))]),
            torch.zeros(q_len, dtype=torch.int64, device="cuda"),
            [q_len],
            [kv_len],
            16,
            [list(range(pages))],
        )

    first, second = meta(2048, 2048), meta(904, 5000)
    assert backend._prefill is not None
    workspace = backend._prefill._int_workspace_buffer  # where each plan's copy lands
    refs = []
    for m in (second, first, second):  # each plan alone, from the same previous state
        backend.plan(m)
        torch.cuda.synchronize()
        refs.append(workspace.clone())
    ref_first, ref_second = refs[1], refs[2]
    differ = (ref_first != ref_second).nonzero()
    assert differ.numel() > 0  # the two plans are told apart by these bytes
    at = differ[:64, 0]
    torch.cuda._sleep(500_000_000)  # the device is busy: the host runs ahead
    backend.plan(first)
    snapshot = workspace.clone()  # enqueued right after the first plan's copy
    backend.plan(second)
    torch.cuda.synchronize()
    assert torch.equal(snapshot[at], ref_first[at])


@pytest.mark.parametrize("context", [4096, 8192, 32768, MAX_LEN - 24])
def test_graphs_equal_eager_at_long_contexts(model_dir: str, context: int) -> None:
    """Batch 1, chunked prefill (the default 2048-token budget), 16 greedy tokens; eager steps
    use the same Triton kernel for decode rows as the graphs (``small_query_attention``)."""
    prompt = ids(context, context)
    with llm(model_dir, small_query_attention="triton") as graphs:
        got = generate(graphs, [prompt], 16)
    with llm(model_dir, small_query_attention="triton", enforce_eager=True) as eager:
        want = generate(eager, [prompt], 16)
    assert got == want and len(got[0]) == 16


def test_mixed_long_and_short_sequences_equal_eager(model_dir: str) -> None:
    """A 32K and a 9K prompt beside six short ones: the short ones decode in mixed steps while
    the long ones prefill, then all decode together. The short ones outlast the long ones, so
    every decode-only step has 8 or 6 rows: the same kernel configuration as the size-8 graph."""
    prompts = [ids(1, 32768), ids(2, 9000)] + [ids(10 + i, 40 + 37 * i) for i in range(6)]
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in [24, 24] + [160] * 6
    ]

    def run(**kw) -> list[list[int]]:
        with llm(model_dir, small_query_attention="triton", **kw) as engine:
            return [o.token_ids for o in engine.generate(prompts, params)]

    got, want = run(), run(enforce_eager=True)
    assert [len(t) for t in got] == [24, 24] + [160] * 6
    assert got == want


def test_max_model_len_comes_from_the_model_config(model_dir: str) -> None:
    with llm(model_dir, num_gpu_blocks=MAX_LEN // 16 + 8) as engine:
        assert engine.engine.max_model_len == MAX_LEN
        with pytest.raises(ValueError, match="max_model_len"):
            generate(engine, [ids(3, MAX_LEN)], 1)


def test_first_token_logits_after_32k_match_hf(model_dir: str) -> None:
    """The engine's chunked prefill of 32K tokens (bf16) against HF transformers (fp32, sdpa):
    the last position's logits within bf16 noise (HF's own bf16 error, or 1e-2)."""
    from transformers import AutoModelForCausalLM

    n = 32768
    tokens = ids(5, n)
    cfg = EngineConfig(
        dtype="bfloat16",
        device="cuda",
        cache=CacheConfig(num_gpu_blocks=n // 16 + 4),
        scheduler=SchedulerConfig(max_model_len=MAX_LEN),
    )
    runner = ModelRunner(cfg, model_dir)
    table = list(range(n // 16 + 4))[::-1]  # scattered: the highest block ids first
    out = None
    for start in range(0, n, 2048):
        end = min(n, start + 2048)
        out = runner.execute_model(
            SchedulerOutput(
                [ScheduledRequest("r", tokens[start:end], start, table, end == n, GREEDY, 0)],
                end - start,
            ),
            return_logits=True,
        )
    assert out is not None and out.logits is not None
    ours = out.logits["r"].float()
    del runner
    torch.cuda.empty_cache()
    refs = {}
    for dtype in (torch.float32, torch.bfloat16):
        hf = (
            AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
            .cuda()
            .eval()
        )
        with torch.inference_mode():
            refs[dtype] = (
                hf(torch.tensor([tokens], device="cuda"), logits_to_keep=1)
                .logits[0, -1]
                .float()
                .cpu()
            )
        del hf
        torch.cuda.empty_cache()
    ref = refs[torch.float32]
    err = float((ours - ref).norm() / ref.norm())
    hf_err = float((refs[torch.bfloat16] - ref).norm() / ref.norm())
    print(f"\n32K first-token logits rel err {err:.2e} (HF bf16 {hf_err:.2e})")
    assert err <= max(3 * hf_err, 1e-2), (err, hf_err)


def test_long_prefix_reloaded_from_host_decodes_as_computed(model_dir: str) -> None:
    """A 16K prefix evicted from a small GPU pool to the host tier, reloaded for a follow-up that
    extends it, then decoded: same tokens as an engine without offload."""
    prefix = ids(7, 16384)
    follow = prefix + ids(8, 100)
    other = ids(9, 18000)  # pushes all but ~75 blocks of the prefix out of the 1200-block pool
    offload = {"tiers": [{"kind": "host", "capacity": "6GiB"}], "decision": "load"}
    with llm(model_dir, num_gpu_blocks=1200, kv_offload=True, kv_offload_config=offload) as engine:
        generate(engine, [prefix], 1)
        generate(engine, [other], 1)
        got = generate(engine, [follow], 32)
        stats = engine.kv_stats()
    assert stats["loaded_tokens"] >= 14000, stats
    with llm(model_dir) as plain:
        want = generate(plain, [follow], 32)
    assert got == want


def _scattered_case(context: int, num_blocks: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    pages = -(-context // 16)
    # The sequence owns the pool's last block (the highest id a table can hold) and random others.
    order = [num_blocks - 1] + torch.randperm(num_blocks - 1, generator=g)[: pages - 1].tolist()
    cache = torch.randn(num_blocks, 2, 2, 16, 2, 128, generator=g).to(torch.bfloat16).cuda()
    q = torch.randn(1, 8, 128, generator=g).to(torch.bfloat16).cuda()
    return cache, q, order


@pytest.mark.parametrize("context", [40960, 131072])
def test_decode_kernel_alone_at_long_contexts_eager_and_in_a_graph(context: int) -> None:
    """40K tokens (this file's max_model_len) and 128K (a 8192-page table, every page of the
    pool but the scratch): eager, then captured once and replayed at shorter lengths."""
    from engine.kernels.decode_attention import decode_config, paged_decode_attention
    from tests.engine.test_decode_attention import reference

    num_blocks = context // 16 + 1
    cache, q, order = _scattered_case(context, num_blocks, seed=context)
    kv_layer = cache[:, 1]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cfg = decode_config(1, 2, sms)
    scale = 128**-0.5
    table = torch.zeros(3 + len(order), dtype=torch.int32, device="cuda")
    indptr, last, indices = table[:2], table[2:3], table[3:]
    indices.copy_(torch.tensor(order, dtype=torch.int32))

    def set_len(n: int) -> None:
        pages = -(-n // 16)
        indptr.copy_(torch.tensor([0, pages], dtype=torch.int32))
        last.fill_(n - (pages - 1) * 16)

    set_len(context)
    out = paged_decode_attention(q, kv_layer, indptr, indices, last, scale, *cfg)
    ref = reference(q, kv_layer, order, [0, len(order)], [context], scale)
    torch.testing.assert_close(out.float(), ref, rtol=3e-2, atol=3e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = paged_decode_attention(q, kv_layer, indptr, indices, last, scale, *cfg)
    for n in (context, context - 17, 5000, 17, 1):
        set_len(n)
        graph.replay()
        pages = -(-n // 16)
        ref = reference(q, kv_layer, order[:pages], [0, pages], [n], scale)
        torch.testing.assert_close(captured.float(), ref, rtol=3e-2, atol=3e-2)
