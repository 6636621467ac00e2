"""bench/latency_proxy.py: each request on a kept-alive connection waits the delay once, and
the bytes pass through unchanged."""

from __future__ import annotations

import http.client
import http.server
import threading
import time

from bench.latency_proxy import DelayProxy


class _Echo(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body[::-1])

    def log_message(self, *args: object) -> None:
        pass


def test_every_request_waits_the_delay_once() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    proxy = DelayProxy("127.0.0.1", server.server_address[1], delay_s=0.2)
    port = proxy.start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        body = bytes(range(256)) * 4096  # 1 MiB: many chunks, one delay
        for _ in range(2):  # the same connection: the second request waits again
            start = time.monotonic()
            conn.request("POST", "/", body=body)
            got = conn.getresponse().read()
            elapsed = time.monotonic() - start
            assert got == body[::-1]
            assert 0.2 <= elapsed < 1.0, elapsed
        conn.close()
    finally:
        proxy.stop()
        server.shutdown()
