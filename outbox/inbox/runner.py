"""The consumer loop: read a batch, apply it in one transaction, then commit the offsets.

Offsets reach Kafka only after the database committed, so a crash anywhere replays records
whose effects either committed (the inbox row makes the replay a duplicate) or did not (the
replay applies them). In order, per partition:

1. resume partitions whose retry backoff is over;
2. ``consume`` up to ``batch_size`` records (``max_wait`` to fill the batch);
3. apply them (:mod:`outbox.inbox.apply`); a database outage keeps the batch in hand and
   tries again with backoff, so nothing is skipped;
4. for a partition held back by a failing record: seek back to it and pause the partition
   until its backoff is over;
5. commit the offsets, asynchronously (:mod:`outbox.inbox.offsets`): a commit lost or
   refused is sent again with the next one (offsets are cumulative); the inbox rows catch
   what a lost commit replays.

Rebalance callbacks run inside ``consume``, between batches, so nothing is half-applied when
partitions are revoked: their offsets are committed there, synchronously (sent again while
the group is between generations), and their retry state is dropped; the next owner starts
where this one stopped. A partition that moved while a batch was being applied (a consumer
that overran ``max.poll.interval.ms``) may be read by its new owner at the same time; the
inbox row's primary key makes one transaction wait for the other and then skip.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import sqlalchemy as sa
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from outbox import health_server
from outbox.errors import ConfigError
from outbox.inbox.api import Inbox, RawRecord
from outbox.inbox.apply import DatabaseUnavailable, Failure, prepare
from outbox.inbox.config import ConsumerConfig
from outbox.inbox.metrics import InboxHealth, InboxMetrics
from outbox.inbox.offsets import Offsets
from outbox.inbox.sessions import AsyncApplier, SyncApplier
from outbox.inbox.store import InboxStore
from outbox.loops import Stoppable

log = logging.getLogger("outbox.inbox")

TP = tuple[str, int]

_BROKER_DOWN = {KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN}
#: Seconds a stopping consumer waits for Kafka to take its last offsets and its leaving.
LEAVE_TIMEOUT = 15.0
#: Of those, the seconds its last offsets may take (a group between generations refuses
#: them for a moment); the rest is for leaving the group.
LAST_COMMIT_TIMEOUT = 10.0


class InboxRunner(Stoppable):
    """Runs an :class:`~outbox.inbox.Inbox` until :meth:`stop` (or SIGTERM with
    :meth:`install_signal_handlers`): :meth:`stop` finishes the batch in hand, commits its
    offsets and leaves the group.

    Embed it in a service with a thread::

        runner = InboxRunner(inbox, ConsumerConfig(database_url=url, kafka={...}))
        threading.Thread(target=runner.run).start()
        ...
        runner.stop()  # finishes the batch in hand, commits, leaves the group
    """

    health: InboxHealth

    def __init__(
        self, inbox: Inbox, config: ConsumerConfig, *, metrics: InboxMetrics | None = None
    ) -> None:
        if not isinstance(inbox, Inbox):
            raise ConfigError(f"expected an outbox.inbox.Inbox, got {type(inbox).__name__}")
        if not inbox.topics:
            raise ConfigError("the inbox has no handlers")
        self.inbox = inbox
        self.config = config
        self.metrics = metrics or InboxMetrics()
        # Alive while the loop turns; a wait for the database turns it once per backoff.
        self.health = InboxHealth(stale_after=max(60.0, 2 * config.backoff_max))
        self.store = InboxStore(config.spec)
        self.metrics_address: tuple[str, int] | None = None
        self._stop = threading.Event()
        self.offsets = Offsets(self.health)
        self._failures: dict[TP, Failure] = {}  # the record each held-back partition retries
        self._waiting: dict[TP, float] = {}  # paused partitions and when they resume
        self._assigned: set[TP] = set()

    # -- the loop -----------------------------------------------------------------------------

    def run(self) -> int:
        """Consume until stopped; returns the process exit code (0)."""
        with health_server.serving(
            self.config.metrics_host,
            self.config.metrics_port,
            self.metrics.registry,
            self.health,
            "inbox-metrics",
        ) as server:
            if server is not None:
                self.metrics_address = server.server_address[:2]  # type: ignore[assignment]
            self._run()
        log.info("inbox consumer stopped", extra={"group": self.inbox.group})
        return 0

    def _run(self) -> None:
        engine = sa.create_engine(self.config.database_url, pool_pre_ping=True)
        applier: SyncApplier | AsyncApplier | None = None
        consumer: Consumer | None = None
        try:
            if not self.wait_for_database(lambda: self._tables_problem(engine), self._backoff, log):
                return
            if self.inbox.is_async:
                applier = AsyncApplier(
                    self.config.database_url,
                    self.inbox,
                    self.store,
                    self.metrics,
                    self.config.max_attempts,
                )
            else:
                applier = SyncApplier(
                    engine, self.inbox, self.store, self.metrics, self.config.max_attempts
                )
            consumer = Consumer(self._kafka_settings())
            consumer.subscribe(
                self.inbox.topics,
                on_assign=self._on_assign,
                on_revoke=self._on_revoke,
                on_lost=self._on_lost,
            )
            self._loop(consumer, applier, engine)
        finally:
            self.health.stopping = True
            if consumer is not None:
                self._leave(consumer)
            if isinstance(applier, AsyncApplier):
                applier.close()
            engine.dispose()

    def _leave(self, consumer: Consumer) -> None:
        """Commit what is applied and leave the group, for at most LEAVE_TIMEOUT seconds.

        The commit comes first, while this consumer is still a full member: a group in the
        middle of a rebalance takes it once it has its new generation, and a leaving member
        takes no part in that. Both wait for the group's coordinator; with it out of reach
        (a broker down) they would block a SIGTERM for minutes. Given up, the offsets not
        committed only make the next owner read records again, which the inbox skips.
        """

        def leave() -> None:
            self.offsets.commit_now(consumer, timeout=LAST_COMMIT_TIMEOUT)
            consumer.close()  # revokes (committing nothing new) and leaves the group

        leaving = threading.Thread(target=leave, name="inbox-leave", daemon=True)
        leaving.start()
        leaving.join(LEAVE_TIMEOUT)
        if leaving.is_alive():
            log.warning(
                "Kafka did not answer within %.0fs while leaving the group: stopping anyway; "
                "records applied since the last offset commit will be read again and skipped",
                LEAVE_TIMEOUT,
            )

    def _loop(self, consumer: Consumer, applier: Any, engine: sa.Engine) -> None:
        next_requeue = time.monotonic()
        next_purge = time.monotonic()
        next_lag = time.monotonic()
        while not self._stop.is_set():
            self.health.tick()
            now = time.monotonic()
            self._resume_due(consumer, now)
            if now >= next_requeue:
                next_requeue = now + self.config.requeue_interval
                self._apply_requeued(applier)
            if self.config.retention is not None and now >= next_purge:
                next_purge = now + self.config.purge_interval
                self._purge(engine, self.config.retention)
            records = consumer.consume(self.config.batch_size, self.config.max_wait)
            batch = []
            for record in records:
                error = record.error()
                if error is None:
                    batch.append(record)
                elif error.code() in _BROKER_DOWN:
                    self.health.kafka_ok = False
                else:
                    log.warning("Kafka error", extra={"error": str(error)})
            if batch:  # (records from the local queue say nothing about the broker)
                self._apply(consumer, applier, batch)
            self.offsets.commit_async(consumer)
            if now >= next_lag:
                next_lag = now + 2.0
                self._update_lag(consumer)

    def _apply(self, consumer: Consumer, applier: Any, records: Sequence[Any]) -> None:
        items = []
        for record in records:
            tp = (record.topic(), record.partition())
            if tp in self._waiting:
                continue  # fetched before the partition was paused; read again after the seek
            raw = RawRecord(
                tp[0],
                tp[1],
                record.offset(),
                record.key(),
                record.value(),
                tuple(record.headers() or ()),
            )
            item = prepare(self.inbox, raw)
            failure = self._failures.get(tp)
            if failure is not None and failure.offset == raw.offset:
                item.failures = failure.attempts
            items.append(item)
        if not items:
            return
        outage = 0
        while True:
            started = time.perf_counter()
            try:
                result = applier.apply(items)
                break
            except DatabaseUnavailable as exc:
                self.health.database_ok = False
                outage += 1
                delay = self._backoff(outage)
                log.warning(
                    "database unavailable: batch kept, trying again",
                    extra={"error": str(exc), "retry_in": round(delay, 2)},
                )
                self.health.tick()
                if self._stop.wait(delay):
                    return  # stopping: nothing of this batch committed; it will be read again
        self.health.database_ok = True
        self.metrics.batch_seconds.observe(time.perf_counter() - started)
        self.offsets.applied(result.next_offsets)
        for tp, next_offset in result.next_offsets.items():
            failure = self._failures.get(tp)
            if failure is not None and next_offset > failure.offset:
                del self._failures[tp]
        for tp, failure in result.blocked.items():
            self._failures[tp] = failure
            partition = TopicPartition(tp[0], tp[1], failure.offset)
            consumer.pause([partition])
            consumer.seek(partition)
            self._waiting[tp] = time.monotonic() + self._backoff(failure.attempts)

    def _resume_due(self, consumer: Consumer, now: float) -> None:
        due = [tp for tp, when in self._waiting.items() if when <= now]
        if due:
            consumer.resume([TopicPartition(t, p) for t, p in due])
            for tp in due:
                del self._waiting[tp]

    # -- rebalances ---------------------------------------------------------------------------

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self.health.kafka_ok = True
        for p in partitions:
            tp = (p.topic, p.partition)
            self._assigned.add(tp)
            self._failures.pop(tp, None)
            self._waiting.pop(tp, None)
        self.metrics.assigned.set(len(self._assigned))
        log.info("partitions assigned", extra={"partitions": sorted(self._assigned)})

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        revoked = {(p.topic, p.partition) for p in partitions}
        self.offsets.commit_now(consumer, only=revoked)  # committed before others read
        self._forget(revoked)

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Lost, not revoked: another member may own them already; do not commit for them.
        self._forget({(p.topic, p.partition) for p in partitions})

    def _forget(self, partitions: set[TP]) -> None:
        self.offsets.forget(partitions)
        for tp in partitions:
            self._failures.pop(tp, None)
            self._waiting.pop(tp, None)
            self._assigned.discard(tp)
            with contextlib.suppress(KeyError):  # no lag reported for it yet
                self.metrics.lag.remove(tp[0], str(tp[1]))
        self.metrics.assigned.set(len(self._assigned))

    # -- housekeeping -------------------------------------------------------------------------

    def _update_lag(self, consumer: Consumer) -> None:
        if not self._assigned:
            return
        try:
            positions = consumer.position([TopicPartition(t, p) for t, p in self._assigned])
            for position in positions:
                _, high = consumer.get_watermark_offsets(position, cached=True)
                if position.offset >= 0 and high >= 0:
                    lag = max(high - position.offset, 0)
                    self.metrics.lag.labels(position.topic, str(position.partition)).set(lag)
        except KafkaException:
            pass  # a metric, not worth failing a loop over

    def _apply_requeued(self, applier: Any) -> None:
        try:
            applier.apply_requeued()
        except DatabaseUnavailable as exc:
            log.warning("could not look for requeued messages", extra={"error": str(exc)})

    def _purge(self, engine: sa.Engine, retention: timedelta) -> None:
        try:
            deleted = self.store.purge_processed(engine, retention)
        except sa.exc.SQLAlchemyError as exc:
            log.warning("inbox purge failed", extra={"error": str(exc).splitlines()[0]})
            return
        if deleted:
            log.info("inbox rows purged", extra={"deleted": deleted})

    def _tables_problem(self, engine: sa.Engine) -> str | None:
        with engine.connect() as conn:
            return self.store.check(conn)

    def _backoff(self, attempts: int) -> float:
        ceiling = min(self.config.backoff_max, self.config.backoff_base * 2 ** (attempts - 1))
        return random.uniform(ceiling / 2, ceiling)

    def _kafka_settings(self) -> dict[str, Any]:
        settings: dict[str, Any] = {
            "auto.offset.reset": "earliest",
            # Assignment changes hand over partitions one by one; only what moves pauses.
            "partition.assignment.strategy": "cooperative-sticky",
            **self.config.kafka,
            "group.id": self.inbox.group,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "isolation.level": "read_committed",
        }
        settings.setdefault("error_cb", self._kafka_error)
        settings["on_commit"] = self.offsets.on_commit
        return settings

    def _kafka_error(self, error: KafkaError) -> None:
        if error.code() in _BROKER_DOWN:
            self.health.kafka_ok = False
        log.warning(f"Kafka client error: {error}")
