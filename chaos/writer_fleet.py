"""The writer processes: started, killed with -9 and restarted by index, each life with keys
of its own, each process writing down its transactions in ``<logs>/writer-<i>.jsonl``."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

from outbox.chaos.fleet import ProcessFleet
from outbox.chaos.writers import Tally, read_journal


class WriterFleet(ProcessFleet):
    """``count`` writer processes at ``rate`` messages per second each; ``immediate``: they
    send their messages themselves right after commit (immediate send)."""

    def __init__(
        self,
        count: int,
        database_url: str,
        bootstrap: str,
        logs: Path,
        *,
        rate: float,
        seed: int,
        immediate: bool,
    ) -> None:
        super().__init__("writer", count, [], database_url, bootstrap, logs)
        self.rate = rate
        self.seed = seed
        self.immediate = immediate
        self.lives = [0] * count
        #: Process lives that ended between writing a transaction down and its outcome.
        self.ended_mid_transaction = 0

    def journal(self, index: int) -> Path:
        return self.logs / f"writer-{index}.jsonl"

    def command(self, index: int) -> list[str]:
        self.lives[index] += 1
        command = [
            sys.executable,
            "-m",
            "outbox.chaos.writer_process",
            "--index",
            str(index),
            "--name",
            f"p{index}.{self.lives[index]}",
            "--rate",
            str(self.rate),
            "--seed",
            str(self.seed),
            "--journal",
            str(self.journal(index)),
        ]
        return command + (["--immediate"] if self.immediate else [])

    def _after_stop(self, index: int) -> None:
        path = self.journal(index)
        lines = path.read_text(encoding="utf-8").split("\n") if path.exists() else []
        last = next((line for line in reversed(lines) if line.strip()), "")
        if last.startswith(('{"commit"', '{"rollback"')):
            self.ended_mid_transaction += 1

    def figures(self) -> dict[str, object]:
        """For the run's result: how many lives, how many ended inside a transaction."""
        return {
            "lives": sum(self.lives),
            "sent_immediately": len(self.sent_immediately()),
            "ended_mid_transaction": self.ended_mid_transaction,
            "immediate_send": self.immediate,
            "term_exit_codes": self.term_exits,
        }

    def sent_immediately(self) -> set[uuid.UUID]:
        """The messages the processes sent themselves (each process writes their ids)."""
        sent: set[uuid.UUID] = set()
        for index in range(self.count):
            path = self.journal(index).with_suffix(".sent")
            if path.exists():
                sent.update(uuid.UUID(line) for line in path.read_text().split())
        return sent

    def tallies(self) -> list[Tally]:
        """What each process wrote down, over all its lives."""
        tallies = []
        for index in range(self.count):
            path = self.journal(index)
            lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
            tallies.append(read_journal(lines))
        return tallies
