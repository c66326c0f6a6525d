"""The HTTP endpoints a daemon (the relay, an inbox consumer, a check-back runner) serves:
/metrics for Prometheus, /healthz (liveness) and /readyz (readiness)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST


class Health(Protocol):
    @property
    def alive(self) -> bool: ...

    @property
    def ready(self) -> bool: ...

    def not_ready_because(self) -> str: ...

    def not_alive_because(self) -> str:
        """One line for /healthz when not alive (``stalled``, say)."""
        ...


def serve(
    host: str, port: int, registry: CollectorRegistry, health: Health, name: str
) -> ThreadingHTTPServer:
    """Serve the endpoints on a daemon thread called ``name``; ``shutdown()`` stops it."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/metrics":
                self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
            elif self.path == "/healthz":
                if health.alive:
                    self._send(200, b"ok\n")
                else:
                    self._send(503, f"{health.not_alive_because()}\n".encode())
            elif self.path == "/readyz":
                if health.ready:
                    self._send(200, b"ready\n")
                else:
                    self._send(503, f"not ready: {health.not_ready_because()}\n".encode())
            else:
                self._send(404, b"not found\n")

        def _send(self, status: int, body: bytes, content_type: str = "text/plain") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            return  # scrapes are not worth a log line each

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, name=name, daemon=True).start()
    return server


@contextmanager
def serving(
    host: str, port: int | None, registry: CollectorRegistry, health: Health, name: str
) -> Iterator[ThreadingHTTPServer | None]:
    """:func:`serve` for the length of the block, then shut down; no server when ``port`` is
    None."""
    if port is None:
        yield None
        return
    server = serve(host, port, registry, health, name)
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
