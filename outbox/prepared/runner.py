"""The check-back loop: claim the prepared messages due a check, ask their checkers, record.

It runs inside the service that prepares the messages (``outbox checkback
myapp.checks:registry``, or :class:`CheckbackRunner` embedded), not in the relay: checkers
need the service's code and its credentials to the systems they look at (a second database,
a payment provider), which the relay's image and role should not carry. The relay needs no
change at all: it never sees a prepared row.

One round:

1. lease up to ``concurrency`` prepared rows whose check is due, of the groups this registry
   has checkers for (``FOR UPDATE SKIP LOCKED``, then a lease of ``lease_seconds``), so that
   several runners share the work and each message is checked by one runner at a time;
2. ask their checkers at once, each in a thread bounded by ``check_timeout``
   (:mod:`outbox.prepared.calls`): a hung checker costs its check, never the loop; a group
   with ``max_hung_checks`` calls hung is not claimed until they return (a message that
   cannot even be decoded costs its check as an error);
3. record every check (count, time, answer or error) and act on it, in one transaction:
   COMMIT makes the message pending, ROLLBACK rolls it back; UNKNOWN, an error or a timeout
   schedules the next check with backoff, and after ``max_checks`` of them the message ends
   rolled back or dead, as configured.

A runner that dies mid-round leaves its rows leased; once the lease runs out another runner
(or its restart) checks them again. A round recorded after the producer decided the message
changes nothing (only rows still prepared and still leased to the runner are touched).
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
import uuid
from typing import Any

import sqlalchemy as sa

from outbox import health_server
from outbox.errors import ConfigError
from outbox.loops import Stoppable
from outbox.prepared.calls import ERROR, TIMEOUT, CheckCalls, CheckOutcome
from outbox.prepared.checkers import CheckMessage, CheckRegistry
from outbox.prepared.config import CheckbackConfig
from outbox.prepared.metrics import CheckbackHealth, CheckbackMetrics
from outbox.prepared.store import CheckRecord, PreparedStore, Recorded, stored_text

log = logging.getLogger("outbox.checkback")

#: Seconds between tries while the database is out of reach: doubling up to this.
DATABASE_BACKOFF_MAX = 30.0

_DONE = {"commit": "committed", "rollback": "rolled back"}


class CheckbackRunner(Stoppable):
    """Runs the checkers of ``registry`` until :meth:`stop` (or SIGTERM with
    :meth:`install_signal_handlers`): :meth:`stop` finishes the round in hand and records it.

    Embed it in a service with a thread::

        runner = CheckbackRunner(registry, CheckbackConfig(database_url=url))
        threading.Thread(target=runner.run, daemon=True).start()
        ...
        runner.stop()  # finishes the round in hand, records it

    ``store`` and ``engine`` may be given (a stub store for tests without servers).
    """

    health: CheckbackHealth

    def __init__(
        self,
        registry: CheckRegistry,
        config: CheckbackConfig,
        *,
        metrics: CheckbackMetrics | None = None,
        store: PreparedStore | None = None,
        engine: sa.Engine | None = None,
    ) -> None:
        if not isinstance(registry, CheckRegistry):
            raise ConfigError(
                f"expected an outbox.prepared.CheckRegistry, got {type(registry).__name__}"
            )
        if not registry.groups:
            raise ConfigError("the registry has no checkers")
        self.registry = registry
        self.config = config
        self.metrics = metrics or CheckbackMetrics()
        self.store = store or PreparedStore(config.spec)
        self.owner = f"checkback-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.calls = CheckCalls(registry.checkers.__getitem__, config.check_timeout)
        # A round lasts up to the check timeout, between two ticks.
        self.health = CheckbackHealth(
            stale_after=max(60.0, 3 * config.check_timeout + 2 * DATABASE_BACKOFF_MAX),
            max_hung=config.max_hung_checks,
        )
        self.metrics_address: tuple[str, int] | None = None
        self._engine = engine
        self._stop = threading.Event()

    # -- the loop -----------------------------------------------------------------------------

    def run(self) -> int:
        """Check until stopped; returns the process exit code (0)."""
        engine = self._engine or sa.create_engine(self.config.database_url, pool_pre_ping=True)
        try:
            with health_server.serving(
                self.config.metrics_host,
                self.config.metrics_port,
                self.metrics.registry,
                self.health,
                "checkback-metrics",
            ) as server:
                if server is not None:
                    self.metrics_address = server.server_address[:2]  # type: ignore[assignment]
                if self.wait_for_database(lambda: self.store.problem(engine), _backoff, log):
                    log.info(
                        "check-back runner started",
                        extra={"owner": self.owner, "groups": self.registry.groups},
                    )
                    self._loop(engine)
        finally:
            self.health.stopping = True
            if self._engine is None:
                engine.dispose()
        log.info("check-back runner stopped", extra={"owner": self.owner})
        return 0

    def run_once(self, engine: sa.Engine) -> int:
        """One round: claim due rows, check them, record the checks. Returns how many rows
        were checked (0: none was due)."""
        groups = self._groups_to_check()
        if not groups:
            return 0
        rows = self.store.claim_due(
            engine,
            self.owner,
            groups,
            self.config.concurrency,
            self.config.lease_seconds,
        )
        if not rows:
            return 0
        messages: list[CheckMessage] = []
        unreadable: list[CheckOutcome] = []
        for row in rows:
            try:
                messages.append(self.registry.message(row))
            except Exception as exc:  # the deserializer's: an error check of this message
                error = f"could not decode the message: {type(exc).__name__}: {exc}"
                unreadable.append(
                    CheckOutcome(self.registry.message(row, decode=False), ERROR, error, 0.0)
                )
        outcomes = unreadable + self.calls.run(messages)
        records = [
            CheckRecord(
                outcome.message.id,
                outcome.answer,
                outcome.error,
                self.config.delay_after(outcome.message.checks + 1),
            )
            for outcome in outcomes
        ]
        recorded = self.store.record_checks(
            engine, self.owner, records, self.config.max_checks, self.config.end_status
        )
        self._observe(outcomes, recorded)
        return len(rows)

    def _groups_to_check(self) -> list[str]:
        """The groups whose messages are claimed this round: not those with
        ``max_hung_checks`` checker calls hung (their checker hangs: more calls would only
        pile up threads); those are counted as paused until their calls return."""
        hung = self.calls.hung_by_group()
        groups = []
        for group in self.registry.groups:
            paused = hung.get(group, 0) >= self.config.max_hung_checks
            self.metrics.paused.labels(group).set(1 if paused else 0)
            if paused:
                self.metrics.skipped.labels(group).inc()
            else:
                groups.append(group)
        return groups

    def _loop(self, engine: sa.Engine) -> None:
        next_count = time.monotonic()
        outage = 0
        while not self._stop.is_set():
            self._tick()
            try:
                if time.monotonic() >= next_count:
                    next_count = time.monotonic() + self.config.count_interval
                    self._count(engine)
                checked = self.run_once(engine)
            except (sa.exc.DBAPIError, OSError) as exc:
                self.health.database_ok = False
                outage += 1
                delay = _backoff(outage)
                log.warning(
                    "database unavailable: checking again later",
                    extra={"error": str(exc).splitlines()[0], "retry_in": round(delay, 2)},
                )
                self._stop.wait(delay)
                continue
            except Exception:  # a bug or a broken environment: log it, never die of it
                outage += 1
                log.exception("check-back round failed: trying again later")
                self._stop.wait(_backoff(outage))
                continue
            outage = 0
            self.health.database_ok = True
            if not checked:
                self._stop.wait(self.config.poll_interval)

    def _observe(self, outcomes: list[CheckOutcome], recorded: Recorded) -> None:
        m = self.metrics
        group_of = {outcome.message.id: outcome.message.group for outcome in outcomes}
        for outcome in outcomes:
            group = outcome.message.group
            m.checks.labels(group, outcome.answer).inc()
            if outcome.answer != TIMEOUT:
                m.check_seconds.labels(group).observe(outcome.seconds)
            if outcome.answer in (ERROR, TIMEOUT):
                log.warning(
                    f"checker {outcome.answer}: checking again later",
                    extra=_about(outcome, outcome.error),
                )
        for answer, ids in (("commit", recorded.committed), ("rollback", recorded.rolled_back)):
            for message_id in ids:
                m.resolved.labels(group_of[message_id], answer).inc()
                log.info(
                    f"prepared message {_DONE[answer]} by check-back", extra={"id": str(message_id)}
                )
        for message_id, status in recorded.expired:
            m.expired.labels(group_of[message_id], status).inc()
            log.warning(
                f"no verdict after {self.config.max_checks} checks: the message ends {status}",
                extra={"id": str(message_id)},
            )

    def _count(self, engine: sa.Engine) -> None:
        counts = self.store.counts(engine, self.registry.groups)
        for group in self.registry.groups:
            prepared, oldest = counts.get(group, (0, 0.0))
            self.metrics.prepared.labels(group).set(prepared)
            self.metrics.oldest.labels(group).set(oldest)

    def _tick(self) -> None:
        """The loop turned: liveness, and the checker calls still hung past their timeout."""
        self.health.tick()
        self.health.hung = self.calls.hung
        self.metrics.hung.set(self.health.hung)


def _about(outcome: CheckOutcome, error: str | None) -> dict[str, Any]:
    return {
        "id": str(outcome.message.id),
        "group": outcome.message.group,
        "error": stored_text(error),
    }


def _backoff(attempts: int) -> float:
    ceiling = min(DATABASE_BACKOFF_MAX, 0.5 * 2 ** (attempts - 1))
    return random.uniform(ceiling / 2, ceiling)
