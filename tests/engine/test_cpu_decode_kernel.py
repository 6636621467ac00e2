"""The C decode attention of a CPU batch (engine/kernels/cpu_decode.py): the paged cache read in
place, this step's keys and values written by the same call; against SDPA over the gathered
blocks, and an engine's greedy tokens with and without it."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from engine import SamplingParams
from engine.kernels import cpu_decode
from tests.engine.hf_models import make_tiny_model
from tests.engine.kernel_ab import greedy_on_and_off

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason="no C compiler here")


def reference(q, cache, tables, lens, scale):  # type: ignore[no-untyped-def]
    """SDPA of each request's one query over its first ``lens[b]`` cached positions."""
    num_reqs, num_heads, dim = q.shape
    _, _, bs, hkv, _ = cache.shape
    outs = []
    for b in range(num_reqs):
        n = int(lens[b])
        blocks = tables[b, : -(-n // bs)]
        k = cache[blocks, 0].reshape(-1, hkv, dim)[:n].transpose(0, 1)  # [Hkv, n, D]
        v = cache[blocks, 1].reshape(-1, hkv, dim)[:n].transpose(0, 1)
        o = F.scaled_dot_product_attention(
            q[b].unsqueeze(1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), scale=scale,
            enable_gqa=True,
        )  # fmt: skip
        outs.append(o[0, :, 0].reshape(-1))
    return torch.stack(outs)


@pytest.mark.parametrize("hkv, group, dim, bs", [(3, 3, 64, 16), (2, 4, 32, 8), (1, 1, 16, 4)])
def test_matches_sdpa_over_strided_blocks_and_writes_the_new_token(
    hkv: int, group: int, dim: int, bs: int
) -> None:
    gen = torch.Generator().manual_seed(hkv * 100 + dim)
    num_blocks, num_layers, layer = 40, 3, 1
    # the engine's layout: a block keeps its layers together, so one layer's blocks are strided
    whole = torch.randn(num_blocks, num_layers, 2, bs, hkv, dim, generator=gen)
    cache = whole[:, layer]
    assert not cache.is_contiguous() and cache[0].is_contiguous()
    lens = torch.tensor([1, bs, bs + 1, 5 * bs - 3], dtype=torch.int64)
    width = -(-int(lens.max()) // bs)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = perm[: 4 * width].view(4, width).contiguous()
    q = torch.randn(4, hkv * group, dim, generator=gen)
    k_new = torch.randn(4, hkv, dim, generator=gen)
    v_new = torch.randn(4, hkv, dim, generator=gen)
    last = lens - 1
    slots = (tables.gather(1, (last // bs).view(-1, 1)).view(-1) * bs + last % bs).contiguous()
    expected_cache = cache.clone()
    for b in range(4):
        blk, off = int(slots[b]) // bs, int(slots[b]) % bs
        expected_cache[blk, 0, off], expected_cache[blk, 1, off] = k_new[b], v_new[b]
    other_layers = whole[:, [i for i in range(num_layers) if i != layer]].clone()
    scratch = torch.empty(hkv * group * width * bs)
    out = cpu_decode.decode_attention(
        q, cache, tables, lens, dim**-0.5, scratch, (k_new, v_new, slots)
    )
    assert torch.equal(cache, expected_cache)  # the new keys and values, and nothing else
    assert torch.equal(whole[:, [i for i in range(num_layers) if i != layer]], other_layers)
    want = reference(q, cache, tables, lens, dim**-0.5)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    again = cpu_decode.decode_attention(q, cache, tables, lens, dim**-0.5, scratch)
    torch.testing.assert_close(again, out, rtol=0, atol=0)  # nothing to write: same result


def test_refuses_what_it_cannot_read_in_place() -> None:
    cache = torch.zeros(4, 2, 4, 1, 8)
    q, tables, lens = torch.zeros(1, 1, 8), torch.zeros(1, 1, dtype=torch.int64), torch.ones(1)
    with pytest.raises(ValueError):  # float lengths
        cpu_decode.decode_attention(q, cache, tables, lens, 1.0, torch.empty(8))
    with pytest.raises(ValueError):  # a block not contiguous
        cpu_decode.decode_attention(
            q, cache.transpose(1, 2), tables, lens.long(), 1.0, torch.empty(8)
        )


def test_an_engines_greedy_tokens_are_the_same_without_it(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """A batch of 6 ragged prompts decoding 24 tokens over a small pool (several blocks each)."""
    model_dir = make_tiny_model(tmp_path, "llama", seed=11)
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (5, 17, 33, 40, 64, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    runs, used = greedy_on_and_off(
        monkeypatch,
        cpu_decode,
        "decode_attention",
        "KVTIER_CPU_DECODE_KERNEL",
        model_dir,
        prompts,
        params,
        num_gpu_blocks=64,
    )
    assert runs[0] == runs[1]
    assert used[0] > 0 and used[1] == 0  # the kernel ran in the first engine's decode steps only
