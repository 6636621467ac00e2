"""OtherThreadsCpu: the CPU clocks of the other Python threads, as the model runner reads them."""

from __future__ import annotations

import threading
import time

from engine.runner.thread_cpu import OtherThreadsCpu


def _spin(stop: threading.Event, seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end and not stop.is_set():
        sum(range(1000))
    stop.wait()


def test_a_busy_thread_is_counted_and_named_and_an_idle_one_is_not() -> None:
    others = OtherThreadsCpu()
    stop = threading.Event()
    busy = threading.Thread(target=_spin, args=(stop, 0.2), name="busy-one")
    idle = threading.Thread(target=stop.wait, name="idle-one")
    before = others.total()
    busy.start()
    idle.start()
    try:
        deadline = time.monotonic() + 30
        while others.by_thread().get("busy-one", 0.0) < 0.2 and time.monotonic() < deadline:
            time.sleep(0.01)
        spent = others.by_thread()
        assert spent["busy-one"] >= 0.2  # its CPU time, not the wall time it lived
        assert spent["idle-one"] < 0.05
        assert others.total() - before >= 0.2
        # Ranked by CPU so far; threads earlier tests left in this process (a kernel's worker
        # pool) may rank above both, so only the order of these two is asserted.
        ranked = [name for name, _ in others.busiest(threading.active_count())]
        assert ranked.index("busy-one") < ranked.index("idle-one")
        assert threading.current_thread().name not in spent  # the reader's own thread is left out
    finally:
        stop.set()
        busy.join()
        idle.join()
    # Ended threads drop out of the list; reading again does not fail.
    assert "busy-one" not in others.by_thread()


def test_a_step_holds_the_launch_gate_only_until_its_forward_is_queued(tmp_path) -> None:
    """The model runner holds ``STEP_LAUNCHES`` while it launches (a background KV worker
    calling ``wait_turn`` then waits) and leaves it open after every step."""
    from cachestore.launch_gate import STEP_LAUNCHES
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    from tests.engine.hf_models import make_tiny_model

    llm = LLM(make_tiny_model(tmp_path, "llama"), device="cpu", num_gpu_blocks=32)
    runner = llm.engine.runner
    seen: list[bool] = []
    forward = runner._forward

    def watched(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(STEP_LAUNCHES.held)
        return forward(*args, **kwargs)

    runner._forward = watched
    try:
        out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, temperature=0.0))
        assert len(out[0].token_ids) == 3
        assert seen and all(seen)  # held during every step's launches
        assert not STEP_LAUNCHES.held  # and open between steps and after the last
    finally:
        llm.engine.close()
