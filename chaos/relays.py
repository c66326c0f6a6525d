"""The relays under test: ``outbox relay`` processes, started, killed and restarted by index."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from outbox.relay.config import EXACTLY_ONCE

# Short timings, so that faults turn into retries (not only into waits) and the run drains
# quickly; every other setting is the relay's default.
RELAY_ARGS = (
    "--poll-interval",
    "0.2",
    "--batch-size",
    "200",
    "--delivery-timeout-ms",
    "15000",
    "--lease-seconds",
    "30",
    "--backoff-max",
    "5",
)


class RelayFleet:
    """``count`` relays; each writes its output to ``<logs>/relay-<i>.log``."""

    def __init__(
        self,
        count: int,
        database_url: str,
        bootstrap: str,
        mode: str,
        logs: Path,
        run_id: str,
    ) -> None:
        self.count = count
        self.logs = logs
        self.args = [*RELAY_ARGS, "--mode", mode]
        if mode == EXACTLY_ONCE:
            self.args += [
                "--transactional-id-prefix",
                f"chaos-{run_id}",
                "--progress-topic",
                f"chaos-progress-{run_id}",
            ]
        self.env = {
            **os.environ,
            "OUTBOX_DATABASE_URL": database_url,
            "OUTBOX_KAFKA_BOOTSTRAP_SERVERS": bootstrap,
            "OUTBOX_LOG_LEVEL": "INFO",
        }
        self.processes: list[subprocess.Popen[bytes] | None] = [None] * count
        #: Exit codes of relays that ended without being told to.
        self.crashes: list[tuple[int, int]] = []
        #: Exit codes after SIGTERM (0 expected).
        self.term_exits: list[int] = []

    def start(self, index: int) -> None:
        with (self.logs / f"relay-{index}.log").open("ab") as log:
            self.processes[index] = subprocess.Popen(
                [sys.executable, "-m", "outbox.cli", "relay", *self.args],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    def start_all(self) -> None:
        for index in range(self.count):
            self.start(index)

    def kill(self, index: int) -> None:
        process = self._running(index)
        if process is not None:
            process.kill()
            process.wait(30)
        self.processes[index] = None

    def terminate(self, index: int, timeout: float = 60.0) -> int | None:
        """SIGTERM and wait; a relay that does not stop in time is killed (and that counts)."""
        process = self._running(index)
        self.processes[index] = None
        if process is None:
            return None
        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(30)
            code = -signal.SIGKILL
        self.term_exits.append(code)
        return code

    def check(self) -> list[tuple[int, int]]:
        """Relays that exited on their own since the last check: restarted, and returned."""
        ended = []
        for index, process in enumerate(self.processes):
            if process is not None and process.poll() is not None:
                ended.append((index, process.returncode))
                self.crashes.append((index, process.returncode))
                self.start(index)
        return ended

    def ensure_all_running(self) -> None:
        for index, process in enumerate(self.processes):
            if process is None:
                self.start(index)

    def stop_all(self) -> list[int | None]:
        return [self.terminate(index) for index in range(self.count)]

    def kill_all(self) -> None:
        for index in range(self.count):
            self.kill(index)

    def _running(self, index: int) -> subprocess.Popen[bytes] | None:
        process = self.processes[index]
        return process if process is not None and process.poll() is None else None
