"""A process-wide gate: background KV threads step aside while the engine launches a step.

Every torch call of a step's launches releases the GIL and takes it back. A Python thread of
the same process that is runnable meanwhile (sealing saved blocks, copying them down to a
lower tier, encoding them) takes the GIL at each such release and keeps it until it blocks
or the interpreter's switch interval (5 ms) forces it out: an eager forward of a few hundred
calls then waits several milliseconds at a time. On the H200 QA run with a small host tier
over LMDB, a fresh request's prefill steps spent 22 ms of their 98 ms of launches off the
CPU while other threads ran (request log ``forward_cpu``, ``others_cpu``).

The model runner ``hold``s the gate from a step's start until its forward is queued and
``release``s it before it waits for the GPU; background workers call ``wait_turn`` between
items of work (a block, a batch). A held gate delays them at most ``max_wait_s`` per call,
so a stuck or crashed engine never stops them. Holds nest (several runners in one process).
Never used by the load path: a load's reads are on some request's first token.
"""

from __future__ import annotations

import threading

MAX_WAIT_S = 0.02


class LaunchGate:
    """Thread-safe. ``hold``/``release`` from stepping threads, ``wait_turn`` from workers."""

    def __init__(self, max_wait_s: float = MAX_WAIT_S) -> None:
        self.max_wait_s = max_wait_s
        self._open = threading.Event()
        self._open.set()
        self._holds = 0
        self._lock = threading.Lock()

    def hold(self) -> None:
        with self._lock:
            self._holds += 1
            self._open.clear()

    def release(self) -> None:
        with self._lock:
            self._holds = max(self._holds - 1, 0)
            if self._holds == 0:
                self._open.set()

    @property
    def held(self) -> bool:
        return not self._open.is_set()

    def wait_turn(self) -> bool:
        """Return once the gate is open or ``max_wait_s`` passed; True when it was open."""
        if self._open.is_set():
            return True
        return self._open.wait(self.max_wait_s)


STEP_LAUNCHES = LaunchGate()  # the process's engine steps
