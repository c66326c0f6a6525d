"""Serving the dashboard: the standard library's WSGI server, one thread per request.

An operator's page gets a handful of requests a minute: the standard library's server is
enough, and one less dependency. It binds to loopback unless told otherwise
(:func:`check_bind`).
"""

from __future__ import annotations

import logging
import socket
import threading
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from outbox.dashboard.web import is_loopback
from outbox.errors import ConfigError

log = logging.getLogger("outbox.dashboard")


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    # An address in use fails at once instead of sharing a port another process holds.
    allow_reuse_address = False


class _Handler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)


class _IPv6Server(_ThreadingServer):
    address_family = socket.AF_INET6


def check_bind(host: str, allow_remote: bool) -> str | None:
    """Refuse a non-loopback ``host`` unless ``allow_remote``; returns the warning to print
    when it is allowed (None for loopback)."""
    if is_loopback(host):
        return None
    if not allow_remote:
        raise ConfigError(
            f"--host {host} is not a loopback address: the dashboard shows message values; "
            "pass --allow-remote to listen on it (behind TLS and a proxy that authenticates)"
        )
    return (
        f"warning: the dashboard listens on {host}: whoever reaches it reads message values "
        "and errors (and, with the token, acts); put it behind TLS and an authenticating proxy"
    )


def serve(app: Any, host: str, port: int) -> WSGIServer:
    """A server for ``app`` bound to ``host``:``port`` (0: a free port); call
    ``serve_forever()`` on it (or :func:`serve_in_thread`) and ``shutdown()`` to stop."""
    server_class = _IPv6Server if ":" in host else _ThreadingServer
    return make_server(host, port, app, server_class=server_class, handler_class=_Handler)


def serve_in_thread(app: Any, host: str, port: int) -> WSGIServer:
    """:func:`serve`, answering on a daemon thread of its own."""
    server = serve(app, host, port)
    threading.Thread(target=server.serve_forever, name="outbox-dashboard", daemon=True).start()
    return server
