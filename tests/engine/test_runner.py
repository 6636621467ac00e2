"""ModelRunner against HF transformers (fp32, atol 1e-4) through hand-built SchedulerOutputs
with non-contiguous, out-of-order block tables: chunked prefill across block boundaries,
decode steps, a batch mixing a prefill chunk with decodes, prefix reuse, and block moves
through gather/scatter (what the offload connector does)."""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core_types import ScheduledRequest, SchedulerOutput
from engine.runner.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from tests.engine.hf_models import make_tiny_model

ATOL = 1e-4
GREEDY = SamplingParams(temperature=0.0)


class Ref:
    """An HF model plus a memo of full-sequence logits."""

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return self.model(torch.tensor([token_ids])).logits[0]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def setup(request, tmp_path_factory) -> tuple[str, Ref]:
    model_dir = make_tiny_model(tmp_path_factory.mktemp(request.param), request.param, seed=11)
    return model_dir, Ref(model_dir)


def make_runner(model_dir: str, num_blocks: int = 16, **kw) -> ModelRunner:
    return ModelRunner(
        EngineConfig(
            dtype="float32", device="cpu", cache=CacheConfig(num_gpu_blocks=num_blocks), **kw
        ),
        model_dir,
    )


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def req(
    rid: str,
    tokens: list[int],
    start: int,
    table: list[int],
    sample: bool = True,
    n_out: int = 0,
    sampling: SamplingParams = GREEDY,
) -> ScheduledRequest:
    return ScheduledRequest(rid, tokens, start, table, sample, sampling, n_out)


def step(runner: ModelRunner, *reqs: ScheduledRequest, finished: frozenset[str] = frozenset()):
    return runner.execute_model(
        SchedulerOutput(list(reqs), sum(len(r.token_ids) for r in reqs), finished),
        return_logits=True,
    )


def test_chunked_prefill_then_decodes_match_hf(setup) -> None:
    model_dir, ref = setup
    runner = make_runner(model_dir)
    toks = prompt(1, 45)
    table = [7, 3, 11, 0]  # 4 blocks for up to 64 tokens, deliberately shuffled
    chunks = [(0, 13), (13, 35), (35, 45)]  # chunk ends fall mid-block; chunk 2 spans blocks 0-2
    seq = list(toks)
    got: dict[int, torch.Tensor] = {}
    for a, b in chunks:
        out = step(runner, req("a", toks[a:b], a, table))
        got[b - 1] = out.logits["a"]
    seq.append(out.sampled_token_ids["a"])
    for n in range(1, 6):
        out = step(runner, req("a", [seq[-1]], len(seq) - 1, table, n_out=n))
        got[len(seq) - 1] = out.logits["a"]
        seq.append(out.sampled_token_ids["a"])
    full = ref.logits(seq)
    assert sorted(got) == [12, 34, 44, 45, 46, 47, 48, 49]
    for pos, row in got.items():
        torch.testing.assert_close(row, full[pos], atol=ATOL, rtol=0)
    # Greedy tokens are exactly HF's argmax at every generated position.
    assert seq[45:] == full[44:50].argmax(-1).tolist()


def test_mixed_prefill_chunk_and_decodes_in_one_batch(setup) -> None:
    model_dir, ref = setup
    runner = make_runner(model_dir)
    seqs = {"b": prompt(2, 20), "c": prompt(3, 16), "d": prompt(4, 30)}
    tables = {"b": [5, 1], "c": [12, 8], "d": [2, 13]}
    got: dict[str, dict[int, torch.Tensor]] = {k: {} for k in seqs}

    def record(out) -> None:
        for rid, tok in out.sampled_token_ids.items():
            got[rid][len(seqs[rid]) - 1] = out.logits[rid]
            seqs[rid].append(tok)

    d_prompt = list(seqs["d"])
    seqs["d"] = d_prompt[:18]
    record(step(runner, req("b", seqs["b"], 0, tables["b"]), req("c", seqs["c"], 0, tables["c"])))
    # b and c decode while d's first prefill chunk (no sample) runs in the same batch.
    out = step(
        runner,
        req("b", seqs["b"][-1:], 20, tables["b"], n_out=1),
        req("d", d_prompt[:18], 0, tables["d"], sample=False),
        req("c", seqs["c"][-1:], 16, tables["c"], n_out=1),
    )
    assert sorted(out.sampled_token_ids) == ["b", "c"]
    record(out)
    seqs["d"] = d_prompt
    record(
        step(
            runner,
            req("c", seqs["c"][-1:], 17, tables["c"], n_out=2),
            req("d", d_prompt[18:], 18, tables["d"]),
            req("b", seqs["b"][-1:], 21, tables["b"], n_out=2),
        )
    )
    for rid in seqs:
        full = ref.logits(seqs[rid])
        assert got[rid], rid
        for pos, row in got[rid].items():
            torch.testing.assert_close(row, full[pos], atol=ATOL, rtol=0)
    assert {k: sorted(v) for k, v in got.items()} == {
        "b": [19, 20, 21],
        "c": [15, 16, 17],
        "d": [29],
    }


