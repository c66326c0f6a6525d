"""The fault-injecting proxy against a local echo server (no stack needed)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from outbox.chaos.proxy import FaultProxy
from outbox.devstack.procs import free_port


@pytest.fixture
def echo_port() -> Iterator[int]:
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn:
            try:
                while data := conn.recv(65536):
                    conn.sendall(data)
            except OSError:
                pass

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join(5)
    server.close()


@pytest.fixture
def proxy(echo_port: int) -> Iterator[FaultProxy]:
    proxy = FaultProxy(free_port(), echo_port)
    proxy.start()
    yield proxy
    proxy.close()


def connect(proxy: FaultProxy, timeout: float = 5.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", proxy.listen_port), timeout=timeout)
    sock.settimeout(timeout)
    return sock


def round_trip(sock: socket.socket, data: bytes = b"ping") -> bytes:
    sock.sendall(data)
    return sock.recv(1024)


def test_a_healthy_proxy_is_a_plain_pipe(proxy: FaultProxy) -> None:
    with connect(proxy) as sock:
        assert round_trip(sock, b"hello") == b"hello"
        assert proxy.open_connections == 2  # the client's and the upstream's


def test_latency_delays_each_direction(proxy: FaultProxy) -> None:
    with connect(proxy) as sock:
        proxy.set_latency(150)
        started = time.monotonic()
        assert round_trip(sock) == b"ping"
        assert time.monotonic() - started >= 0.3  # 150 ms there and 150 ms back
        proxy.heal()


def test_a_stall_holds_bytes_until_healed_without_closing(proxy: FaultProxy) -> None:
    with connect(proxy) as sock:
        proxy.stall()
        sock.sendall(b"held")
        sock.settimeout(0.5)
        with pytest.raises(TimeoutError):
            sock.recv(1024)
        proxy.heal()
        sock.settimeout(5)
        assert sock.recv(1024) == b"held"


def test_a_drop_resets_open_connections_and_refuses_new_ones_until_healed(
    proxy: FaultProxy,
) -> None:
    sock = connect(proxy)
    assert round_trip(sock) == b"ping"
    proxy.drop()
    with pytest.raises(OSError):
        round_trip(sock)  # reset by peer (or empty, then reset on the next send)
        round_trip(sock)
    sock.close()
    with pytest.raises(OSError), connect(proxy) as refused:
        round_trip(refused)
        round_trip(refused)
    proxy.heal()
    with connect(proxy) as again:
        assert round_trip(again) == b"ping"
