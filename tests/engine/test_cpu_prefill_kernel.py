"""The C prefill attention of CPU prompt chunks (engine/kernels/cpu_prefill.py): against
float64 SDPA with the causal mask aligned to the end of the context, split over threads, from
strided views; and an engine's greedy tokens with and without it."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from engine import SamplingParams
from engine.kernels import cpu_prefill
from tests.engine.hf_models import make_tiny_model
from tests.engine.kernel_ab import greedy_on_and_off

pytestmark = pytest.mark.skipif(not cpu_prefill.enabled(), reason="no C compiler here")


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 SDPA: query ``t`` at position ``S - T + t`` sees keys up to it."""
    num_q, num_keys = q.shape[0], k.shape[0]
    q_pos = torch.arange(num_keys - num_q, num_keys).unsqueeze(1)
    mask = torch.arange(num_keys).unsqueeze(0) <= q_pos
    out = F.scaled_dot_product_attention(
        *(t.double().transpose(0, 1).unsqueeze(0) for t in (q, k, v)),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1).reshape(num_q, -1).float()


@pytest.mark.parametrize(
    "num_q, num_keys, hkv, group, dim",
    [
        (1024, 1024, 3, 3, 64),  # SmolLM2's heads, a whole prompt
        (100, 700, 3, 3, 64),  # a chunk after cached context
        (37, 37, 8, 4, 128),  # Llama-3's heads, a tile that ends mid-way
        (5, 300, 4, 1, 64),  # no grouping
        (200, 1500, 4, 7, 128),  # Qwen2.5's grouping
        (1, 65, 2, 2, 64),  # one query: every key
        (64, 64, 1, 16, 64),  # one KV head, a group wider than a tile
    ],
)
@pytest.mark.parametrize("threads", [1, 3])
def test_matches_float64_sdpa(
    num_q: int, num_keys: int, hkv: int, group: int, dim: int, threads: int
) -> None:
    gen = torch.Generator().manual_seed(num_q * 7 + num_keys)
    q = torch.randn(num_q, hkv * group, dim, generator=gen)
    k = torch.randn(num_keys, hkv, dim, generator=gen)
    v = torch.randn(num_keys, hkv, dim, generator=gen)
    got = cpu_prefill.prefill_attention(q, k, v, dim**-0.5, threads=threads)
    want = reference(q, k, v, dim**-0.5)
    assert got.shape == (num_q, hkv * group * dim)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)


def test_reads_strided_rows_and_writes_into_out() -> None:
    """q and k as views of the rotated q|k rows, v of the fused projection (as the engine
    hands them: three row strides), the output written into a slice of a larger buffer,
    nothing else touched."""
    gen = torch.Generator().manual_seed(3)
    num, heads, hkv, dim = 150, 6, 2, 64
    fused = torch.randn(num, (heads + 2 * hkv) * dim, generator=gen)
    rotated = torch.randn(num, (heads + hkv) * dim, generator=gen)
    q = rotated[:, : heads * dim].view(num, heads, dim)
    k = rotated[:, heads * dim :].view(num, hkv, dim)
    v = fused[:, (heads + hkv) * dim :].view(num, hkv, dim)
    assert k.stride(0) != v.stride(0)
    assert not q.is_contiguous() and cpu_prefill.supports(q, k, v)
    big = torch.full((num + 10, heads, dim), 7.0)
    got = cpu_prefill.prefill_attention(q[40:], k, v, 0.1, out=big[5 : 5 + num - 40])
    torch.testing.assert_close(got, reference(q[40:], k, v, 0.1), rtol=1e-5, atol=2e-5)
    assert torch.equal(big[:5], torch.full((5, heads, dim), 7.0))
    assert torch.equal(
        big[5 + num - 40 :], torch.full((num + 10 - (5 + num - 40), heads, dim), 7.0)
    )


