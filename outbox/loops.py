"""What the library's daemon loops (the inbox consumer, the check-back runner) share: their
health, as the endpoints of :mod:`outbox.health_server` report it, and how they are stopped."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable

import sqlalchemy as sa

from outbox.database_errors import database_not_ready, first_line
from outbox.errors import ConfigError


class LoopHealth:
    """The health of a loop that works on the database: alive while it turns (a tick within
    ``stale_after`` seconds), ready while alive, the database answers and it is not stopping.
    A daemon adds its own conditions to :meth:`alive_problems` and :meth:`ready_problems`."""

    def __init__(self, stale_after: float = 60.0) -> None:
        self.stale_after = stale_after
        self.last_tick = time.monotonic()
        self.database_ok = False
        self.stopping = False

    def tick(self) -> None:
        self.last_tick = time.monotonic()

    def alive_problems(self) -> list[str]:
        return [] if time.monotonic() - self.last_tick < self.stale_after else ["stalled"]

    def ready_problems(self) -> list[str]:
        reasons = (
            ("stopping", self.stopping),
            ("not alive", not self.alive),
            ("database out of reach", not self.database_ok),
        )
        return [reason for reason, bad in reasons if bad]

    @property
    def alive(self) -> bool:
        return not self.alive_problems()

    @property
    def ready(self) -> bool:
        return not self.ready_problems()

    def not_alive_because(self) -> str:
        return ", ".join(self.alive_problems())

    def not_ready_because(self) -> str:
        return ", ".join(self.ready_problems())


class Stoppable:
    """``stop()`` and SIGTERM/SIGINT for a daemon whose loop watches ``_stop``."""

    health: LoopHealth
    _stop: threading.Event

    def stop(self) -> None:
        """Finish the work in hand and return from ``run()``."""
        self.health.stopping = True
        self._stop.set()

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop())

    def wait_for_database(
        self,
        problem: Callable[[], str | None],
        backoff: Callable[[int], float],
        log: logging.Logger,
    ) -> bool:
        """Wait while the database is out of reach, asking ``problem()`` again after each
        ``backoff(attempts)``; what waiting cannot fix (a wrong password, a missing database,
        or what ``problem()`` returns: a missing table, say) raises
        :class:`~outbox.errors.ConfigError` at once. False when stopped first."""
        attempt = 0
        while not self._stop.is_set():
            self.health.tick()
            try:
                found = problem()
            except (sa.exc.DBAPIError, OSError) as exc:
                if not database_not_ready(exc):  # a wrong password, a missing database
                    raise ConfigError(f"database error: {first_line(exc)}") from exc
                attempt += 1
                log.warning(
                    "database unavailable at start", extra={"error": str(exc).splitlines()[0]}
                )
                self._stop.wait(backoff(attempt))
                continue
            if found:
                raise ConfigError(found)
            self.health.database_ok = True
            return True
        return False
