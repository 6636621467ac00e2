"""Scheduler logic against a deterministic stand-in runner that keeps a fake paged KV cache.

The fake runner stores each position's token id in its slot and, before computing a slice,
checks that every earlier position's slot holds the right token; its sampled token is a
function of the whole cached sequence. So wrong block tables, bad prefix hits or broken
preemption show up as assertion errors or as outputs that differ from a reference run.
"""

from __future__ import annotations

import pytest

from cachestore.hashing import Namespace
from engine.config import SchedulerConfig
from engine.core_types import ModelRunnerOutput, SchedulerOutput
from engine.kv_connector import ExternalHit, SchedulerConnector
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.sched.block_pool import BlockPool
from engine.sched.kv_cache_manager import KVCacheManager
from engine.sched.scheduler import Scheduler

BS = 16


class FakeRunner:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.kv: dict[int, int] = {}  # slot -> token id

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        sampled: dict[str, int] = {}
        for sr in out.requests:
            truth = self.scheduler.requests[sr.req_id].all_token_ids
            assert len(sr.block_table) * BS >= sr.num_computed_tokens + len(sr.token_ids)
            for pos in range(sr.num_computed_tokens):
                slot = sr.block_table[pos // BS] * BS + pos % BS
                assert self.kv.get(slot) == truth[pos], f"{sr.req_id}: stale KV at {pos}"
            for i, tok in enumerate(sr.token_ids):
                pos = sr.num_computed_tokens + i
                assert tok == truth[pos]
                self.kv[sr.block_table[pos // BS] * BS + pos % BS] = tok
            if sr.sample:
                end = sr.num_computed_tokens + len(sr.token_ids)
                seq = [self.kv[sr.block_table[p // BS] * BS + p % BS] for p in range(end)]
                sampled[sr.req_id] = (sum((p + 1) * t for p, t in enumerate(seq)) + 7) % 997 + 3
        return ModelRunnerOutput(sampled_token_ids=sampled)


def make(
    num_blocks: int = 64,
    budget: int = 64,
    max_seqs: int = 8,
    chunked: bool = True,
    connector: SchedulerConnector | None = None,
) -> tuple[Scheduler, FakeRunner]:
    pool = BlockPool(num_blocks)
    kv = KVCacheManager(pool, Namespace(model_fingerprint="fake"))
    config = SchedulerConfig(
        max_num_batched_tokens=budget, max_num_seqs=max_seqs, enable_chunked_prefill=chunked
    )
    sched = Scheduler(config, kv, max_model_len=1024, connector=connector, debug=True)
    return sched, FakeRunner(sched)


def req(req_id: str, prompt: list[int], max_tokens: int = 4) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return Request(req_id, list(prompt), params)


def prompt(n: int, base: int = 0) -> list[int]:
    return [(base + 3 * i) % 500 + 10 for i in range(n)]


def run_all(
    sched: Scheduler, runner: FakeRunner, max_steps: int = 500
) -> tuple[dict[str, list[int]], list[SchedulerOutput]]:
    outs: dict[str, list[int]] = {}
    steps: list[SchedulerOutput] = []
    tracked = dict(sched.requests)
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        assert so.requests, "scheduler stalled"
        steps.append(so)
        sched.update_from_output(so, runner.execute_model(so))
        sched.kv.pool.check_integrity()
    assert not sched.has_unfinished_requests()
    for rid, r in tracked.items():
        outs[rid] = list(r.output_token_ids)
    return outs, steps


def slices(so: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    return [(s.req_id, s.num_computed_tokens, len(s.token_ids), s.sample) for s in so.requests]


def test_chunked_prefill_splits_under_the_token_budget() -> None:
    sched, runner = make(budget=32)
    sched.add_request(req("a", prompt(100), max_tokens=3))
    sched.add_request(req("b", prompt(20, base=1), max_tokens=2))
    _, steps = run_all(sched, runner)
    # While b waits, a's chunk leaves it the reserve (8 of 32); then the shorter remaining
    # prefill (b's 12) goes first, and the decode first of all.
    assert [slices(s) for s in steps] == [
        [("a", 0, 32, False)],
        [("a", 32, 24, False), ("b", 0, 8, False)],
        [("b", 8, 12, True), ("a", 56, 20, False)],
        [("b", 20, 1, True), ("a", 76, 24, True)],
        [("a", 100, 1, True)],
        [("a", 101, 1, True)],
    ]
    assert all(s.num_batched_tokens <= 32 for s in steps)
    assert [s.num_batched_tokens for s in steps] == [32, 32, 32, 25, 1, 1]


def _first_token_steps(
    sched: Scheduler, runner: FakeRunner, arrivals: dict[int, Request], max_steps: int = 100
) -> tuple[dict[str, int], list[SchedulerOutput]]:
    """Steps (1-based) until every request is done, adding ``arrivals[k]`` before step k;
    returns the step of each request's first token, and the steps."""
    first: dict[str, int] = {}
    steps: list[SchedulerOutput] = []
    for k in range(1, max_steps + 1):
        if k in arrivals:
            sched.add_request(arrivals[k])
        if not sched.has_unfinished_requests() and k > max(arrivals):
            break
        so = sched.schedule()
        steps.append(so)
        for r in sched.update_from_output(so, runner.execute_model(so)):
            first.setdefault(r.req_id, k)
        sched.kv.pool.check_integrity()
    return first, steps


def test_a_later_rounds_short_prefill_is_not_queued_behind_a_long_one() -> None:
    # A new user's 600-token prompt runs in 64-token chunks; a 12-token prompt arrives before
    # step 2. First-come-first-served by whole request, it would wait until step 10 (the long
    # prompt's last chunk); it gets its chunk, and its first token, in step 2.
    sched, runner = make(num_blocks=64, budget=64)
    first, steps = _first_token_steps(
        sched,
        runner,
        {
            1: req("long", prompt(600), max_tokens=2),
            2: req("short", prompt(12, base=7), max_tokens=2),
        },
    )
    assert first["short"] == 2
    assert slices(steps[1]) == [("long", 64, 52, False), ("short", 0, 12, True)]
    # The long prompt loses only the short one's 12 tokens: the reserve's rest came back.
    assert first["long"] == 10
    assert all(s.num_batched_tokens == 64 for s in steps[:9])


def test_decodes_are_not_starved_by_a_running_long_prefill() -> None:
    sched, runner = make(num_blocks=64, budget=32)
    first, steps = _first_token_steps(
        sched,
        runner,
        {
            1: req("long", prompt(200), max_tokens=1),
            2: req("chat", prompt(4, base=3), max_tokens=4),
        },
    )
    assert first["chat"] == 2
    # Admitted behind the long prefill, the decode still gets its token every step.
    assert [any(r == "chat" for r, *_ in slices(s)) for s in steps[1:5]] == [True] * 4
    assert [slices(s)[0][0] for s in steps[2:5]] == ["chat"] * 3  # decodes go first


def test_an_unused_reserve_goes_back_to_the_running_prefill() -> None:
    # max_num_seqs 1: the waiting request cannot be admitted, so the reserve returns.
    sched, runner = make(budget=32, max_seqs=1)
    sched.add_request(req("a", prompt(96), max_tokens=1))
    sched.add_request(req("b", prompt(8, base=2), max_tokens=1))
    _, steps = run_all(sched, runner)
    assert [slices(s) for s in steps[:3]] == [
        [("a", 0, 32, False)],
        [("a", 32, 32, False)],
        [("a", 64, 32, True)],
    ]


def test_without_chunking_a_prompt_waits_for_a_whole_budget() -> None:
    sched, runner = make(budget=40, chunked=False)
    sched.add_request(req("a", prompt(30), max_tokens=2))
    sched.add_request(req("b", prompt(30, base=5), max_tokens=1))
    _, steps = run_all(sched, runner)
    assert [slices(s) for s in steps] == [
        [("a", 0, 30, True)],
        [("a", 30, 1, True), ("b", 0, 30, True)],
    ]


def test_max_num_seqs_is_respected_exactly() -> None:
    sched, runner = make(budget=1000, max_seqs=2)
    for i in range(5):
        sched.add_request(req(f"r{i}", prompt(10, base=i), max_tokens=3 + i))
    _, steps = run_all(sched, runner)
    counts = [len(s.requests) for s in steps]
    assert max(counts) == 2
    # r0..r4 need 3..7 tokens; a slot frees when one finishes.
    assert counts == [2] * 10 + [1] * 5
    assert [r for r, *_ in slices(steps[3])] == ["r1", "r2"]  # r0 done after 3 tokens


def test_prefix_hit_skips_exactly_the_cached_full_blocks() -> None:
    sched, runner = make()
    base = prompt(50)
    sched.add_request(req("a", base, max_tokens=2))
    out_a, _ = run_all(sched, runner)
    # Shares 40 tokens: blocks 0 and 1 hit (32 tokens); block 2 differs at token 40.
    b_prompt = base[:40] + prompt(12, base=77)
    sched.add_request(req("b", b_prompt, max_tokens=2))
    so = sched.schedule()
    assert slices(so) == [("b", 32, 20, True)]
    b = sched.requests["b"]
    assert b.num_cached_tokens == 32
    sched.update_from_output(so, runner.execute_model(so))
    run_all(sched, runner)
    # Identical 48-token prompt: 3 full blocks cached but the last token must be computed.
    sched.add_request(req("c", base[:48], max_tokens=1))
    sched.add_request(req("d", base[:49], max_tokens=1))
    so = sched.schedule()
    assert slices(so) == [("c", 32, 16, True), ("d", 48, 1, True)]
    assert sched.stats.prefix_cache_hit_tokens_total == 32 + 32 + 48
    assert sched.stats.prefix_cache_queried_tokens_total == 50 + 52 + 48 + 49
    sched.update_from_output(so, runner.execute_model(so))
    # Outputs with a hit equal those computed from scratch.
    ref, ref_runner = make(num_blocks=64)
    ref.kv.enable_caching = False
    ref.add_request(req("b", b_prompt, max_tokens=2))
    ref_out, _ = run_all(ref, ref_runner)
    assert ref_out["b"] == b.output_token_ids
    assert out_a["a"] != ref_out["b"]


def test_preemption_by_recompute_when_blocks_run_out() -> None:
    prompts = {f"r{i}": prompt(20 + i, base=11 * i) for i in range(3)}
    ref, ref_runner = make(num_blocks=64)
    for rid, p in prompts.items():
        ref.add_request(req(rid, p, max_tokens=30))
    expected, _ = run_all(ref, ref_runner)
    assert ref.stats.num_preemptions_total == 0
    # 3 requests need 4 blocks each at the end (50-52 tokens); the pool has 7.
    sched, runner = make(num_blocks=7)
    for rid, p in prompts.items():
        sched.add_request(req(rid, p, max_tokens=30))
    tracked = dict(sched.requests)
    got, steps = run_all(sched, runner)
    assert sched.stats.num_preemptions_total > 0
    assert got == expected
    assert all(len(v) == 30 for v in got.values())
    # The most recently admitted request is the one preempted first, and goes back to waiting.
    assert tracked["r2"].num_preemptions >= 1
    assert tracked["r0"].num_preemptions == 0
    # A preempted request is reported to the runner as finished so it drops its state.
    assert any("r2" in s.finished_req_ids for s in steps)
    assert sched.kv.pool.num_free_blocks == 7


def test_abort_frees_blocks_and_reports_finished_id() -> None:
    sched, runner = make(num_blocks=10, budget=100)
    sched.add_request(req("a", prompt(40), max_tokens=10))
    sched.add_request(req("b", prompt(40, base=3), max_tokens=10))
    so = sched.schedule()
    sched.update_from_output(so, runner.execute_model(so))
    assert sched.kv.pool.num_free_blocks == 10 - 3 - 3
    aborted = sched.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert aborted is not None and aborted.status.finish_reason == "abort"
    assert sched.finish_request("a", RequestStatus.FINISHED_ABORTED) is None
    assert sched.kv.pool.num_free_blocks == 7
    so = sched.schedule()
    assert so.finished_req_ids == frozenset({"a"})
    assert slices(so) == [("b", 40, 1, True)]
    sched.kv.pool.check_integrity()


def test_token_stops_and_length() -> None:
    sched, runner = make()
    probe, probe_runner = make()
    probe.add_request(req("p", prompt(5), max_tokens=3))
    out, _ = run_all(probe, probe_runner)
    stop_tok = out["p"][1]
    params = SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=(stop_tok,))
    r = Request("s", prompt(5), params)
    sched.add_request(r)
    run_all(sched, runner)
    assert r.output_token_ids == out["p"][:2]
    assert r.status is RequestStatus.FINISHED_STOPPED and r.stop_reason == stop_tok
    eos = Request(
        "e",
        prompt(5),
        SamplingParams(max_tokens=10, temperature=0.0),
        eos_token_ids=frozenset({stop_tok}),
    )
    sched.add_request(eos)
    run_all(sched, runner)
    assert eos.output_token_ids == out["p"][:2] and eos.stop_reason is None
    ignore = Request(
        "i",
        prompt(5),
        SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
        eos_token_ids=frozenset({stop_tok}),
    )
    sched.add_request(ignore)
    run_all(sched, runner)
    assert ignore.output_token_ids == out["p"] and ignore.status is RequestStatus.FINISHED_LENGTH


def test_rejects_duplicates_and_overlong_prompts() -> None:
    sched, _ = make()
    sched.add_request(req("a", prompt(5)))
    try:
        sched.add_request(req("a", prompt(5)))
    except ValueError as exc:
        assert "duplicate request id 'a'" in str(exc)
    else:
        raise AssertionError("duplicate accepted")
    try:
        sched.add_request(req("long", prompt(1024)))
    except ValueError as exc:
        assert "max_model_len is 1024" in str(exc)
    else:
        raise AssertionError("overlong prompt accepted")


class FakeConnector:
    """Claims lower tiers hold tokens [32, 48) of any request; loads asynchronously by writing
    the right tokens into the fake KV slots, finishing one schedule() call later."""

    def __init__(self) -> None:
        self.runner: FakeRunner | None = None
        self.scheduler: Scheduler | None = None
        self.pending: set[str] = set()
        self.allocs: list[tuple[str, int]] = []

    load_async = True  # InStepConnector: the same tokens, loaded within the admitting step

    def on_request_added(self, request: Request, num_computed_tokens: int) -> None:
        pass

    def wait_pending(self, timeout_s: float) -> bool:
        return False

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> ExternalHit:
        if num_computed_tokens == 32 and request.num_tokens > 48:
            return ExternalHit(num_tokens=16, load_async=self.load_async)
        return ExternalHit()

    def update_state_after_alloc(
        self,
        request: Request,
        block_ids: list[int],
        num_gpu_hit_tokens: int,
        num_external_tokens: int,
    ) -> None:
        self.allocs.append((request.req_id, num_external_tokens))
        if num_external_tokens:
            assert self.runner is not None
            for pos in range(32, 48):
                self.runner.kv[block_ids[pos // BS] * BS + pos % BS] = request.all_token_ids[pos]
            self.pending.add(request.req_id)

    def get_finished_loading(self) -> dict[str, int]:
        done, self.pending = self.pending, set()
        return {req_id: 48 for req_id in done}

    def build_connector_meta(self, output: SchedulerOutput) -> object:
        return {"n": len(output.requests)}

    def request_finished(self, request: Request, block_ids: list[int]) -> None:
        return None


def _cache_a_then_admit_b_and_c(
    conn: FakeConnector,
) -> tuple[Scheduler, FakeRunner, SchedulerOutput]:
    """Runs "a" (60 tokens) to completion, then adds "b" (a's first 32 tokens + 30 new) and
    "c" (10 unrelated tokens) and schedules once: ``conn`` offers b's tokens [32, 48)."""
    sched, runner = make(connector=conn)
    conn.runner = runner
    base = prompt(60)
    sched.add_request(req("a", base, max_tokens=2))
    run_all(sched, runner)
    sched.add_request(req("b", base[:32] + prompt(30, base=9), max_tokens=2))
    sched.add_request(req("c", prompt(10, base=4), max_tokens=2))
    return sched, runner, sched.schedule()


def test_connector_hook_waiting_for_kv_does_not_block_others() -> None:
    conn = FakeConnector()
    sched, runner, so = _cache_a_then_admit_b_and_c(conn)
    assert slices(so) == [("c", 0, 10, True)]  # b is loading; c runs meanwhile
    assert so.kv_connector_metadata == {"n": 1}
    assert sched.requests["b"].status is RequestStatus.WAITING_FOR_KV
    sched.update_from_output(so, runner.execute_model(so))
    so = sched.schedule()
    assert slices(so) == [("c", 10, 1, True), ("b", 48, 14, True)]
    assert sched.requests["b"].num_cached_tokens == 48
    assert ("b", 16) in conn.allocs
    sched.update_from_output(so, runner.execute_model(so))
    run_all(sched, runner)


class InStepConnector(FakeConnector):
    """FakeConnector's tokens [32, 48) as an in-step load (``load_async=False``): the fake
    worker writes them when the blocks are allocated, i.e. before this step's forward."""

    load_async = False

    def update_state_after_alloc(
        self,
        request: Request,
        block_ids: list[int],
        num_gpu_hit_tokens: int,
        num_external_tokens: int,
    ) -> None:
        super().update_state_after_alloc(
            request, block_ids, num_gpu_hit_tokens, num_external_tokens
        )
        self.pending.clear()  # nothing to wait for: the tokens count as computed now


def test_an_in_step_load_runs_the_request_in_its_admitting_step() -> None:
    conn = InStepConnector()
    sched, runner, so = _cache_a_then_admit_b_and_c(conn)
    # b: 32 GPU-hit tokens + 16 loaded in-step, its last 14 computed in this very step.
    assert slices(so) == [("b", 48, 14, True), ("c", 0, 10, True)]
    assert sched.requests["b"].status is RequestStatus.RUNNING
    assert sched.requests["b"].num_cached_tokens == 48 and ("b", 16) in conn.allocs
    sched.update_from_output(so, runner.execute_model(so))
    assert sched.requests["b"].num_output_tokens == 1
    run_all(sched, runner)


class ShortLoadConnector(FakeConnector):
    """Plans FakeConnector's load of [32, 48), but the load comes back empty (a corrupt or
    missing block): only the 32 GPU-hit tokens are valid."""

    def update_state_after_alloc(
        self,
        request: Request,
        block_ids: list[int],
        num_gpu_hit_tokens: int,
        num_external_tokens: int,
    ) -> None:
        self.allocs.append((request.req_id, num_gpu_hit_tokens, num_external_tokens))
        if num_external_tokens:
            self.pending.add(request.req_id)  # nothing written into the blocks

    def get_finished_loading(self) -> dict[str, int]:
        done, self.pending = self.pending, set()
        return {req_id: 32 for req_id in done}


def test_short_load_recomputes_from_the_first_missing_block() -> None:
    conn = ShortLoadConnector()
    sched, runner = make(connector=conn)
    conn.runner = runner
    base = prompt(60)
    sched.add_request(req("a", base, max_tokens=2))
    run_all(sched, runner)
    sched.add_request(req("b", base[:32] + prompt(30, base=9), max_tokens=2))
    so = sched.schedule()
    assert slices(so) == [] and so.kv_connector_metadata == {"n": 0}
    b = sched.requests["b"]
    assert b.status is RequestStatus.WAITING_FOR_KV and b.num_computed_tokens == 48
    assert len(sched.kv.get_block_ids("b")) == 4  # the whole 62-token prompt, allocated up front
    sched.update_from_output(so, runner.execute_model(so))
    so = sched.schedule()
    # The fake runner checks every position below 32 holds the right token before computing.
    assert slices(so) == [("b", 32, 30, True)]
    assert b.num_cached_tokens == 32 and conn.allocs == [("a", 0, 0), ("b", 32, 16)]
    sched.update_from_output(so, runner.execute_model(so))
    outs, _ = run_all(sched, runner)
    assert len(outs["b"]) == 2 and not sched.requests


class OverlapConnector(FakeConnector):
    """Lower tiers hold [32, 64) of any request past a 32-token GPU hit: the head [32, 48) is
    computed while the tail [48, 64) loads; the load ends after ``delay`` schedule() calls,
    valid up to ``valid`` (64: whole tail; 48: it failed). The tail's tokens are written into
    the fake KV only when the load succeeds."""

    def __init__(self, delay: int, valid: int = 64) -> None:
        super().__init__()
        self.delay, self.valid = delay, valid
        self.blocks: dict[str, list[int]] = {}
        self.countdown: dict[str, int] = {}
        self.finished: list[str] = []

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> ExternalHit:
        if num_computed_tokens == 32 and request.num_tokens > 64:
            return ExternalHit(num_tokens=16, load_async=True, num_head_tokens=16)
        return ExternalHit()

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_gpu_hit_tokens: int, n: int
    ) -> None:
        self.allocs.append((request.req_id, n))
        if n:
            self.blocks[request.req_id] = block_ids
            self.countdown[request.req_id] = self.delay

    def get_finished_loading(self) -> dict[str, int]:
        done: dict[str, int] = {}
        for req_id in list(self.countdown):
            self.countdown[req_id] -= 1
            if self.countdown[req_id] < 0:
                del self.countdown[req_id]
                assert self.runner is not None and self.scheduler is not None
                truth = self.scheduler.requests[req_id].all_token_ids
                for pos in range(48, self.valid):
                    slot = self.blocks[req_id][pos // BS] * BS + pos % BS
                    self.runner.kv[slot] = truth[pos]
                done[req_id] = self.valid
        return done

    def request_finished(self, request: Request, block_ids: list[int]) -> None:
        self.finished.append(request.req_id)
        self.countdown.pop(request.req_id, None)  # cancelled


def overlap_setup(conn: OverlapConnector) -> tuple[Scheduler, FakeRunner, list[int]]:
    sched, runner = make(connector=conn)
    conn.runner, conn.scheduler = runner, sched
    base = prompt(60)
    sched.add_request(req("a", base, max_tokens=2))
    run_all(sched, runner)
    return sched, runner, base[:32] + prompt(50, base=9)


def step(sched: Scheduler, runner: FakeRunner) -> list[tuple[str, int, int, bool]]:
    so = sched.schedule()
    sched.update_from_output(so, runner.execute_model(so))
    return slices(so)


def test_overlap_computes_the_head_while_the_tail_loads_then_skips_it() -> None:
    conn = OverlapConnector(delay=1)
    sched, runner, b_prompt = overlap_setup(conn)
    sched.add_request(req("b", b_prompt, max_tokens=2))
    assert step(sched, runner) == [("b", 32, 16, False)]  # the head, at once
    b = sched.requests["b"]
    assert b.status is RequestStatus.RUNNING and len(sched.kv.get_block_ids("b")) == 6
    assert step(sched, runner) == []  # head done, tail still loading
    # The load ended: the fake runner checks positions [0, 64) hold the right tokens.
    assert step(sched, runner) == [("b", 64, 18, True)]
    assert b.num_cached_tokens == 32 + 16 and conn.allocs[-1] == ("b", 16)
    outs, _ = run_all(sched, runner)
    ref_sched, ref_runner = make()
    ref_sched.add_request(req("b", b_prompt, max_tokens=2))
    assert outs["b"] == run_all(ref_sched, ref_runner)[0]["b"]


def test_a_failed_tail_load_is_recomputed_from_the_head_end() -> None:
    conn = OverlapConnector(delay=0, valid=48)
    sched, runner, b_prompt = overlap_setup(conn)
    sched.add_request(req("b", b_prompt, max_tokens=2))
    assert step(sched, runner) == [("b", 32, 16, False)]
    assert step(sched, runner) == [("b", 48, 34, True)]
    assert sched.requests["b"].num_cached_tokens == 32
    run_all(sched, runner)


def test_preempting_an_overlapping_request_cancels_its_load() -> None:
    conn = OverlapConnector(delay=50)
    sched, runner, b_prompt = overlap_setup(conn)
    sched.add_request(req("b", b_prompt, max_tokens=2))
    step(sched, runner)
    b = sched.requests["b"]
    sched.running.remove(b)
    sched.running.append(b)
    sched._preempt(sched.running.pop())
    assert conn.finished == ["a", "b"] and "b" not in conn.countdown
    assert b.status is RequestStatus.PREEMPTED and not sched.kv.get_block_ids("b")
    sched.kv.pool.check_integrity()


class NeverLoads(FakeConnector):
    """Every request past a 32-token hit loads [32, 48) and the load never ends."""

    def __init__(self) -> None:
        super().__init__()
        self.finished: list[str] = []

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_gpu_hit_tokens: int, n: int
    ) -> None:
        self.allocs.append((request.req_id, n))

    def get_finished_loading(self) -> dict[str, int]:
        return {}

    def request_finished(self, request: Request, block_ids: list[int]) -> None:
        self.finished.append(request.req_id)


def test_loading_requests_give_their_blocks_to_running_work() -> None:
    """Pool of 8 blocks. ``r`` runs (3 blocks, growing); ``b`` starts loading and takes the
    whole 4-block prompt plus its shared hit; when ``r`` needs a block, ``b`` gives its blocks
    back (load cancelled) instead of ``r`` being preempted."""
    conn = NeverLoads()
    sched, runner = make(num_blocks=8, connector=conn)
    conn.runner = runner
    base = prompt(60)
    sched.add_request(req("a", base, max_tokens=1))
    run_all(sched, runner)
    sched.add_request(req("r", prompt(47, base=5), max_tokens=30))
    assert step(sched, runner) == [("r", 0, 47, True)]
    sched.add_request(req("b", base[:32] + prompt(30, base=9), max_tokens=2))
    step(sched, runner)
    b = sched.requests["b"]
    assert b.status is RequestStatus.WAITING_FOR_KV
    for _ in range(40):
        if "r" not in sched.requests:
            break
        assert step(sched, runner)[0][0] in ("r", "b")
    assert "r" not in sched.requests and sched.stats.num_preemptions_total == 0
    assert sched.stats.num_released_loads_total >= 1 and conn.finished[:2] == ["a", "b"]


def _make_with(
    config: SchedulerConfig, num_blocks: int, connector: SchedulerConnector | None = None
) -> tuple[Scheduler, FakeRunner]:
    kv = KVCacheManager(BlockPool(num_blocks), Namespace(model_fingerprint="fake"))
    sched = Scheduler(config, kv, max_model_len=1024, connector=connector, debug=True)
    return sched, FakeRunner(sched)


def _long_then_short(
    cap: int, long_tokens: int, others: int = -1
) -> tuple[Scheduler, dict[str, int], list[SchedulerOutput], Request, Request]:
    """A 256-token budget with ``first_token_step_tokens=cap``: "long" (``long_tokens``)
    arrives before step 1, "short" (40 tokens) before step 2, both to the end: (the
    scheduler, each one's first-token step, the steps, long, short)."""
    config = SchedulerConfig(
        max_num_batched_tokens=256,
        max_num_seqs=8,
        first_token_step_tokens=cap,
        first_token_step_others=others,
    )
    sched, runner = _make_with(config, 64)
    long = req("long", prompt(long_tokens), max_tokens=3)
    short = req("short", prompt(40, base=7), max_tokens=3)
    first, steps = _first_token_steps(sched, runner, {1: long, 2: short})
    return sched, first, steps, long, short


def test_a_short_first_token_step_defers_the_long_chunks_and_changes_no_output() -> None:
    """ "long" (600 tokens) is prefilling 256 tokens a step when "short" (40 tokens) arrives:
    the step that yields short's first token carries 40 + 24 prefill tokens (the cap, 64), not
    40 + 216; long goes on in full chunks afterwards. Outputs equal those without the cap."""
    outputs = []
    for cap in (64, 0):
        sched, first, steps, long, short = _long_then_short(cap, 600)
        step = steps[first["short"] - 1]
        sizes = {s.req_id: len(s.token_ids) for s in step.requests}
        if cap:
            assert sizes == {"short": 40, "long": 24}
            assert step.num_batched_tokens == 64
            assert sched.stats.num_first_token_deferred_tokens == 192
        else:
            assert sizes == {"short": 40, "long": 216}
            assert sched.stats.num_first_token_deferred_tokens == 0
        outputs.append((long.output_token_ids, short.output_token_ids))
    assert outputs[0] == outputs[1]


def test_a_short_first_token_step_cuts_a_long_prompts_last_chunk_too() -> None:
    """ "long" (400 tokens) has its last 144 to compute, a finishing chunk, when "short" (40)
    arrives: that chunk is cut to the cap's rest (24 tokens, sampling nothing), so short's
    first token does not wait for 144 tokens of someone else's prefill; long's first token
    comes one step later. Without the cap both finish in step 2. Outputs unchanged."""
    outputs = []
    for cap in (64, 0):
        sched, first, steps, long, short = _long_then_short(cap, 400)
        assert first["short"] == 2
        step = {s.req_id: (len(s.token_ids), s.sample) for s in steps[1].requests}
        if cap:
            assert step == {"short": (40, True), "long": (24, False)}
            assert first["long"] == 3
            assert sched.stats.num_first_token_deferred_tokens == 120
        else:
            assert step == {"short": (40, True), "long": (144, True)}
            assert first["long"] == 2
        outputs.append((long.output_token_ids, short.output_token_ids))
    assert outputs[0] == outputs[1]


def test_first_token_step_others_bounds_the_other_chunks_below_the_caps_room() -> None:
    """With ``first_token_step_others=8`` the step that yields short's first token carries
    40 + 8 prefill tokens, though the 64-token cap leaves 24 (and the default's quarter-cap
    floor would be 16); long goes on in full chunks after. Outputs unchanged."""
    base = _long_then_short(64, 600)
    sched, first, steps, long, short = _long_then_short(64, 600, others=8)
    step = steps[first["short"] - 1]
    assert {s.req_id: len(s.token_ids) for s in step.requests} == {"short": 40, "long": 8}
    assert sched.stats.num_first_token_deferred_tokens == 208
    # the next step: long's full chunk beside short's decode
    assert {s.req_id: len(s.token_ids) for s in steps[first["short"]].requests} == {
        "short": 1,
        "long": 255,
    }
    assert (long.output_token_ids, short.output_token_ids) == (
        base[3].output_token_ids,
        base[4].output_token_ids,
    )
    with pytest.raises(ValueError, match="first_token_step_others"):
        SchedulerConfig(first_token_step_others=-2)


def test_a_decode_that_shows_no_text_yet_keeps_its_step_short() -> None:
    """short's first token decodes to no text (say a piece of a UTF-8 character): its user has
    seen nothing, so the next step, its decode, is kept short as a first token's is (long
    advances 8 tokens, not 255); once short's output shows text, long's chunks are whole
    again. Outputs unchanged."""
    base = _long_then_short(64, 600, others=8)
    textless = frozenset({base[4].output_token_ids[0]})
    assert base[4].output_token_ids[1] not in textless
    config = SchedulerConfig(
        max_num_batched_tokens=256,
        max_num_seqs=8,
        first_token_step_tokens=64,
        first_token_step_others=8,
    )
    sched, runner = _make_with(config, 64)
    long = req("long", prompt(600), max_tokens=3)
    short = req("short", prompt(40, base=7), max_tokens=3)
    short.textless_token_ids = textless
    first, steps = _first_token_steps(sched, runner, {1: long, 2: short})
    k = first["short"]  # its first token came out of step k; step k + 1 decodes it
    sizes = [{s.req_id: len(s.token_ids) for s in step.requests} for step in steps[k : k + 2]]
    assert sizes == [{"short": 1, "long": 8}, {"short": 1, "long": 255}]
    assert [s.awaits_text for s in steps[k].requests if s.req_id == "short"] == [True]
    assert sched.stats.num_first_token_deferred_tokens == 208 + 247
    assert (long.output_token_ids, short.output_token_ids) == (
        base[3].output_token_ids,
        base[4].output_token_ids,
    )


class CountingConnector(FakeConnector):
    def __init__(self) -> None:
        super().__init__()
        self.asked: list[str] = []

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> ExternalHit:
        self.asked.append(request.req_id)
        return super().get_num_new_matched_tokens(request, num_computed_tokens)


def test_a_head_waiting_for_blocks_is_not_looked_up_again_each_step() -> None:
    """A 12-block pool: "a" (150 tokens, 10 blocks) runs; "b" (100 tokens, 7 blocks) cannot
    be admitted until a finishes. Meanwhile the connector is never asked about b (the pool's
    room is checked first), and b is asked exactly once, when it is admitted."""
    conn = CountingConnector()
    config = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8)
    sched, runner = _make_with(config, 12, conn)
    conn.runner, conn.scheduler = runner, sched
    sched.add_request(req("a", prompt(150), max_tokens=20))
    sched.add_request(req("b", prompt(100, base=3), max_tokens=2))
    outs, steps = run_all(sched, runner)
    assert conn.asked.count("b") == 1
    assert sched.stats.num_blocked_skips >= 19  # every step of a's decode
    assert len(outs["a"]) == 20 and len(outs["b"]) == 2
    assert sched.stats.num_schedule_steps == len(steps)


class SlowLoadConnector(FakeConnector):
    """FakeConnector's asynchronous load of tokens [32, 48), reported ended only by the
    ``steps``-th schedule() after the one that began it."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps = steps
        self.age: dict[str, int] = {}

    def get_finished_loading(self) -> dict[str, int]:
        for req_id in self.pending:
            self.age[req_id] = self.age.get(req_id, 0) + 1
        done = {r for r in self.pending if self.age[r] >= self.steps}
        self.pending -= done
        return {req_id: 48 for req_id in done}


def _a_load_beside_a_long_prompt(cap: int) -> tuple[Scheduler, list[SchedulerOutput], Request]:
    """A 256-token budget, ``load_wait_step_tokens=cap`` (first-token steps off): "long" (900
    tokens) prefills; "b" arrives in its second step, its tokens [32, 48) loading for three
    steps. Returns (the scheduler, every step from long's first, b)."""
    conn = SlowLoadConnector(steps=3)
    config = SchedulerConfig(
        max_num_batched_tokens=256,
        max_num_seqs=8,
        first_token_step_tokens=0,
        load_wait_step_tokens=cap,
    )
    sched, runner = _make_with(config, 128, conn)
    conn.runner = runner
    base = prompt(60)
    sched.add_request(req("a", base, max_tokens=1))
    run_all(sched, runner)
    sched.add_request(req("long", prompt(900, base=5), max_tokens=3))
    first = sched.schedule()
    sched.update_from_output(first, runner.execute_model(first))
    b = req("b", base[:32] + prompt(30, base=9), max_tokens=3)
    sched.add_request(b)
    _, steps = run_all(sched, runner)
    return sched, [first, *steps], b


def test_steps_stay_short_while_a_request_waits_for_its_kv_load() -> None:
    """While b's load runs (the step that began it and the two after), long's chunks carry 32
    tokens, not 256: the load's end is seen one short step after it ends instead of after a
    long one. The step that admits b once loaded is whole again (b's 14 tokens and long's
    242). Off (0): long's chunks are whole and b runs in the same step as with the cap.
    Outputs unchanged."""
    capped, steps, b = _a_load_beside_a_long_prompt(32)
    sizes = [{s.req_id: len(s.token_ids) for s in so.requests} for so in steps[:5]]
    assert sizes == [
        {"long": 256},
        {"long": 32},  # b's load begins
        {"long": 32},
        {"long": 32},
        {"b": 14, "long": 242},  # ended: b admitted, the step whole again
    ]
    assert capped.stats.num_load_wait_deferred_tokens == 3 * (256 - 32)
    plain, plain_steps, plain_b = _a_load_beside_a_long_prompt(0)
    plain_sizes = [{s.req_id: len(s.token_ids) for s in so.requests} for so in plain_steps[:5]]
    assert plain_sizes == [{"long": 256}] * 3 + [{"long": 132}, {"long": 1, "b": 14}]
    assert plain.stats.num_load_wait_deferred_tokens == 0
    assert b.output_token_ids == plain_b.output_token_ids
    with pytest.raises(ValueError, match="load_wait_step_tokens"):
        SchedulerConfig(load_wait_step_tokens=-1)
