"""One engine of bench/peer_cpu.py in its own process: ``python -m bench.peer_cpu_worker
{kvtier|vllm} MODEL_DIR``.

Reads one JSON task per line on stdin, answers one ``RESULT_PREFIX`` + JSON line on stdout
(other stdout lines, e.g. vLLM's, are ignored by the parent). The first answer, sent when
the engine is loaded, describes it. Tasks:

- ``{"task": "prefill", "prompt": [ids]}`` -> ``value``: seconds of ``generate`` with
  ``max_tokens=1``; kvtier's also ``split``: ms of its steps, of the compute inside them
  (forward, logits, sampling), of the rest of ``generate``, and the page faults, voluntary and
  involuntary context switches of the call (``resource.getrusage``), read after the clock stops;
- ``{"task": "decode", "prompts": [[ids], ...], "new_tokens": N}`` -> ``value``: ms per
  decode step, (t(N + 1 tokens) - t(1 token)) / N, and the ``token_ids`` generated.

Imports only the standard library at module level: it runs under vLLM's interpreter too.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

RESULT_PREFIX = "@@peer_cpu@@ "
# Generate: (prompts, max_tokens) -> the generated token ids of each prompt.
Generate = Callable[[list[list[int]], int], list[list[int]]]


def _answer(obj: dict[str, Any]) -> None:
    sys.stdout.write(RESULT_PREFIX + json.dumps(obj) + "\n")
    sys.stdout.flush()


class _StepTimer:
    """Times kvtier's ``LLMEngine.step`` and the compute inside it (model forward, logits,
    sampling) by wrapping those callables on the instances; ``host`` = step - compute."""

    def __init__(self, engine: Any) -> None:
        self.steps: list[float] = []
        self.compute: list[float] = []
        self._in_step = 0.0
        runner = engine.runner
        engine.step = self._wrap(engine.step)
        for owner, name in (
            (runner.model, "forward"),
            (runner.model, "compute_logits"),
            (runner.sampler, "sample"),
        ):
            setattr(owner, name, self._wrap_inner(getattr(owner, name)))

    def _wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*a: Any, **k: Any) -> Any:
            self._in_step = 0.0
            start = time.perf_counter()
            out = fn(*a, **k)
            self.steps.append(time.perf_counter() - start)
            self.compute.append(self._in_step)
            return out

        return timed

    def _wrap_inner(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*a: Any, **k: Any) -> Any:
            start = time.perf_counter()
            out = fn(*a, **k)
            self._in_step += time.perf_counter() - start
            return out

        return timed

    def totals(self) -> dict[str, float]:
        """Sums (ms) over the steps since the last call; then forgets them."""
        steps, compute = sum(self.steps), sum(self.compute)
        self.steps, self.compute = [], []
        return {"steps_ms": 1e3 * steps, "compute_ms": 1e3 * compute}

    def take(self) -> dict[str, float]:
        """Medians (ms) over the steps since the last call; then forgets them."""
        steps, compute = self.steps, self.compute
        self.steps, self.compute = [], []
        host = [s - c for s, c in zip(steps, compute, strict=True)]
        return {
            "step_ms": 1e3 * statistics.median(steps),
            "compute_ms": 1e3 * statistics.median(compute),
            "host_ms": 1e3 * statistics.median(host),
        }


def _kvtier(model_dir: str) -> tuple[Generate, dict[str, Any], _StepTimer]:
    import torch

    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    llm = LLM(
        model_dir,
        device="cpu",
        dtype="float32",
        enable_prefix_caching=False,
        max_num_seqs=8,
        max_num_batched_tokens=2048,
        max_model_len=2048,
    )

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return [list(o.token_ids) for o in llm.generate(prompts, params)]

    info = {
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "affinity": sorted(os.sched_getaffinity(0)),
        "cpu_threads": dataclasses.asdict(llm.engine.runner.cpu_threads),
        "packed_linears": llm.engine.runner.num_packed_linears,
    }
    return generate, info, _StepTimer(llm.engine)


def _vllm(model_dir: str) -> tuple[Generate, dict[str, Any], None]:
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model_dir,
        dtype="float32",
        max_model_len=2048,
        max_num_seqs=8,
        max_num_batched_tokens=2048,
        enable_prefix_caching=False,
        seed=0,
        # On CPU this is the share of host memory vLLM requires free at start-up (its KV space
        # is VLLM_CPU_KVCACHE_SPACE); the default 0.92 refuses to start beside anything else.
        gpu_memory_utilization=0.5,
    )

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    return generate, {"vllm": vllm.__version__, "torch": torch.__version__}, None


def _prefill_split(
    wall: float, steps: dict[str, float], before: resource.struct_rusage
) -> dict[str, float]:
    """Where a kvtier prefill's wall time went: the engine's steps (of which the compute),
    ``generate`` outside its steps, and what the process waited on (faults, switches)."""
    after = resource.getrusage(resource.RUSAGE_SELF)
    return {
        **steps,
        "outside_steps_ms": 1e3 * wall - steps["steps_ms"],
        "minor_faults": after.ru_minflt - before.ru_minflt,
        "major_faults": after.ru_majflt - before.ru_majflt,
        "voluntary_switches": after.ru_nvcsw - before.ru_nvcsw,
        "involuntary_switches": after.ru_nivcsw - before.ru_nivcsw,
        "system_s": after.ru_stime - before.ru_stime,
    }


def main() -> int:
    name, model_dir = sys.argv[1], sys.argv[2]
    start = time.perf_counter()
    generate, info, timer = (_kvtier if name == "kvtier" else _vllm)(model_dir)
    _answer({"engine": name, "load_s": round(time.perf_counter() - start, 1), **info})
    for line in sys.stdin:
        task = json.loads(line)
        if task["task"] == "prefill":
            if timer is not None:
                timer.totals()
            before = resource.getrusage(resource.RUSAGE_SELF)
            start = time.perf_counter()
            generate([task["prompt"]], 1)
            wall = time.perf_counter() - start
            answer: dict[str, Any] = {"value": wall}
            if timer is not None:
                answer["split"] = _prefill_split(wall, timer.totals(), before)
            _answer(answer)
            continue
        prompts, n = task["prompts"], task["new_tokens"]
        start = time.perf_counter()
        generate(prompts, 1)
        t_one = time.perf_counter() - start
        if timer is not None:
            timer.take()
        start = time.perf_counter()
        token_ids = generate(prompts, n + 1)
        t_all = time.perf_counter() - start
        result: dict[str, Any] = {"value": 1e3 * (t_all - t_one) / n, "token_ids": token_ids}
        if timer is not None:
            stats = timer.take()  # the decode run's steps (its first is the prefill)
            if len(prompts) == 1:
                result["host"] = stats
        _answer(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
