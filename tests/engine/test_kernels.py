"""The fused Triton kernels (engine/kernels) against the torch reference.

Runs wherever Triton imports: on a CUDA machine on the GPU, elsewhere on the CPU through
Triton's interpreter (TRITON_INTERPRET=1, set here before the kernels are first imported, since
Triton reads it when a kernel is decorated). Skipped cleanly where Triton is not installed (it
is not a default dependency). The model-level test runs the tiny Llama on the CPU torch path
with and without the fused kernels and compares the logits.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's first import

import torch.nn.functional as F  # noqa: E402

from engine.kernels import fused_add_rms_norm, fused_kernels_available, silu_and_mul  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# bf16: the kernels round once where torch may round twice, and the interpreter rounds
# float32 -> bf16 its own way: up to two bf16 ulps (2^-7 relative).
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


def rand(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,cols", [(1, 64), (7, 300), (3, 4096)])
def test_fused_add_rms_norm_matches_torch(dtype: torch.dtype, rows: int, cols: int) -> None:
    x = rand(rows, cols, dtype=dtype, seed=rows + cols)
    res = rand(rows, cols, dtype=dtype, seed=rows * cols, scale=3.0)
    w = rand(cols, dtype=dtype, seed=1).abs() + 0.5
    x0, res0 = x.clone(), res.clone()
    normed, new_res = fused_add_rms_norm(x, res, w, 1e-5)
    ref_res = x + res
    ref = F.rms_norm(ref_res.float(), (cols,), w.float(), 1e-5)
    assert normed.dtype == dtype and new_res.dtype == dtype and normed.shape == (rows, cols)
    torch.testing.assert_close(new_res.float(), ref_res.float(), **TOL[dtype])
    torch.testing.assert_close(normed.float(), ref, **TOL[dtype])
    assert torch.equal(x, x0) and torch.equal(res, res0)  # inputs untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,inter", [(1, 100), (5, 1024), (2, 1500)])
def test_silu_and_mul_matches_torch(dtype: torch.dtype, rows: int, inter: int) -> None:
    gate_up = rand(rows, 2 * inter, dtype=dtype, seed=inter, scale=2.0)
    out = silu_and_mul(gate_up)
    g, u = gate_up.float().split(inter, dim=-1)
    assert out.shape == (rows, inter) and out.dtype == dtype
    torch.testing.assert_close(out.float(), F.silu(g) * u, **TOL[dtype])


def test_kernels_read_row_strided_views() -> None:
    base = rand(4, 256, dtype=torch.float32, seed=3)
    x = base[:, :128]  # row stride 256, unit column stride
    res = rand(4, 128, dtype=torch.float32, seed=4)
    w = torch.ones(128, device=DEVICE)
    normed, new_res = fused_add_rms_norm(x, res, w, 1e-6)
    torch.testing.assert_close(new_res, x + res)
    torch.testing.assert_close(normed, F.rms_norm(x + res, (128,), w, 1e-6))
    torch.testing.assert_close(silu_and_mul(base[1:3]), F.silu(base[1:3, :128]) * base[1:3, 128:])


def test_bad_shapes_raise() -> None:
    x = rand(2, 8, dtype=torch.float32, seed=0)
    with pytest.raises(ValueError, match="do not match"):
        fused_add_rms_norm(x, x[:1], torch.ones(8, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match="unit column stride"):
        fused_add_rms_norm(x.t(), x.t(), torch.ones(2, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(rand(2, 7, dtype=torch.float32, seed=0))


def test_empty_batch() -> None:
    x = torch.empty(0, 16, device=DEVICE)
    normed, new_res = fused_add_rms_norm(x, x, torch.ones(16, device=DEVICE), 1e-5)
    assert normed.shape == (0, 16) and new_res.shape == (0, 16)
    assert silu_and_mul(torch.empty(0, 32, device=DEVICE)).shape == (0, 16)


def test_available_only_on_cuda() -> None:
    assert fused_kernels_available(torch.device("cpu")) is False
    if torch.cuda.is_available():
        assert fused_kernels_available(torch.device("cuda")) is True


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fused_model_path_matches_the_torch_path(tmp_path, arch: str) -> None:
    """The whole decoder (prefill + decode, fp32 CPU) with model.fused_kernels on and off."""
    if DEVICE.type == "cuda":
        pytest.skip("CPU tensors need the interpreter; test_gpu compares the paths on CUDA")
    from engine.config import CacheConfig, EngineConfig
    from engine.core_types import ScheduledRequest, SchedulerOutput
    from engine.runner.model_runner import ModelRunner
    from engine.sampling_params import SamplingParams
    from tests.engine.hf_models import make_tiny_model

    model_dir = make_tiny_model(tmp_path, arch, seed=3)
    cfg = EngineConfig(dtype="float32", device="cpu", cache=CacheConfig(num_gpu_blocks=8))
    runner = ModelRunner(cfg, model_dir)
    assert runner.fused_kernels is False and runner.model.fused_kernels is False
    with pytest.raises(ValueError, match="unavailable"):
        ModelRunner(cfg, model_dir, fused_kernels=True)
    greedy = SamplingParams(temperature=0.0)
    prompt = torch.randint(3, 500, (21,), generator=torch.Generator().manual_seed(2)).tolist()
    logits = {}
    for fused in (False, True):
        runner.model.fused_kernels = fused  # what the runner's switch sets on CUDA
        rid = f"r{fused}"
        out = runner.execute_model(
            SchedulerOutput([ScheduledRequest(rid, prompt, 0, [5, 1], True, greedy)], 21),
            return_logits=True,
        )
        tok = out.sampled_token_ids[rid]
        dec = runner.execute_model(
            SchedulerOutput([ScheduledRequest(rid, [tok], 21, [5, 1], True, greedy, 1)], 1),
            return_logits=True,
        )
        logits[fused] = (out.logits[rid], dec.logits[rid])
        runner.execute_model(SchedulerOutput([], 0, frozenset({rid})))
    for a, b in zip(logits[False], logits[True], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,dim", [(6, 64), (3, 128), (2, 48)])
def test_rotary_matches_torch_on_a_strided_qkv_view(
    dtype: torch.dtype, heads: int, dim: int
) -> None:
    from engine.kernels import rotary
    from engine.models.base import RopeConfig
    from engine.models.layers import RotaryEmbedding

    tokens = 5
    qkv = rand(tokens, (heads + 2) * dim, dtype=dtype, seed=heads * dim)
    qk = qkv[:, : heads * dim].view(tokens, heads, dim)  # row stride (heads + 2) * dim
    rope = RotaryEmbedding(dim, 64, RopeConfig(theta=10000.0))
    positions = torch.tensor([0, 3, 17, 40, 63], device=DEVICE)
    cos, sin = rope.cos_sin(positions, dtype)
    out = rotary(qk, cos, sin)
    ref = RotaryEmbedding.apply(qk.float(), cos.float(), sin.float())
    assert out.shape == (tokens, heads, dim) and out.is_contiguous() and out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])
    torch.testing.assert_close(out[0].float(), qk[0].float(), **TOL[dtype])  # position 0: identity


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 64), (8, 8, 32), (6, 2, 48)])
def test_rotary_and_cache_matches_rotary_plus_write_kv(
    dtype: torch.dtype, heads: int, kv_heads: int, dim: int
) -> None:
    """One kernel = rotary on q and k + the torch path's write_kv into a block-major layer
    view; slots outside the written ones stay untouched."""
    from engine.kernels import rotary_and_cache
    from engine.kernels.reference import write_kv
    from engine.kv_cache import KVCache, KVCacheSpec
    from engine.models.base import RopeConfig
    from engine.models.layers import RotaryEmbedding

    tokens = 5
    qkv = rand(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype, seed=heads * dim + kv_heads)
    rope = RotaryEmbedding(dim, 64, RopeConfig(theta=10000.0))
    cos, sin = rope.cos_sin(torch.tensor([0, 3, 17, 40, 63], device=DEVICE), dtype)
    spec = KVCacheSpec(num_layers=3, num_kv_heads=kv_heads, head_dim=dim, dtype=dtype, block_size=4)
    ours, ref = KVCache(spec, 6, DEVICE), KVCache(spec, 6, DEVICE)
    for cache in (ours, ref):
        cache.tensor.copy_(rand(*cache.tensor.shape, dtype=dtype, seed=7))
    slots = torch.tensor([9, 2, 23, 10, 24], device=DEVICE)  # 24 = the scratch block's slot 0
    out = rotary_and_cache(qkv, cos, sin, heads, kv_heads, ours.attention_view(1), slots)
    qk = qkv[:, : (heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim)
    ref_qk = RotaryEmbedding.apply(qk.float(), cos.float(), sin.float())
    v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
    write_kv(ref.attention_view(1), slots, ref_qk[:, heads:].to(dtype), v)
    assert out.shape == (tokens, heads + kv_heads, dim) and out.dtype == dtype
    torch.testing.assert_close(out.float(), ref_qk, **TOL[dtype])
    torch.testing.assert_close(ours._storage.float(), ref._storage.float(), **TOL[dtype])
    assert torch.equal(ours._storage[:, [0, 2]], ref._storage[:, [0, 2]])  # other layers untouched
    with pytest.raises(ValueError):
        rotary_and_cache(qkv[:, :-dim], cos, sin, heads, kv_heads, ours.attention_view(1), slots)


@pytest.mark.parametrize("programs", [0, 2])
def test_copy_layer_from_host_moves_exactly_one_layer_chunk_per_block(programs: int) -> None:
    """Blocks of a block-major cache filled layer by layer from a host slab at arbitrary
    (aligned) offsets: each call writes only its chunk of the listed rows; with 2 programs
    for 3 tiles, one program loops over two of them."""
    from engine.kernels import copy_layer_from_host

    rows, words, layers = 5, 48, 3  # a block = 3 layers x 16 words
    chunk = words // layers
    slab = torch.arange(1000, dtype=torch.int32)
    if DEVICE.type == "cuda":
        slab = slab.pin_memory()
    cache = torch.zeros(rows, words, dtype=torch.int32, device=DEVICE)
    src_offsets = torch.tensor([100, 4, 520], device=DEVICE)  # words, multiples of 4
    dst_rows = torch.tensor([3, 0, 4], device=DEVICE)
    for layer in (2, 0):
        copy_layer_from_host(slab, src_offsets, cache, dst_rows, layer * chunk, chunk, programs)
    expected = torch.zeros(rows, words, dtype=torch.int32)
    for src, row in ((100, 3), (4, 0), (520, 4)):
        for layer in (2, 0):
            lo = layer * chunk
            expected[row, lo : lo + chunk] = torch.arange(src + lo, src + lo + chunk)
    assert torch.equal(cache.cpu(), expected)
    with pytest.raises(ValueError):
        copy_layer_from_host(slab, src_offsets[:2], cache, dst_rows, 0, chunk)
