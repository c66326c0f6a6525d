"""Processes under test, started, killed and restarted by index: the relays, the consumers
and the writer processes.

Each process serves ``/metrics`` on a port of its own (a new one at each start: the last one
may have been taken while the process was down); that it answers tells that it has finished
starting.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from outbox.devstack.procs import free_port

Process = subprocess.Popen[bytes]


class ProcessFleet:
    """``count`` processes of one ``outbox`` command on ``database_url`` and the broker at
    ``bootstrap``; each writes its output to ``<logs>/<name>-<i>.log``."""

    def __init__(
        self,
        name: str,
        count: int,
        args: Sequence[str],
        database_url: str,
        bootstrap: str,
        logs: Path,
    ) -> None:
        self.name = name
        self.count = count
        self.args = list(args)
        self.env = {
            **os.environ,
            "OUTBOX_DATABASE_URL": database_url,
            "OUTBOX_KAFKA_BOOTSTRAP_SERVERS": bootstrap,
            "OUTBOX_LOG_LEVEL": "INFO",
        }
        self.logs = logs
        self.processes: list[Process | None] = [None] * count
        self.ports = [0] * count
        #: (index, exit code) of processes that ended without being told to.
        self.crashes: list[tuple[int, int]] = []
        #: Exit codes after SIGTERM (0 expected).
        self.term_exits: list[int] = []

    # -- starting ----------------------------------------------------------------------------

    def start(self, index: int) -> None:
        self.ports[index] = free_port()
        command = [*self.command(index), "--metrics-port", str(self.ports[index])]
        with (self.logs / f"{self.name}-{index}.log").open("ab") as log:
            self.processes[index] = subprocess.Popen(
                command,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    def command(self, index: int) -> list[str]:
        """The command that starts process ``index`` (without its metrics port)."""
        return [sys.executable, "-m", "outbox.cli", *self.args]

    def start_all(self) -> None:
        for index in range(self.count):
            self.start(index)

    def ensure_all_running(self) -> None:
        for index, process in enumerate(self.processes):
            if process is None:
                self.start(index)

    def wait_serving(self, index: int, timeout: float = 60.0) -> bool:
        """Wait until process ``index`` serves its metrics; False if it ended or took too long
        (an ended process is the next :meth:`check`'s)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self._running(index) is not None:
            if self.metrics(index) is not None:
                return True
            time.sleep(0.2)
        return False

    def metrics(self, index: int) -> str | None:
        """The Prometheus exposition of process ``index``, None when it does not answer."""
        if self._running(index) is None:
            return None
        url = f"http://127.0.0.1:{self.ports[index]}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return str(response.read().decode())
        except OSError:
            return None

    # -- stopping ----------------------------------------------------------------------------

    def kill(self, index: int) -> None:
        process = self._running(index)
        if process is not None:
            self._before_stop(index)
            process.kill()
            process.wait(30)
            self._after_stop(index)
        self.processes[index] = None

    def terminate(self, index: int, timeout: float = 60.0) -> int | None:
        """SIGTERM and wait; a process that does not stop in time is killed (and that counts)."""
        return self._reap(index, self._signal_stop(index), timeout)

    def stop_all(self, timeout: float = 60.0) -> list[int | None]:
        """SIGTERM to every process at once, then wait for each."""
        stopping = [self._signal_stop(index) for index in range(self.count)]
        return [self._reap(index, process, timeout) for index, process in enumerate(stopping)]

    def kill_all(self) -> None:
        for index in range(self.count):
            self.kill(index)

    def check(self) -> list[tuple[int, int]]:
        """Processes that exited on their own since the last check: restarted, and returned."""
        ended = []
        for index, process in enumerate(self.processes):
            if process is not None and process.poll() is not None:
                ended.append((index, process.returncode))
                self.crashes.append((index, process.returncode))
                self._after_stop(index)
                self.start(index)
        return ended

    # -- hooks for what a fleet keeps of its processes ---------------------------------------

    def _before_stop(self, index: int) -> None:
        """Called while process ``index`` still runs, just before it is told to stop."""

    def _after_stop(self, index: int) -> None:
        """Called once process ``index`` has ended, whatever ended it."""

    # -- helpers -----------------------------------------------------------------------------

    def _signal_stop(self, index: int) -> Process | None:
        process = self._running(index)
        if process is not None:
            self._before_stop(index)
            process.send_signal(signal.SIGTERM)
        self.processes[index] = None
        return process

    def _reap(self, index: int, process: Process | None, timeout: float) -> int | None:
        if process is None:
            return None
        try:
            code = process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(30)
            code = -signal.SIGKILL
        self.term_exits.append(code)
        self._after_stop(index)
        return code

    def _running(self, index: int) -> Process | None:
        process = self.processes[index]
        return process if process is not None and process.poll() is None else None
