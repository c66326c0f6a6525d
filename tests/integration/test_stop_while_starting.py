"""A daemon stopped while it is still loading its libraries stops cleanly: exit status 0 and
one log line, not the 143 of a process killed by SIGTERM (which a supervisor reads as a
crash)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

pytestmark = pytest.mark.integration

DAEMONS = {
    "relay": ["relay"],
    "consume": ["consume", "no_such_module:inbox", "--group-id", "stop-while-starting"],
    "checkback": ["checkback", "no_such_module:registry"],
}


def stopped_while_importing(args: list[str], env: dict[str, str], sig: int) -> tuple[int, str]:
    """Start `outbox ARGS` and send ``sig`` while it imports SQLAlchemy, which the daemons
    load before they install their own handlers. The moment is seen, not guessed:
    ``-X importtime`` writes a line as each module finishes loading."""
    process = subprocess.Popen(
        [sys.executable, "-X", "importtime", "-m", "outbox.cli", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    importing = threading.Event()

    def read() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            lines.append(line)
            if "sqlalchemy" in line:
                importing.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert importing.wait(60), "the command never loaded SQLAlchemy"
        process.send_signal(sig)
        status = process.wait(60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    reader.join(10)
    assert process.stderr is not None
    process.stderr.close()
    log = "".join(line for line in lines if not line.startswith("import time:"))
    return status, log


@pytest.mark.parametrize("daemon", sorted(DAEMONS))
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_while_loading_is_a_clean_stop(outbox_url, bootstrap_servers, daemon, sig) -> None:  # type: ignore[no-untyped-def]
    env = {
        **os.environ,
        "OUTBOX_DATABASE_URL": outbox_url,
        "OUTBOX_KAFKA_BOOTSTRAP_SERVERS": bootstrap_servers,
    }
    started = time.monotonic()
    status, log = stopped_while_importing(DAEMONS[daemon], env, sig)
    assert status == 0, f"exit status {status}: {log}"
    name = signal.Signals(sig).name
    assert f"{name} received while starting up: stopped before start" in log
    assert "Traceback" not in log
    assert time.monotonic() - started < 60
