"""The check-back loop: claim the prepared messages due a check, ask their checkers, record.

It runs inside the service that prepares the messages (``outbox checkback
myapp.checks:registry``, or :class:`CheckbackRunner` embedded), not in the relay: checkers
need the service's code and its credentials to the systems they look at (a second database,
a payment provider), which the relay's image and role should not carry. The relay needs no
change at all: it never sees a prepared row.

The loop, turn by turn (a check slot is freed as soon as its checker answers, so a slow
checker never holds back the checks of the messages behind it):

1. lease as many prepared rows whose check is due as there are free check slots (of
   ``concurrency``), of the groups this registry has checkers for (``FOR UPDATE SKIP
   LOCKED``, then a lease of ``lease_seconds``), so that several runners share the work and
   each message is checked by one runner at a time;
2. start their checkers, each in a thread bounded by ``check_timeout``
   (:mod:`outbox.prepared.calls`): a hung checker costs its check, never the loop; a group
   with ``max_hung_checks`` calls hung is not claimed until they return (a message that
   cannot even be decoded costs its check as an error);
3. record the checks that answered (or timed out) since the last turn, and act on them, in
   one transaction: COMMIT makes the message pending, ROLLBACK rolls it back; UNKNOWN, an
   error or a timeout schedules the next check with backoff, and after ``max_checks`` of
   them the message ends dead for an operator. With ``on_max_checks="rollback"`` the last
   check is asked to decide (``CheckMessage.final``): its ROLLBACK, which blocked the step,
   rolls the message back (``expired``); anything else leaves it dead all the same.

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
    :meth:`install_signal_handlers`): :meth:`stop` lets the checks in hand answer and records them.

    Embed it in a service with a thread::

        runner = CheckbackRunner(registry, CheckbackConfig(database_url=url))
        threading.Thread(target=runner.run, daemon=True).start()
        ...
        runner.stop()  # the checks in hand answer, and are recorded

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
        # A turn lasts up to the poll interval, the stopping one up to the check timeout.
        self.health = CheckbackHealth(
            stale_after=max(60.0, 3 * config.check_timeout + 2 * DATABASE_BACKOFF_MAX),
            max_hung=config.max_hung_checks,
            database_outage_limit=config.database_outage_limit,
        )
        self.metrics_address: tuple[str, int] | None = None
        self._engine = engine
        self._stop = threading.Event()
        # Error checks of claimed rows that never reached a checker, to record next.
        self._unreadable: list[CheckOutcome] = []

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
        """One round in full: claim due rows, check them, record every check (waiting for
        the slowest, at most the check timeout). Returns how many rows were claimed (0: none
        was due). The loop does not wait so: see :meth:`_turn`."""
        claimed = self._start_checks(engine)
        while self.calls.in_flight:
            self._record(engine, self.calls.collect(self.config.check_timeout))
        return claimed

    def _turn(self, engine: sa.Engine) -> bool:
        """One turn of the loop: claim due rows for the free check slots and start their
        checks, then record the checks that answered (waiting up to ``poll_interval`` for
        the first while some are running). A slow checker holds only its own slot. Returns
        whether anything was claimed or recorded."""
        claimed = self._start_checks(engine)
        wait = 0.0 if claimed else self.config.poll_interval
        outcomes = self.calls.collect(wait)
        self._record(engine, outcomes)
        return bool(claimed or outcomes)

    def _start_checks(self, engine: sa.Engine) -> int:
        """Claim up to the free check slots' worth of due rows and start their checks (a
        row that cannot be decoded is an error check at once). Returns how many."""
        free = self.config.concurrency - self.calls.in_flight
        groups = self._groups_to_check() if free > 0 else []
        if not groups:
            return 0
        rows = self.store.claim_due(
            engine,
            self.owner,
            groups,
            free,
            self.config.lease_seconds,
        )
        if not rows:
            return 0
        messages: list[CheckMessage] = []
        for row in rows:
            final = self.config.final_check(row["check_count"])
            try:
                messages.append(self.registry.message(row, final=final))
            except Exception as exc:  # the deserializer's: an error check of this message
                error = f"could not decode the message: {type(exc).__name__}: {exc}"
                self._unreadable.append(
                    CheckOutcome(
                        self.registry.message(row, decode=False, final=final), ERROR, error, 0.0
                    )
                )
        self._unreadable += self.calls.start(messages)
        return len(rows)

    def _record(self, engine: sa.Engine, outcomes: list[CheckOutcome]) -> None:
        """Record checks and act on their answers (with the error checks of rows that could
        not be decoded or checked)."""
        outcomes, self._unreadable = self._unreadable + outcomes, []
        if not outcomes:
            return
        records = [
            CheckRecord(
                outcome.message.id,
                outcome.answer,
                outcome.error,
                self.config.delay_after(outcome.message.checks + 1),
                outcome.message.final,
            )
            for outcome in outcomes
        ]
        recorded = self.store.record_checks(engine, self.owner, records, self.config.max_checks)
        self._observe(outcomes, recorded)

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
                busy = self._turn(engine)
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
            if not busy and not self.calls.in_flight:
                self._stop.wait(self.config.poll_interval)
        self._finish(engine)

    def _finish(self, engine: sa.Engine) -> None:
        """Stopping: wait for the checks in hand (at most the check timeout) and record them;
        what cannot be recorded is checked again once its lease runs out."""
        try:
            while self.calls.in_flight:
                self._record(engine, self.calls.collect(self.config.check_timeout))
            self._record(engine, [])
        except (sa.exc.DBAPIError, OSError) as exc:
            log.warning(
                "could not record the last checks: they are made again after their lease",
                extra={"error": str(exc).splitlines()[0]},
            )

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
