"""Soak: ``kvtier serve`` with and without ``--kv-offload``, driven over HTTP by concurrent
streaming chat users whose histories grow to ``--max-context`` tokens (bench/chat_load.py),
for ``--duration-s`` each. The modes run side by side (one server each, same GPU) unless
``--sequential``.

Usage: python -m bench.soak --model DIR [--modes off,offload] [--duration-s 300] [--users 6]
       [--max-context 32768] [--num-gpu-blocks 4096] [--out FILE] [--log-dir DIR]

JSON per mode: requests, failures (and why), TTFT and inter-token latency p50/p90/p99, the
longest prompt served, /health samples by status, the server's exit code after SIGINT; a
one-line summary last. Exit status 0 only with no failure and /health 200 throughout.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import httpx

from bench.chat_load import ChatLoad, run_load, summarize
from bench.common import emit_report, machine_info

MODES = {"off": [], "offload": ["--kv-offload"]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_server(
    model: str,
    mode_flags: list[str],
    extra: list[str],
    log_path: str,
    env: dict[str, str] | None = None,
) -> tuple[subprocess.Popen[bytes], str]:
    """``kvtier serve`` on a free port (``env``: its environment, default this process's);
    the process and its base URL."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "engine.cli",
        "serve",
        "--model",
        model,
        "--port",
        str(port),
        "--served-model-name",
        "soak",
        "--log-level",
        "warning",
        *mode_flags,
        *extra,
    ]
    log = open(log_path, "wb")  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ if env is None else env
    )
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(
    proc: subprocess.Popen[bytes], base: str, log_path: str, timeout_s: float = 600
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited during start-up ({proc.returncode}); see {log_path}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError(f"server did not come up in {timeout_s} s; see {log_path}")


def stop_server(proc: subprocess.Popen[bytes], timeout_s: float = 60) -> int | None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return None
    return proc.returncode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--modes", default="off,offload")
    ap.add_argument("--duration-s", type=float, default=300)
    ap.add_argument("--users", type=int, default=6)
    ap.add_argument("--max-context", type=int, default=32768)
    ap.add_argument("--question-tokens", type=int, default=2500)
    ap.add_argument("--answer-len", type=int, default=64)
    ap.add_argument("--system-tokens", type=int, default=2000, help="shared system prompt")
    ap.add_argument("--user-system-tokens", type=int, default=1000)
    ap.add_argument("--num-gpu-blocks", type=int, default=4096)
    ap.add_argument(
        "--server-arg", action="append", default=[], help="extra kvtier serve flag (repeatable)"
    )
    ap.add_argument("--sequential", action="store_true")
    ap.add_argument("--log-dir", default=".")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    extra = [
        "--num-gpu-blocks",
        str(args.num_gpu_blocks),
        "--max-model-len",
        str(args.max_context + 1024),
        *args.server_arg,
    ]
    servers: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
    results: dict[str, Any] = {}

    def load_for(base: str) -> ChatLoad:
        return ChatLoad(
            base,
            "soak",
            args.users,
            args.duration_s,
            args.max_context,
            shared_system_tokens=args.system_tokens,
            user_system_tokens=args.user_system_tokens,
            question_tokens=args.question_tokens,
            answer_len=args.answer_len,
        )

    try:
        groups = [[m] for m in modes] if args.sequential else [modes]
        for group in groups:
            logs = {m: os.path.join(args.log_dir, f"soak_{m}.log") for m in group}
            for m in group:  # start side by side, then wait for each
                servers[m] = spawn_server(args.model, MODES[m], extra, logs[m])
            for m in group:
                wait_healthy(*servers[m], logs[m])
            print(f"soak: {', '.join(group)} up; driving for {args.duration_s:.0f} s", flush=True)

            async def drive(group: list[str] = group) -> list[dict[str, Any]]:
                return await asyncio.gather(*(run_load(load_for(servers[m][1])) for m in group))

            for m, res in zip(group, asyncio.run(drive()), strict=True):
                results[m] = summarize(res)
                alive = servers[m][0].poll() is None
                results[m]["server_alive_at_end"] = alive
                results[m]["server_exit"] = stop_server(servers[m][0])
    finally:
        for proc, _ in servers.values():
            stop_server(proc, 10)
    ok = all(
        r["failed"] == 0 and set(r["health"]) == {"200"} and r["server_alive_at_end"]
        for r in results.values()
    )
    report = {
        "machine": machine_info(),
        "duration_s": args.duration_s,
        "users": args.users,
        "max_context": args.max_context,
        "num_gpu_blocks": args.num_gpu_blocks,
        "side_by_side": not args.sequential,
        "modes": results,
        "summary": "soak: "
        + "; ".join(
            f"{m}: {r['requests']} requests, {r['failed']} failed, longest prompt {r['max_prompt_tokens']}, "
            f"TTFT p50/p99 {r['ttft_ms']['p50'] or 0:.0f}/{r['ttft_ms']['p99'] or 0:.0f} ms, "
            f"ITL p50 {r['itl_ms']['p50'] or 0:.1f} ms, health {r['health']}"
            for m, r in results.items()
        ),
    }
    emit_report(report, args.out)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
