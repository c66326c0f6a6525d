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
import contextlib
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
    """Runs checks, one thread each, and waits ``timeout`` seconds at most for each answer.
    ``checker_for(group)`` gives the checker of a check group.

    Checks are started with :meth:`start` and their outcomes taken with :meth:`collect` as
    they come, so that a slow checker holds only its own slot: the runner starts the next
    messages' checks while it runs. :meth:`run` does both for one set of messages."""

    def __init__(self, checker_for: Callable[[str], Any], timeout: float) -> None:
        self.checker_for = checker_for
        self.timeout = timeout
        self._abandoned: list[tuple[str, threading.Thread]] = []
        self._answers: queue.Queue[tuple[int, str, str | None, float]] = queue.Queue()
        # Checks started and not collected yet: their message, thread and deadline.
        self._running: dict[int, tuple[CheckMessage, threading.Thread, float]] = {}
        self._next_key = 0

    @property
    def in_flight(self) -> int:
        """Checks started whose outcome was not collected yet."""
        return len(self._running)

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

    def start(self, messages: Sequence[CheckMessage]) -> list[CheckOutcome]:
        """Start a check of each message, each in a thread of its own; returns the outcomes
        of those that could not even start (an error check each)."""
        failed: list[CheckOutcome] = []
        for message in messages:
            key, self._next_key = self._next_key, self._next_key + 1
            thread = threading.Thread(
                target=self._call,
                args=(key, message),
                name=f"checkback-{message.id}",
                daemon=True,  # a hung checker must not keep the process from exiting
            )
            try:
                thread.start()
            except Exception as exc:  # RuntimeError: can't start new thread
                error = f"could not run the checker: {type(exc).__name__}: {exc}"
                failed.append(CheckOutcome(message, ERROR, error, 0.0))
                continue
            self._running[key] = (message, thread, time.monotonic() + self.timeout)
        return failed

    def collect(self, wait: float) -> list[CheckOutcome]:
        """The outcomes of the checks that answered or timed out: waits up to ``wait``
        seconds (no longer than the next check's deadline) for the first one when none is
        there yet, then takes all there are."""
        outcomes: list[CheckOutcome] = []
        if self._running:
            nearest = min(deadline for _, _, deadline in self._running.values())
            block = max(0.0, min(wait, nearest - time.monotonic()))
            with contextlib.suppress(queue.Empty):
                outcomes.extend(self._outcome(*self._answers.get(timeout=block)))
        while True:
            try:
                outcomes.extend(self._outcome(*self._answers.get_nowait()))
            except queue.Empty:
                break
        now = time.monotonic()
        for key, (message, thread, deadline) in list(self._running.items()):
            if deadline <= now:
                del self._running[key]
                self._abandoned.append((message.group, thread))
                outcomes.append(
                    CheckOutcome(
                        message, TIMEOUT, f"no answer within {self.timeout:g}s", self.timeout
                    )
                )
        return outcomes

    def run(self, messages: Sequence[CheckMessage]) -> list[CheckOutcome]:
        """Ask the checker of each message, all at once, and wait for every outcome (at
        most the timeout); the outcomes in the messages' order."""
        outcomes = self.start(messages)
        while self._running:
            outcomes += self.collect(self.timeout)
        order = {id(message): index for index, message in enumerate(messages)}
        return sorted(outcomes, key=lambda outcome: order[id(outcome.message)])

    def _outcome(
        self, key: int, answer: str, error: str | None, seconds: float
    ) -> list[CheckOutcome]:
        running = self._running.pop(key, None)
        if running is None:  # timed out already: its late answer is dropped
            return []
        return [CheckOutcome(running[0], answer, error, seconds)]

    def _call(self, key: int, message: CheckMessage) -> None:
        started = time.perf_counter()
        try:
            raw = self.checker_for(message.group)(message)
            if inspect.iscoroutine(raw):
                raw = asyncio.run(raw)
            answer, error = parse_answer(raw, f"the checker of {message.group!r}").value, None
        except Exception as exc:
            answer, error = ERROR, f"{type(exc).__name__}: {exc}"
        self._answers.put((key, answer, error, time.perf_counter() - started))
