"""Tensor parallelism on CPU (gloo, 2 ranks, one process each): greedy outputs at TP=2 equal
TP=1 on random-weight Llama and Qwen2 models with 2 KV heads (GQA), and a bad degree is one
clear error before any process starts; a rank whose driver's process is killed exits even when
it is stuck."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.models.base import ModelArchConfig
from engine.models.parallel import TPShard, check_tp_size, local_arch
from tests.engine.hf_models import make_tiny_model

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Lengths across block boundaries, and a shared 32-token prefix (prefix cache hits).
    shared = [rng.randrange(3, 500) for _ in range(32)]
    return [[rng.randrange(3, 500) for _ in range(n)] for n in (5, 17, 40)] + [
        shared + [rng.randrange(3, 500) for _ in range(9)],
        shared + [rng.randrange(3, 500) for _ in range(3)],
    ]


def _generate(model_dir: str, tp: int, prompts: list[list[int]]) -> list[list[int]]:
    with LLM(
        model_dir, num_gpu_blocks=48, dtype="float32", device="cpu", tensor_parallel_size=tp
    ) as llm:
        return [list(o.token_ids) for o in llm.generate(prompts, GREEDY)]


@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("llama", {}),
        ("qwen2", {}),  # q/k/v biases, split with their heads
        ("llama", {"attention_bias": True, "mlp_bias": True}),  # row-parallel biases: added once
        ("qwen3", {}),  # per-head q/k norms, replicated
    ],
)
def test_tp2_greedy_equals_tp1(tmp_path, arch: str, overrides: dict) -> None:
    model_dir = make_tiny_model(tmp_path, arch, seed=4, **overrides)
    prompts = _prompts(1)
    one = _generate(model_dir, 1, prompts)
    two = _generate(model_dir, 2, prompts)
    assert two == one
    assert len({tuple(t) for t in one}) > 1  # the model tells prompts apart


def test_tp_size_must_divide_the_heads(tmp_path) -> None:
    model_dir = make_tiny_model(tmp_path, "llama", seed=0)
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide"):
        LLM(model_dir, num_gpu_blocks=8, dtype="float32", device="cpu", tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        LLM(model_dir, num_gpu_blocks=8, dtype="float32", device="cpu", tensor_parallel_size=0)


def test_local_arch_divides_heads_and_mlp() -> None:
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "max_position_embeddings": 32,
        "rms_norm_eps": 1e-6,
    }
    arch = ModelArchConfig.from_hf(cfg)
    mine = local_arch(arch, TPShard(1, 4))
    assert (mine.num_heads, mine.num_kv_heads, mine.intermediate_size) == (2, 1, 32)
    assert mine.head_dim == arch.head_dim and mine.hidden_size == 64
    assert TPShard(1, 4).kv_head_range(4) == (1, 2)
    check_tp_size(arch, 4)
    with pytest.raises(ValueError, match="does not divide the model's 4 KV heads"):
        check_tp_size(arch, 8)


def test_serve_flag_maps_to_the_config() -> None:
    import argparse

    from engine.server.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--tensor-parallel-size", "2"]).tensor_parallel_size == 2
    assert parser.parse_args([]).tensor_parallel_size == 1


def test_tp2_penalties_logprobs_and_seeded_sampling_match_tp1(tmp_path) -> None:
    """Only rank 0 samples: penalties (token history), logprobs and prompt logprobs come out as
    at TP=1 (the other ranks never see the sampling parameters)."""
    model_dir = make_tiny_model(tmp_path, "qwen2", seed=2)
    params = [
        SamplingParams(
            max_tokens=8,
            temperature=0.0,
            ignore_eos=True,
            repetition_penalty=1.3,
            frequency_penalty=0.5,
            logprobs=2,
            prompt_logprobs=1,
        ),
        SamplingParams(max_tokens=8, temperature=0.7, seed=11, ignore_eos=True),
    ]
    prompts = _prompts(5)[:2]
    outs = {}
    for tp in (1, 2):
        with LLM(
            model_dir, num_gpu_blocks=32, dtype="float32", device="cpu", tensor_parallel_size=tp
        ) as llm:
            outs[tp] = llm.generate(prompts, params)
    for one, two in zip(outs[1], outs[2], strict=True):
        assert two.token_ids == one.token_ids
    a, b = outs[1][0], outs[2][0]
    assert [e.logprob for e in b.logprobs] == pytest.approx(
        [e.logprob for e in a.logprobs], abs=1e-4
    )
    assert [e.logprob for e in b.prompt_logprobs[1:]] == pytest.approx(
        [e.logprob for e in a.prompt_logprobs[1:]], abs=1e-4
    )


def test_a_refused_step_leaves_the_ranks_in_step(tmp_path) -> None:
    from engine.core_types import ScheduledRequest, SchedulerOutput

    model_dir = make_tiny_model(tmp_path, "llama", seed=1)
    with LLM(
        model_dir, num_gpu_blocks=16, dtype="float32", device="cpu", tensor_parallel_size=2
    ) as llm:
        bad = SchedulerOutput([ScheduledRequest("x", [1, 2], 0, [99], True, GREEDY)], 2)
        with pytest.raises(ValueError, match="block id outside"):
            llm.engine.runner.execute_model(bad)
        out = llm.generate([[5, 6, 7]], GREEDY)[0]  # every rank still answers
    assert len(out.token_ids) == GREEDY.max_tokens


def _stuck_rank() -> None:
    """A rank stuck for good (an NCCL collective whose peer died, a hung GPU) once started."""
    from engine.runner.tp_worker import exit_with_parent

    exit_with_parent(1)
    time.sleep(3600)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # exited, not yet reaped
    except FileNotFoundError:
        return True


def test_a_stuck_rank_exits_when_its_driver_is_killed() -> None:
    """The driver (here a plain process that started one rank the way ``TPDriver`` does:
    ``spawn``) is killed with SIGKILL, so nothing stops its rank; the rank's main thread never
    returns, yet the rank is gone within seconds instead of holding its GPU."""
    driver = subprocess.Popen(
        [sys.executable, "-c", (
            "import multiprocessing as mp, time\n"
            "from tests.engine.test_tp import _stuck_rank\n"
            "if __name__ == '__main__':\n"
            "    p = mp.get_context('spawn').Process(target=_stuck_rank, daemon=True)\n"
            "    p.start()\n"
            "    print(p.pid, flush=True)\n"
            "    time.sleep(3600)\n"
        )],
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    rank = None
    try:
        assert driver.stdout is not None
        rank = int(driver.stdout.readline())
        time.sleep(1.0)  # the rank imported engine and started its watch
        assert not _gone(rank)
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        deadline = time.monotonic() + 10
        while not _gone(rank) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(rank), "the rank outlived its killed driver"
    finally:
        driver.kill()
        driver.wait()
        if rank is not None and not _gone(rank):
            os.kill(rank, signal.SIGKILL)
