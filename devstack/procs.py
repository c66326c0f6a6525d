"""Process and port helpers shared by the local stack's servers."""

from __future__ import annotations

import os
import pwd
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path


class StackError(RuntimeError):
    """A local stack server could not be prepared, started or stopped."""


#: Where :func:`free_port` looks first: below the usual start of the kernel's ephemeral range.
LISTEN_PORTS = range(20_000, 32_768)
_handed_out: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, for a server about to start.

    Chosen outside the kernel's ephemeral range when it can be: a port from that range may be
    taken, before the server binds it, as the local port of any outgoing connection (a
    client's, a proxy's), and the server then fails with "address already in use". A port is
    not handed out twice by one process."""
    low, _high = _ephemeral_range()
    candidates = [port for port in LISTEN_PORTS if port < low and port not in _handed_out]
    for port in random.sample(candidates, min(len(candidates), 50)):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    _handed_out.add(port)
    return port


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32_768, 60_999  # Linux's default


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie still answers kill(0); it is gone for our purposes.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_until(check: Callable[[], bool], timeout: float, what: str, interval: float = 0.2) -> None:
    """Poll ``check`` until it is true, or raise StackError naming ``what``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(interval)
    raise StackError(f"timed out after {timeout:.0f}s waiting for {what}")


def terminate(pid: int, grace: float = 30.0) -> None:
    """SIGTERM a process group, then SIGKILL it if it outlives ``grace`` seconds."""
    if not pid_alive(pid):
        return
    _signal_group(pid, signal.SIGTERM)
    try:
        wait_until(lambda: not pid_alive(pid), grace, f"process {pid} to exit")
    except StackError:
        _signal_group(pid, signal.SIGKILL)
        wait_until(lambda: not pid_alive(pid), 10, f"process {pid} to die")


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        return
    except PermissionError:
        os.kill(pid, sig)


def running_as_root() -> bool:
    return os.geteuid() == 0


def postgres_user_ids() -> tuple[int, int]:
    """uid and gid of the ``postgres`` account that Debian's package creates."""
    try:
        entry = pwd.getpwnam("postgres")
    except KeyError as exc:
        raise StackError(
            "running as root, but there is no 'postgres' user: install Debian's postgresql package"
        ) from exc
    return entry.pw_uid, entry.pw_gid


def run_as_postgres(argv: Sequence[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    """Run a PostgreSQL server tool; initdb and postgres refuse to run as root."""
    command = list(argv)
    if running_as_root():
        command = ["runuser", "-u", "postgres", "--", *command]
    return subprocess.run(command, check=False, capture_output=True, text=True, **kwargs)  # type: ignore[call-overload, no-any-return]


def apt_install(*packages: str) -> None:
    """Install Debian packages (as root; without root, say what to install)."""
    if not running_as_root():
        raise StackError(f"missing {', '.join(packages)}: install with apt-get as root")
    # policy-rc.d = 101 keeps a package's own service (PostgreSQL's cluster) from being started
    # by the install.
    policy = Path("/usr/sbin/policy-rc.d")
    added_policy = not policy.exists()
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        if added_policy:
            policy.write_text("#!/bin/sh\nexit 101\n")
            policy.chmod(0o755)
        subprocess.run(["apt-get", "update", "-q"], check=True, env=env, capture_output=True)
        subprocess.run(
            ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages],
            check=True,
            env=env,
            capture_output=True,
        )
    except subprocess.CalledProcessError as exc:
        raise StackError(f"apt-get install {' '.join(packages)} failed: {exc.stderr!r}") from exc
    finally:
        if added_policy:
            policy.unlink(missing_ok=True)
