"""A TCP proxy that adds a fixed delay to every request: a loopback server (moto, redis-server)
made to answer like one across a network, so that a benchmark shows a client's request pattern
(how many round trips deep a call is) and not only the server's CPU.

Each connection is forwarded both ways; the first bytes the client sends after the server last
answered on that connection (a new HTTP/1.1 request, or a body after ``100 Continue``) wait
``delay_s`` before they go on, once. Everything else passes at once, so throughput is the
server's. One asyncio loop on a daemon thread.

    proxy = DelayProxy("127.0.0.1", 9000, delay_s=0.02); port = proxy.start(); ...; proxy.stop()
"""

from __future__ import annotations

import asyncio
import threading

_CHUNK = 1 << 20


class DelayProxy:
    def __init__(self, host: str, port: int, delay_s: float) -> None:
        self.host, self.port, self.delay_s = host, port, delay_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.AbstractServer | None = None

    def start(self) -> int:
        """Starts listening on a free loopback port; returns it."""
        self._thread.start()
        server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", 0), self._loop
        ).result(10)
        self._server = server
        return int(server.sockets[0].getsockname()[1])

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    cleanup = stop  # as the servers of tests/servers.py are ended

    async def _serve(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        try:
            s_reader, s_writer = await asyncio.open_connection(self.host, self.port)
        except OSError:
            c_writer.close()
            return
        answered = [True]  # the server spoke last: the client's next bytes start a request

        async def upstream() -> None:
            while data := await c_reader.read(_CHUNK):
                if answered[0]:
                    answered[0] = False
                    await asyncio.sleep(self.delay_s)
                s_writer.write(data)
                await s_writer.drain()
            s_writer.close()

        async def downstream() -> None:
            while data := await s_reader.read(_CHUNK):
                answered[0] = True
                c_writer.write(data)
                await c_writer.drain()
            c_writer.close()

        await asyncio.gather(upstream(), downstream(), return_exceptions=True)
