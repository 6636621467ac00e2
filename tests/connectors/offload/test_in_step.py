"""In-step host loads: a prefix held by the host tier is copied into its GPU blocks before the
forward of the very step that admits the request, so the first token comes out of that step
(the async path, ``in_step_host_loads: false``, needs one more). A slot that fails its header
check is found while the load is planned: the load stops there and the rest is recomputed, in
the same single step, with outputs unchanged. Scenario as in test_offload's exact stats test:
P (85 tokens) is evicted by Q, P again has 2 GPU blocks and 3 host blocks."""

from __future__ import annotations

import random

import pytest

from cachestore.hashing import Namespace, block_key, hash_request_tokens
from connectors.offload.scheduler import OffloadScheduler
from engine import LLM, SamplingParams
from tests.connectors.offload.test_connector import SLOT, VOCAB, make_llm

ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def prompts() -> tuple[list[int], list[int]]:
    rng = random.Random(2)
    return (
        [rng.randrange(3, VOCAB) for _ in range(85)],
        [rng.randrange(3, VOCAB) for _ in range(120)],
    )


def offload(in_step: bool) -> dict:
    return {
        "decision": "load",
        "calibrate": False,
        "in_step_host_loads": in_step,
        "tiers": [{"kind": "host", "capacity": f"{64 * SLOT}B"}],
    }


def evict_p_to_host(llm: LLM) -> list[int]:
    """Run P, then Q (evicts P's blocks 2..4 to the host tier); returns P's first token."""
    p, q = prompts()
    first = list(llm.generate([p], ONE)[0].token_ids)
    llm.generate([q], ONE)
    return first


def steps_to_first_token(llm: LLM, prompt: list[int]) -> tuple[int, list[int]]:
    """Add ``prompt`` and step the engine until it yields a token: (steps taken, the token)."""
    engine = llm.engine
    engine.add_request("again", prompt, ONE)
    for step in range(1, 10):
        outs = engine.step()
        if outs:
            [out] = outs
            assert out.finished
            return step, list(out.token_ids)
    raise AssertionError("no token after 9 steps")


def host_pins(llm: LLM) -> int:
    host = llm.engine.offload.store.tiers[0]  # type: ignore[union-attr]
    return sum(e.pins for e in host._entries.values())


@pytest.mark.parametrize(("in_step", "steps"), [(True, 1), (False, 2)])
def test_a_host_reload_yields_its_first_token_in_the_admitting_step(
    model_dir: str, in_step: bool, steps: int
) -> None:
    p, _ = prompts()
    reference = make_llm(model_dir, 10).generate([p], ONE)[0].token_ids
    with make_llm(model_dir, 10, offload(in_step)) as llm:
        assert evict_p_to_host(llm) == reference
        assert steps_to_first_token(llm, p) == (steps, reference)
        kv = llm.kv_stats()
        assert host_pins(llm) == 0 and kv["store"]["load_pins"] == 0
    assert kv["gpu_hit_tokens"] == 32 and kv["loaded_tokens"] == 48
    assert kv["recomputed_tokens"] == 0 and kv["failed_loads"] == 0
    assert kv["num_loads"] == 1 and kv["loaded_blocks"] == 3
    assert kv["tiers"]["host"]["hit_blocks"] == 3


def test_a_coalesced_host_reload_gives_the_same_tokens_and_stats(model_dir: str) -> None:
    """``coalesced_loads``: P's three host blocks sit in consecutive slots (saved in order), so
    they move as one run through the staging buffer; the first token and the accounting are
    those of the per-block copies (the test above)."""
    p, _ = prompts()
    reference = make_llm(model_dir, 10).generate([p], ONE)[0].token_ids
    with make_llm(model_dir, 10, {**offload(True), "coalesced_loads": True}) as llm:
        copier = llm.engine.offload.worker._loader._copier  # type: ignore[union-attr]
        assert copier is not None and copier._staging is None
        assert copier.coalesce == (copier._non_blocking)  # on by the config where it is used
        copier.coalesce = True  # (CUDA only) the same run code, here on the CPU
        assert evict_p_to_host(llm) == reference
        assert steps_to_first_token(llm, p) == (1, reference)
        assert copier._staging is not None  # the run path copied them
        kv = llm.kv_stats()
        assert host_pins(llm) == 0
    assert kv["gpu_hit_tokens"] == 32 and kv["loaded_tokens"] == 48
    assert kv["recomputed_tokens"] == 0 and kv["failed_loads"] == 0
    assert kv["tiers"]["host"]["hit_blocks"] == 3


def test_a_slot_failing_its_header_check_is_recomputed_in_the_same_step(
    model_dir: str,
) -> None:
    p, _ = prompts()
    reference = make_llm(model_dir, 10).generate([p], ONE)[0].token_ids
    with make_llm(model_dir, 10, offload(True)) as llm:
        assert evict_p_to_host(llm) == reference
        ns = Namespace(model_fingerprint=llm.engine.runner.model_fingerprint)
        key = block_key(ns, hash_request_tokens(ns, p)[3])  # P's block 3 (the 2nd host block)
        host = llm.engine.offload.store.tiers[0]  # type: ignore[union-attr]
        start = host._entries[key].slot * host.slot_bytes
        host.slab_tensor()[start] ^= 0xFF  # the codec magic: the header check fails
        assert steps_to_first_token(llm, p) == (1, reference)
        kv = llm.kv_stats()
        assert host_pins(llm) == 0
    # Block 2 loaded; blocks 3 and 4 recomputed (the load stops at the first bad slot).
    assert kv["gpu_hit_tokens"] == 32 and kv["loaded_tokens"] == 16
    assert kv["recomputed_tokens"] == 32 and kv["failed_loads"] == 1
    assert kv["tiers"]["host"]["hit_blocks"] == 1 and kv["loaded_blocks"] == 1


