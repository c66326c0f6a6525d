"""A loopback TCP proxy that can add latency, reset connections or stall them on command.

The relays and the consumers reach the broker only through it, so network faults hit exactly
their paths to the broker. It runs its own asyncio loop in a thread; the control methods are
called from any thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

CHUNK = 64 * 1024


class FaultProxy:
    """Forwards ``127.0.0.1:listen_port`` to ``upstream_port``; healthy until told otherwise."""

    def __init__(self, listen_port: int, upstream_port: int, host: str = "127.0.0.1") -> None:
        self.host = host
        self.listen_port = listen_port
        self.upstream_port = upstream_port
        # Made in start(): a proxy that never starts holds no event loop.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.StreamWriter] = set()
        self._flowing = asyncio.Event()
        self._latency = 0.0
        self._refusing = False
        self.accepted = 0

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy")
        self._thread.start()
        self._call(self._start())

    def close(self) -> None:
        if self._loop is None or self._thread is None:
            return
        self._call(self._close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
        self._loop = self._thread = None

    # -- faults ----------------------------------------------------------------------------

    def set_latency(self, milliseconds: int) -> None:
        """Hold every chunk this long before forwarding it (both directions)."""
        self._call(self._set(latency=milliseconds / 1000))

    def stall(self) -> None:
        """Stop moving bytes; connections stay open and new ones are accepted."""
        self._call(self._set(flowing=False))

    def drop(self) -> None:
        """Reset every open connection and refuse new ones until :meth:`heal`."""
        self._call(self._set(refusing=True))
        self._call(self._reset_all())

    def retarget(self, upstream_port: int) -> None:
        """Forward new connections to ``upstream_port`` and reset the open ones, as a
        virtual IP (or a proxy that checks which server is the primary) moves to a promoted
        standby."""
        self.upstream_port = upstream_port
        self._call(self._reset_all())

    def heal(self) -> None:
        """Back to a plain pipe."""
        self._call(self._set(latency=0.0, flowing=True, refusing=False))

    @property
    def open_connections(self) -> int:
        return len(self._connections)

    # -- the loop side -----------------------------------------------------------------------

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._loop is None:
            coro.close()
            raise RuntimeError("the proxy is not running: call start() first")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(30)

    async def _start(self) -> None:
        self._flowing.set()
        self._server = await asyncio.start_server(
            self._serve, self.host, self.listen_port, reuse_address=True
        )

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        self._flowing.set()  # stalled pipes must see their sockets closed
        await self._reset_all()
        # Reset connections end their pipes; wait for that rather than cancel (a cancelled
        # stream handler is reported as an error by asyncio).
        others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        if others:
            await asyncio.wait(others, timeout=5)

    async def _set(
        self,
        latency: float | None = None,
        flowing: bool | None = None,
        refusing: bool | None = None,
    ) -> None:
        if latency is not None:
            self._latency = latency
        if flowing is True:
            self._flowing.set()
        elif flowing is False:
            self._flowing.clear()
        if refusing is not None:
            self._refusing = refusing

    async def _reset_all(self) -> None:
        for writer in list(self._connections):
            _reset(writer)
        self._connections.clear()

    async def _serve(
        self, client_reader: asyncio.StreamReader, client: asyncio.StreamWriter
    ) -> None:
        if self._refusing:
            _reset(client)
            return
        try:
            upstream_reader, upstream = await asyncio.open_connection(self.host, self.upstream_port)
        except OSError:
            _reset(client)  # the broker is down: the client sees a refused connection
            return
        self.accepted += 1
        self._connections.update((client, upstream))
        try:
            await asyncio.gather(
                self._pipe(client_reader, upstream), self._pipe(upstream_reader, client)
            )
        finally:
            for writer in (client, upstream):
                self._connections.discard(writer)
                _reset(writer)

    async def _pipe(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        """Copy ``source`` to ``sink``; each chunk leaves ``latency`` after it arrived (so
        latency delays, it does not throttle), and nothing leaves while stalled."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue(maxsize=64)

        async def read() -> None:
            try:
                while data := await source.read(CHUNK):
                    await queue.put((loop.time() + self._latency, data))
            except (ConnectionError, OSError):
                pass
            await queue.put(None)  # end of stream (a cancel skips it: nobody is listening)

        reading = asyncio.create_task(read())
        try:
            while (item := await queue.get()) is not None:
                due, data = item
                await self._flowing.wait()
                if (delay := due - loop.time()) > 0:
                    await asyncio.sleep(delay)
                if sink.is_closing():
                    return
                sink.write(data)
                await sink.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            reading.cancel()
            _reset(sink)  # one side gone: Kafka does not half-close, so end both


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset, as a dropped connection looks to the peer."""
    sock = writer.get_extra_info("socket")
    if sock is not None and not writer.is_closing():
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
