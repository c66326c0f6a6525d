"""Calling checkers, each in a thread of its own and bounded by a timeout.

A checker calls the service's other systems (a database, a payment provider), and any of
them can hang. Python cannot kill a thread, so a checker that has not answered by the timeout
is left running on its own (a daemon thread) and its check counts as ``timeout``; the runner
goes on. Such threads are counted (:attr:`CheckCalls.hung`, per check group
:meth:`CheckCalls.hung_by_group`): the runner stops checking a group that has too many of them
(so that they cannot pile up), and its health turns bad, so that a supervisor restarts the
process.
"""

from __future__ import annotations

import asyncio
import inspect
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from outbox.prepared.answers import parse_answer
from outbox.prepared.checkers import CheckMessage

#: The recorded answers beside COMMIT, ROLLBACK and UNKNOWN: the checker raised (or answered
#: something else), or did not answer within the timeout. Both count as a check without a
#: verdict, as UNKNOWN does.
ERROR, TIMEOUT = "error", "timeout"


@dataclass(frozen=True)
class CheckOutcome:
    """One checker call: the answer (``commit``, ``rollback``, ``unknown``, ``error`` or
    ``timeout``), the error when there was one, and how long it took."""

    message: CheckMessage
    answer: str
    error: str | None
    seconds: float


class CheckCalls:
    """Runs a round of checks at once, one thread each, and waits ``timeout`` seconds at most
    for their answers. ``checker_for(group)`` gives the checker of a check group."""

    def __init__(self, checker_for: Callable[[str], Any], timeout: float) -> None:
        self.checker_for = checker_for
        self.timeout = timeout
        self._abandoned: list[tuple[str, threading.Thread]] = []

    @property
    def hung(self) -> int:
        """Checker calls that timed out and have not returned yet."""
        return sum(self.hung_by_group().values())

    def hung_by_group(self) -> dict[str, int]:
        """:attr:`hung`, per check group (groups with none are absent)."""
        self._abandoned = [(g, thread) for g, thread in self._abandoned if thread.is_alive()]
        counts: dict[str, int] = {}
        for group, _ in self._abandoned:
            counts[group] = counts.get(group, 0) + 1
        return counts

    def run(self, messages: Sequence[CheckMessage]) -> list[CheckOutcome]:
        """Ask the checker of each message, all at once; the outcomes in the same order."""
        answers: queue.Queue[tuple[int, str, str | None, float]] = queue.Queue()
        threads = [
            threading.Thread(
                target=self._call,
                args=(index, message, answers),
                name=f"checkback-{message.id}",
                daemon=True,  # a hung checker must not keep the process from exiting
            )
            for index, message in enumerate(messages)
        ]
        started = time.monotonic()
        got: dict[int, CheckOutcome] = {}
        for index, thread in enumerate(threads):
            try:
                thread.start()
            except Exception as exc:  # RuntimeError: can't start new thread
                failed = f"could not run the checker: {type(exc).__name__}: {exc}"
                got[index] = CheckOutcome(messages[index], ERROR, failed, 0.0)
        deadline = started + self.timeout
        while len(got) < len(messages):
            try:
                index, answer, error, seconds = answers.get(
                    timeout=max(0.0, deadline - time.monotonic())
                )
            except queue.Empty:
                break
            got[index] = CheckOutcome(messages[index], answer, error, seconds)
        for index, message in enumerate(messages):
            if index not in got:
                self._abandoned.append((message.group, threads[index]))
                got[index] = CheckOutcome(
                    message, TIMEOUT, f"no answer within {self.timeout:g}s", self.timeout
                )
        return [got[index] for index in range(len(messages))]

    def _call(
        self,
        index: int,
        message: CheckMessage,
        answers: queue.Queue[tuple[int, str, str | None, float]],
    ) -> None:
        started = time.perf_counter()
        try:
            raw = self.checker_for(message.group)(message)
            if inspect.iscoroutine(raw):
                raw = asyncio.run(raw)
            answer, error = parse_answer(raw, f"the checker of {message.group!r}").value, None
        except Exception as exc:
            answer, error = ERROR, f"{type(exc).__name__}: {exc}"
        answers.put((index, answer, error, time.perf_counter() - started))
