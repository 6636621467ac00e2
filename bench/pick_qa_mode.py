"""Which QA mode a device call runs after ``bench.new_shapes`` (used by one-call GPU runs).

    python -m bench.pick_qa_mode NEW_SHAPES_JSON   -> prints onwarm | oneager | small

``onwarm`` when the GEMM warm-up takes out most of the new-count stalls (at most half the
default's, and no more than eager's), ``oneager`` when only eager module loading does, else
``small`` (neither helps: spend the time on issue 28's small-tier QA mode instead).
"""

from __future__ import annotations

import json
import sys


def pick(results: dict) -> str:
    def stalled(variant: str) -> float:
        r = results.get(variant, {})
        return float(r.get("new", {}).get("stalled", 1e9)) if "error" not in r else 1e9

    base, warm, eager = stalled("default"), stalled("warm"), stalled("eager")
    if base >= 1e9:
        return "onwarm"
    if warm <= base / 2 and warm <= eager:
        return "onwarm"
    if eager <= base / 2:
        return "oneager"
    return "small"


if __name__ == "__main__":
    try:
        with open(sys.argv[1]) as f:
            print(pick(json.load(f)))
    except (OSError, ValueError, IndexError):
        print("onwarm")