def test_prefix_reuse_and_block_moves_through_gather_scatter(setup) -> None:
    model_dir, ref = setup
    runner = make_runner(model_dir)
    shared = prompt(5, 32)
    step(runner, req("p", shared + [9, 10], 0, [4, 6, 1]))
    # A new request reuses p's two full blocks (positions 0..31) and computes only its tail.
    tail = [77, 78, 79]
    out = step(runner, req("q", tail, 32, [4, 6, 9]), finished=frozenset({"p"}))
    torch.testing.assert_close(out.logits["q"], ref.logits(shared + tail)[-1], atol=ATOL, rtol=0)
    # Offload round trip: copy q's blocks out, wipe them, write them into other ids, continue.
    kv = runner.kv_cache
    saved = kv.gather_blocks([4, 6, 9])
    assert saved.shape == (
        3,
        runner.arch.num_layers,
        2,
        16,
        runner.arch.num_kv_heads,
        runner.arch.head_dim,
    )
    assert saved.is_contiguous() and saved[0].numel() * saved.element_size() == kv.bytes_per_block
    kv.scatter_blocks([4, 6, 9], torch.zeros_like(saved))
    kv.scatter_blocks([15, 0, 3], saved)
    nxt = out.sampled_token_ids["q"]
    out = step(runner, req("q", [nxt], 35, [15, 0, 3], n_out=1))
    torch.testing.assert_close(
        out.logits["q"], ref.logits(shared + tail + [nxt])[-1], atol=ATOL, rtol=0
    )


def test_layer_view_is_a_strided_view_of_one_block_major_tensor(tmp_path) -> None:
    runner = make_runner(make_tiny_model(tmp_path, "llama"), num_blocks=4)
    kv = runner.kv_cache
    assert kv.tensor.shape == (4, 2, 2, 16, 2, 16)
    view = kv.layer_view(1)
    assert view.shape == (4, 2, 16, 2, 16) and view.data_ptr() == kv.tensor[0, 1].data_ptr()
    view[2, 1, 5] = 3.0
    assert kv.tensor[2, 1, 1, 5].eq(3.0).all() and kv.tensor.sum().item() == 3.0 * 2 * 16
    with pytest.raises(ValueError, match="out of range"):
        kv.gather_blocks([4])
    with pytest.raises(ValueError, match="data shape"):
        kv.scatter_blocks([0, 1], torch.zeros(1, 2, 2, 16, 2, 16))


def test_runner_properties_and_cache_sizing(tmp_path) -> None:
    model_dir = make_tiny_model(tmp_path, "llama")
    cfg = EngineConfig(dtype="auto", device="cpu", cache=CacheConfig(cpu_kv_cache_bytes=100_000))
    runner = ModelRunner(cfg, model_dir)
    # 2 layers * 2 (k, v) * 16 slots * 2 kv heads * 16 head_dim * 4 bytes = 8192 bytes/block
    assert runner.kv_cache.bytes_per_block == 8192
    assert runner.num_gpu_blocks == 100_000 // 8192 == 12
    assert runner.max_model_len == 512 and runner.vocab_size == 512
    assert runner.eos_token_ids == (2,)
    assert runner.model_fingerprint.startswith("LlamaForCausalLM-")
    assert runner.attention_backend_name == "torch"
    short = ModelRunner(
        EngineConfig(
            device="cpu",
            scheduler=SchedulerConfig(max_model_len=40),
            cache=CacheConfig(num_gpu_blocks=4),
        ),
        model_dir,
    )
    assert short.max_model_len == 40
    with pytest.raises(ValueError, match="exceed max_model_len 40"):
        step(short, req("x", list(range(41)), 0, [0, 1, 2]))