def test_scheduler_keys_equal_block_key(model_dir: str) -> None:
    """The scheduler side builds keys from a prefix computed once: same as ``block_key``."""
    with make_llm(model_dir, 10, offload(True)) as llm:
        sched = llm.engine.offload.scheduler  # type: ignore[union-attr]
        assert isinstance(sched, OffloadScheduler)
        ns = llm.engine.namespace
        for h in hash_request_tokens(ns, prompts()[0]):
            assert sched._key(h) == block_key(ns, h)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("flag", ["layered_loads", "coalesced_loads", "load_issue_ahead"])
def test_cuda_in_step_reload_variants_keep_outputs(model_dir: str, dtype: str, flag: str) -> None:
    """On CUDA, ``layered_loads`` (the default): the in-step copies move a group of layers of
    every block at a time (driver 2-D copies per run of slots into device staging, then a
    scatter), each layer's attention waiting for its own group; ``coalesced_loads``: the
    host blocks move as runs (one pinned copy per run into the device staging, one word
    scatter); ``load_issue_ahead`` (1 layer): the layer-wise groups issued as the forward
    reaches them, the load held until all are. Each way: same tokens as without offload, all
    three blocks loaded, every pin released."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    p, _ = prompts()
    kw = dict(dtype=dtype, device="cuda", attention_backend="torch")
    reference = LLM(model_dir, num_gpu_blocks=10, **kw).generate([p], ONE)[0].token_ids
    # coalesced runs are the whole-block path: layer-wise loads (the default) off for them
    layered = flag != "coalesced_loads"
    config = {**offload(True), flag: 1 if flag == "load_issue_ahead" else True}
    config["layered_loads"] = layered
    with LLM(model_dir, num_gpu_blocks=10, kv_offload=True, kv_offload_config=config, **kw) as llm:
        copier = llm.engine.offload.worker._loader._copier  # type: ignore[union-attr]
        assert copier is not None
        assert copier.layered if layered else copier.coalesce
        if layered:
            from connectors.device.copy2d import copy_many_available

            assert copier._driver_layers == copy_many_available()
            assert copier._staged is not None  # the staged 2-D copies (raw_layers)
            assert copier._staged.issue_ahead == (flag == "load_issue_ahead")
        assert evict_p_to_host(llm) == reference
        assert steps_to_first_token(llm, p) == (1, reference)
        assert layered or copier._staging is not None  # the run path ran
        kv = llm.kv_stats()
        assert host_pins(llm) == 0
        assert llm.engine.runner.kv_cache._layer_ready is None
    assert kv["loaded_tokens"] == 48 and kv["recomputed_tokens"] == 0
    assert kv["failed_loads"] == 0 and kv["loaded_blocks"] == 3


@pytest.mark.parametrize(
    ("limit", "hold", "first_token_steps", "deferred"),
    [(1, False, (1, 2), 1), (1, True, (1, 2), 1), (0, False, (1, 1), 0)],
)
def test_two_host_reloads_admitted_together_take_one_in_step_load_a_step(
    model_dir: str, limit: int, hold: bool, first_token_steps: tuple[int, int], deferred: int
) -> None:
    """``in_step_loads_per_step``: two prompts whose prefixes only the host tier holds arrive
    together. With a limit of 1 the first loads in-step and yields its token in the admitting
    step; the second loads asynchronously (its copies issued behind the first's) and yields
    its token one step later. 0 (the default): both in-step, both in the first step. The
    tokens are those of an engine without offload either way. ``async_copies_after_forward``
    (CUDA): the second's copies wait until the first's forward is queued, so its token may
    come a step later still."""
    rng = random.Random(7)
    a, b = ([rng.randrange(3, VOCAB) for _ in range(70)] for _ in range(2))
    plain = make_llm(model_dir, 20)
    want = [list(plain.generate([p], ONE)[0].token_ids) for p in (a, b)]
    config = {**offload(True), "in_step_loads_per_step": limit, "async_copies_after_forward": hold}
    with make_llm(model_dir, 20, config) as llm:
        engine = llm.engine
        for p in (a, b):  # each prefix into the host tier only
            llm.generate([p], ONE)
            engine.flush_kv()
            assert engine.pool.reset_prefix_cache()
        engine.add_request("a", a, ONE)
        engine.add_request("b", b, ONE)
        got: dict[str, tuple[int, list[int]]] = {}
        for step in range(1, 6):
            for out in engine.step():
                got[out.req_id] = (step, list(out.token_ids))
            if len(got) == 2:
                break
        kv = llm.kv_stats()
        assert host_pins(llm) == 0 and kv["store"]["load_pins"] == 0
    assert got["a"][0] == first_token_steps[0]
    assert first_token_steps[1] <= got["b"][0] <= first_token_steps[1] + int(hold)
    assert [got["a"][1], got["b"][1]] == want
    assert kv["in_step_deferred_loads"] == deferred
    assert kv["loaded_tokens"] == 2 * 64 and kv["recomputed_tokens"] == 0
    assert kv["failed_loads"] == 0 and kv["num_loads"] == 2
