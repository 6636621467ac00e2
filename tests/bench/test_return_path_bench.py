"""bench/return_path.py on a small run: every short request is timed at both points, and the
coroutine receives its first token after the output thread does."""

from __future__ import annotations

from bench.return_path import measure


def test_every_request_is_timed_at_both_hops() -> None:
    times = measure(streams=2, requests=5)
    assert len(times["to_output_thread_ms"]) == len(times["to_coroutine_ms"]) == 5
    for thread_ms, coroutine_ms in zip(
        times["to_output_thread_ms"], times["to_coroutine_ms"], strict=True
    ):
        assert 0 < thread_ms < coroutine_ms < 5_000
