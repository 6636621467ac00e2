"""What every benchmark reports about the machine it ran on, and small timing helpers.

``machine_info()`` never fails: a field it cannot learn is ``None``. torch is imported only if
it is installed (bench/tiers.py's Redis/S3 rows do not need it).
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Iterable
from typing import Any


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def machine_info() -> dict[str, Any]:
    """Platform, CPU model and count, Python/torch versions, CUDA device name if any."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
        "torch": None,
        "cuda_device": None,
    }
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["cuda_device"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def percentile(sorted_values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of an ascending list, nearest-rank; 0.0 when empty."""
    if not sorted_values:
        return 0.0
    rank = max(0, min(len(sorted_values) - 1, round(q / 100 * len(sorted_values)) - 1))
    return sorted_values[rank]


def cuda_graph_us(fn: Any, reps: int) -> float:
    """Microseconds of GPU time per replay of ``fn`` captured as one CUDA graph (after one eager
    warm-up call and one warm replay), over ``reps`` back-to-back replays. CUDA only."""
    import torch

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def cuda_missing(bench: str) -> str | None:
    """Why ``bench`` (a CUDA-only benchmark) cannot run here, as its one-line error; None when
    torch sees a CUDA device."""
    try:
        import torch
    except ImportError:
        return f"{bench}: needs torch with CUDA"
    return None if torch.cuda.is_available() else f"{bench}: needs CUDA"


def metric_sums(text: str, names: Iterable[str], where: str = "") -> dict[str, float]:
    """Per name, the sum of its samples in a Prometheus text page (0 where absent); with
    ``where``, only the sample lines that contain it (a label, e.g. ``tier="lmdb"``)."""
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        if line.startswith("#") or where not in line:
            continue
        head, _, value = line.rpartition(" ")
        name = head.split("{", 1)[0]
        if name in out:
            out[name] += float(value)
    return out


def emit_report(report: dict[str, Any], out: str | None) -> None:
    """Print a benchmark's JSON report, write it to ``out`` if given, then its one-line
    ``report["summary"]``."""
    import json

    text = json.dumps(report, indent=1)
    print(text)
    if out:
        with open(out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    print(report["summary"])


def random_weight_model(arch: Any, dtype: Any, device: Any, max_positions: int | None) -> Any:
    """kvtier's model for ``arch`` (``engine.models.ModelArchConfig``), built on the meta
    device and materialized on ``device`` in ``dtype`` with deterministic random weights
    (norm weights 1, the rest N(0, 0.02), one generator seeded 0), in eval mode: the
    benchmarks' stand-in for a checkpoint in the real shapes."""
    import torch

    from engine.models import get_model_class

    with torch.device("meta"):
        model = get_model_class(arch.architecture)(arch, max_positions)
    model = model.to(dtype=dtype).to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model.eval()