def test_bad_scheduler_output_is_rejected_clearly(tmp_path) -> None:
    runner = make_runner(make_tiny_model(tmp_path, "qwen2"), num_blocks=4)
    with pytest.raises(ValueError, match="cannot hold 17 tokens"):
        step(runner, req("x", list(range(17)), 0, [0]))
    with pytest.raises(ValueError, match=r"block id outside \[0, 4\)"):
        step(runner, req("x", [1, 2], 0, [4]))
    with pytest.raises(ValueError, match="scheduled twice"):
        step(runner, req("x", [1], 0, [0]), req("x", [2], 1, [0]))
    with pytest.raises(ValueError, match="empty slice"):
        step(runner, req("x", [], 0, [0]))
    empty = runner.execute_model(SchedulerOutput([], 0), return_logits=False)
    assert empty.sampled_token_ids == {} and empty.logits is None


class RecordingConnector:
    """A connector worker that records the calls the runner makes, and what the cache held
    when the load was started (the load must come before this step's KV is written)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.calls: list[tuple[str, object]] = []

    def start_load_kv(self, metadata: object | None) -> None:
        self.calls.append(("start_load_kv", metadata))
        self.cache_sum_at_load = float(self.runner.kv_cache.tensor.abs().sum())

    def forward_queued(self) -> None:
        self.calls.append(("forward_queued", None))
        self.cache_sum_at_queued = float(self.runner.kv_cache.tensor.abs().sum())

    def wait_for_save(self) -> None:
        self.calls.append(("wait_for_save", None))

    def after_step(self, metadata: object | None) -> None:
        self.calls.append(("after_step", metadata))


def test_kv_connector_hooks_run_around_the_forward_pass(tmp_path) -> None:
    runner = make_runner(make_tiny_model(tmp_path, "llama"), num_blocks=4)
    conn = RecordingConnector(runner)
    runner.set_kv_connector(conn)
    meta = object()
    r = req("x", [5, 6, 7], 0, [1])
    out = runner.execute_model(SchedulerOutput([r], 3, kv_connector_metadata=meta))
    hooks = [
        ("start_load_kv", meta),
        ("forward_queued", None),
        ("wait_for_save", None),
        ("after_step", meta),
    ]
    assert conn.calls == hooks
    # loads are issued before this step's KV is written; held copies once the forward is queued
    assert conn.cache_sum_at_load == 0.0 and conn.cache_sum_at_queued > 0
    assert list(out.sampled_token_ids) == ["x"]
    conn.calls.clear()
    runner.execute_model(SchedulerOutput([], 0, kv_connector_metadata=meta))
    assert conn.calls == hooks
    runner.set_kv_connector(None)
    conn.calls.clear()
    runner.execute_model(SchedulerOutput([req("x", [8], 3, [1], n_out=1)], 1))
    assert conn.calls == []


def test_a_steps_inputs_go_up_before_the_connector_issues_copies(tmp_path, monkeypatch) -> None:
    """Host-to-device copies run in issue order whatever their stream (bench/copy_order.py),
    so an eager step's inputs and attention plan must be queued before ``start_load_kv``
    issues any KV copy, or the forward waits for loads it does not read."""
    runner = make_runner(make_tiny_model(tmp_path, "llama"), num_blocks=4)
    conn = RecordingConnector(runner)
    runner.set_kv_connector(conn)
    real_plan = runner.attn_backend.plan

    def plan(metadata):  # type: ignore[no-untyped-def]
        conn.calls.append(("plan", None))
        return real_plan(metadata)

    monkeypatch.setattr(runner.attn_backend, "plan", plan)
    meta = object()
    runner.execute_model(
        SchedulerOutput([req("x", [5, 6, 7], 0, [1])], 3, kv_connector_metadata=meta)
    )
    assert [name for name, _ in conn.calls][:3] == ["plan", "start_load_kv", "forward_queued"]
