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
        assert others.busiest(1)[0][0] == "busy-one"
        assert threading.current_thread().name not in spent  # the reader's own thread is left out
    finally:
        stop.set()
        busy.join()
        idle.join()
    # Ended threads drop out of the list; reading again does not fail.
    assert "busy-one" not in others.by_thread()
