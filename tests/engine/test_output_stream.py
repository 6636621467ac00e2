"""``OutputStream.put_all``: a step's outputs reach their coroutines with one wake-up of the
event loop, in order, and a closed loop drops them without raising."""

from __future__ import annotations

import asyncio
import threading

from engine.core.base import OutputStream
from engine.outputs import RequestOutput


def _output(req_id: str, n: int) -> RequestOutput:
    return RequestOutput(req_id=req_id, prompt_token_ids=[1], token_ids=[n], new_token_ids=[n])


def test_a_steps_outputs_take_one_wake_up_and_keep_their_order() -> None:
    async def run() -> tuple[int, list[list[object]]]:
        loop = asyncio.get_running_loop()
        streams = [OutputStream(loop), OutputStream(loop)]
        calls = 0
        wake = loop.call_soon_threadsafe

        def counted(*args: object) -> object:
            nonlocal calls
            calls += 1
            return wake(*args)  # type: ignore[arg-type]

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        items = [(streams[i % 2], _output(f"r{i % 2}", i)) for i in range(5)]
        error = RuntimeError("engine died")
        thread = threading.Thread(
            target=OutputStream.put_all, args=(items + [(streams[1], error)],)
        )
        thread.start()
        thread.join()
        got = [[], []]
        for k, stream in enumerate(streams):
            for _ in range(3):
                got[k].append(await asyncio.wait_for(stream.queue.get(), 5))
        return calls, got

    calls, got = asyncio.run(run())
    assert calls == 1
    assert [o.token_ids[0] for o in got[0]] == [0, 2, 4]
    assert [o.token_ids[0] for o in got[1][:2]] == [1, 3]
    assert isinstance(got[1][2], RuntimeError)


def test_a_closed_loop_drops_its_items() -> None:
    loop = asyncio.new_event_loop()
    stream = OutputStream(loop)
    loop.close()
    OutputStream.put_all([(stream, _output("r", 1))])  # no raise
    assert stream.queue.empty()