def test_parts_split_the_causal_work_evenly() -> None:
    parts = cpu_prefill._parts(3, 1024, 1024, 2)
    assert sorted({h for h, _, _ in parts}) == [0, 1, 2]
    for head in range(3):
        ranges = sorted((a, b) for h, a, b in parts if h == head)
        assert ranges[0][0] == 0 and ranges[-1][1] == 1024
        assert all(x[1] == y[0] for x, y in zip(ranges, ranges[1:], strict=False))
        work = [sum(t + 1 for t in range(a, b)) for a, b in ranges]
        assert max(work) / min(work) < 1.1
    assert cpu_prefill._parts(4, 10, 10, 1) == [(h, 0, 10) for h in range(4)]
    # a short chunk over a long context on many threads: split by heads only (each part
    # packs its head's 8K keys again)
    assert cpu_prefill._parts(8, 20, 8192, 64) == [(h, 0, 20) for h in range(8)]
    assert len(cpu_prefill._parts(8, 256, 8192, 64)) == 8 * 8


def test_refuses_what_it_cannot_read() -> None:
    q, k = torch.randn(8, 4, 48), torch.randn(8, 2, 48)
    assert not cpu_prefill.supports(q, k, k)  # head dim not a multiple of 64
    q64, k64 = torch.randn(8, 4, 64), torch.randn(8, 2, 64)
    assert cpu_prefill.supports(q64, k64, k64)
    assert not cpu_prefill.supports(q64.double(), k64.double(), k64.double())
    assert not cpu_prefill.supports(q64.transpose(0, 1), k64, k64)  # heads not contiguous
    with pytest.raises(ValueError, match="prefill_attention"):
        cpu_prefill.prefill_attention(q, k, k, 1.0)


def test_an_engines_greedy_tokens_are_the_same_without_it(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """Ragged prompts, chunked (32 tokens a step) and sharing a prefix (cached context), over
    a head dim of 64, with and without the kernel."""
    model_dir = make_tiny_model(tmp_path, "llama", seed=5, head_dim=64)
    rng = random.Random(5)
    shared = [rng.randrange(3, 500) for _ in range(48)]
    prompts = [shared + [rng.randrange(3, 500) for _ in range(n)] for n in (3, 40, 90)]
    prompts.append([rng.randrange(3, 500) for _ in range(70)])
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    runs, used = greedy_on_and_off(
        monkeypatch,
        cpu_prefill,
        "prefill_attention",
        "KVTIER_CPU_PREFILL_KERNEL",
        model_dir,
        prompts,
        params,
        num_gpu_blocks=64,
        max_num_batched_tokens=32,
    )
    assert runs[0] == runs[1]
    assert used[0] > 0 and used[1] == 0


def test_the_kernel_is_built_with_vectors_as_wide_as_the_isa() -> None:
    # A vector wider than the ISA's registers is lowered through the stack, one element at a
    # time: a 16-float build for AVX2 ran ~13x slower than the 8-float one.
    capability = torch.backends.cpu.get_cpu_capability()
    expected = {"AVX512": 16, "AVX2": 8}.get(capability, 4)
    assert cpu_prefill.vector_floats() == expected, capability


def test_a_build_without_vector_flags_matches_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    # A CPU where torch finds neither AVX-512 nor AVX2 gets the baseline build (4-float
    # vectors, 2-row tiles): the same results, read through another tiling of the keys.
    from engine.kernels import cpu_build

    monkeypatch.setitem(cpu_build._FLAGS, torch.backends.cpu.get_cpu_capability(), [])
    kernel = cpu_build.CKernel(
        "prefill_attention",
        cpu_prefill._SOURCE,
        cpu_prefill._KERNEL.symbol,
        cpu_prefill._KERNEL.argtypes,
        cpu_prefill._KERNEL.env,
    )
    monkeypatch.setattr(cpu_prefill, "_KERNEL", kernel)
    assert cpu_prefill.vector_floats() == 4
    gen = torch.Generator().manual_seed(11)
    for num_q, num_keys, hkv, group, dim in [(70, 200, 2, 4, 128), (129, 129, 3, 3, 64)]:
        q = torch.randn(num_q, hkv * group, dim, generator=gen)
        k = torch.randn(num_keys, hkv, dim, generator=gen)
        v = torch.randn(num_keys, hkv, dim, generator=gen)
        got = cpu_prefill.prefill_attention(q, k, v, dim**-0.5, threads=1)
        torch.testing.assert_close(got, reference(q, k, v, dim**-0.5), rtol=1e-5, atol=2e-5)
