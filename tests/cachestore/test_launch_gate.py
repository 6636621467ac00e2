"""LaunchGate: background KV work waits while a step launches, never longer than its bound."""

from __future__ import annotations

import threading
import time

from cachestore.launch_gate import LaunchGate


def test_an_open_gate_passes_at_once_and_a_held_one_waits_its_bound() -> None:
    gate = LaunchGate(max_wait_s=0.2)
    assert gate.wait_turn() is True and not gate.held
    gate.hold()
    t0 = time.monotonic()
    assert gate.wait_turn() is False  # held throughout: gave up after its bound
    assert 0.15 <= time.monotonic() - t0 < 5.0
    gate.release()
    assert gate.wait_turn() is True


def test_a_waiting_worker_goes_on_when_the_step_releases_and_holds_nest() -> None:
    gate = LaunchGate(max_wait_s=30.0)
    gate.hold()
    gate.hold()  # a second stepping thread (several runners in one process)
    passed = threading.Event()
    worker = threading.Thread(target=lambda: gate.wait_turn() and passed.set())
    worker.start()
    try:
        assert not passed.wait(0.2)
        gate.release()  # one hold is left: still waiting
        assert not passed.wait(0.2) and gate.held
        gate.release()
        assert passed.wait(10.0)
        gate.release()  # an extra release never underflows into a closed gate
        assert not gate.held
        gate.hold()
        assert gate.held
        gate.release()
        assert not gate.held
    finally:
        gate.release()
        worker.join(10.0)
