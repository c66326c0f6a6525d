"""The consumer loop: read a batch, apply it in one transaction, then commit the offsets.

Offsets reach Kafka only after the database committed, so a crash anywhere replays records
whose effects either committed (the inbox row makes the replay a duplicate) or did not (the
replay applies them). Two threads: the runner's own talks to Kafka (every Kafka call and
callback happens there), a database thread applies one batch at a time, so that the next
batch is read and decoded while the current one's transaction runs. In order, per turn:

1. resume partitions whose retry backoff is over;
2. ``consume`` up to ``batch_size`` records (``max_wait`` to fill the batch) and decode them;
3. wait for the batch in hand (its transaction), and take in its result: offsets to commit,
   and for a partition held back by a failing record, a seek back to it and a pause until
   its backoff is over (the records read ahead for that partition are dropped);
4. hand the new batch to the database thread (:mod:`outbox.inbox.apply`); a database outage
   keeps it there and tries again with backoff, so nothing is skipped;
5. commit the offsets, asynchronously (:mod:`outbox.inbox.offsets`): a commit lost or
   refused is sent again with the next one; the inbox rows catch what it replays.

Rebalance callbacks run inside ``consume``, on the runner's thread. When partitions are
revoked the batch in hand is finished first, then their offsets are committed synchronously
(sent again while the group is between generations), then what was read ahead for them is
dropped: the next owner starts where this one stopped. A partition that moved while a batch
was being applied (a consumer that overran ``max.poll.interval.ms``) may be read by its new
owner at the same time; the inbox row's primary key makes one transaction wait for the other
and then skip.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import sqlalchemy as sa
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from outbox import health_server
from outbox.errors import ConfigError
from outbox.inbox.api import Inbox, RawRecord
from outbox.inbox.apply import BatchResult, DatabaseUnavailable, Failure, Item, prepare
from outbox.inbox.config import ConsumerConfig
from outbox.inbox.metrics import InboxHealth, InboxMetrics
from outbox.inbox.offsets import Offsets
from outbox.inbox.sessions import AsyncApplier, BatchApplier, SyncApplier
from outbox.inbox.store import InboxStore
from outbox.loops import Stoppable

log = logging.getLogger("outbox.inbox")

TP = tuple[str, int]

_BROKER_DOWN = {KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN}
#: How often a consumer asks Kafka again whether a missing topic exists now, and how long
#: the question may take (seconds).
TOPIC_RECHECK_INTERVAL = 15.0
TOPIC_CHECK_TIMEOUT = 2.0
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

    ``store``, ``engine``, ``applier`` and ``consumer_factory`` (called with the Kafka
    settings, ``confluent_kafka.Consumer`` by default) may be given: stand-ins for tests of
    the loop without servers.
    """

    health: InboxHealth

    def __init__(
        self,
        inbox: Inbox,
        config: ConsumerConfig,
        *,
        metrics: InboxMetrics | None = None,
        store: InboxStore | None = None,
        engine: sa.Engine | None = None,
        applier: BatchApplier | None = None,
        consumer_factory: Callable[[dict[str, Any]], Consumer] = Consumer,
    ) -> None:
        if not isinstance(inbox, Inbox):
            raise ConfigError(f"expected an outbox.inbox.Inbox, got {type(inbox).__name__}")
        if not inbox.topics:
            raise ConfigError("the inbox has no handlers")
        if inbox.dead_letters is not None:
            inbox.dead_letters.check_topics(inbox.topics)
        self.inbox = inbox
        self.config = config
        self.metrics = metrics or InboxMetrics()
        # Alive while the loop turns; a wait for the database turns it once per backoff.
        self.health = InboxHealth(
            stale_after=max(60.0, 2 * config.backoff_max),
            database_outage_limit=config.database_outage_limit,
        )
        self.store = store or InboxStore(config.spec)
        self._engine = engine
        self._given_applier = applier
        self._consumer_factory = consumer_factory
        self.metrics_address: tuple[str, int] | None = None
        self.offsets = Offsets(self.health)
        self._stop = threading.Event()
        self._failures: dict[TP, Failure] = {}  # the record each held-back partition retries
        self._waiting: dict[TP, float] = {}  # paused partitions and when they resume
        self._assigned: set[TP] = set()
        self._database: ThreadPoolExecutor | None = None  # the thread that applies batches
        self._applier: BatchApplier | None = None
        self._in_hand: Future[BatchResult | None] | None = None  # the batch being applied

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
        engine = self._engine or sa.create_engine(self.config.database_url, pool_pre_ping=True)
        self._database = ThreadPoolExecutor(1, thread_name_prefix="inbox-database")
        consumer: Consumer | None = None
        try:
            if not self.wait_for_database(lambda: self.store.problem(engine), self._backoff, log):
                return
            if self.inbox.dead_letters is not None:
                with engine.connect() as conn:
                    self.inbox.dead_letters.check_table(conn)
            # Made on the database thread: an async applier's event loop lives there.
            self._applier = (
                self._given_applier or self._database.submit(self._make_applier, engine).result()
            )
            consumer = self._consumer_factory(self._kafka_settings())
            consumer.subscribe(
                self.inbox.topics,
                on_assign=self._on_assign,
                on_revoke=self._on_revoke,
                on_lost=self._on_lost,
            )
            self.health.subscribed = True
            self._loop(consumer, engine)
        finally:
            self.health.stopping = True
            if consumer is not None:
                self._settle(consumer)
                self._leave(consumer)
            if self._applier is not None:
                self._database.submit(self._applier.close).result()
            self._database.shutdown()
            if self._engine is None:
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

    def _make_applier(self, engine: sa.Engine) -> SyncApplier | AsyncApplier:
        args = (self.inbox, self.store, self.metrics, self.config.max_attempts)
        if self.inbox.is_async:
            return AsyncApplier(self.config.database_url, *args)
        return SyncApplier(engine, *args)

    def _loop(self, consumer: Consumer, engine: sa.Engine) -> None:
        assert self._database is not None
        next_requeue = time.monotonic()
        next_purge = time.monotonic()
        next_lag = time.monotonic()
        next_topic_check = time.monotonic() + TOPIC_RECHECK_INTERVAL
        while not self._stop.is_set():
            self.health.tick()
            now = time.monotonic()
            self._resume_due(consumer, now)
            if now >= next_requeue:
                next_requeue = now + self.config.requeue_interval
                self._database.submit(self._apply_requeued).result()  # after the batch in hand
            if self.config.retention is not None and now >= next_purge:
                next_purge = now + self.config.purge_interval
                self._purge(engine, self.config.retention)
            records = consumer.consume(self.config.batch_size, self.config.max_wait)
            items = self._prepare(records)  # while the batch in hand is being applied
            self._settle(consumer)
            items = self._still_wanted(items)
            # Stopping: nothing new goes to the database. The batch in hand may have been
            # given up (the database out of reach); these records come after it, and
            # applying them would commit offsets past records never applied.
            if items and not self._stop.is_set():
                self._in_hand = self._database.submit(self._apply, items)
            self.offsets.commit_async(consumer)
            if now >= next_lag:
                next_lag = now + 2.0
                self._update_lag(consumer)
            if self.health.missing_topics and now >= next_topic_check:
                next_topic_check = now + TOPIC_RECHECK_INTERVAL
                self._recheck_missing_topics(consumer)

    def _prepare(self, records: Sequence[Any]) -> list[Item]:
        items = []
        for record in records:
            error = record.error()
            if error is not None:
                if error.code() in _BROKER_DOWN:
                    self.health.kafka_ok = False
                elif error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART and record.topic():
                    self._topic_missing(record.topic())
                else:
                    log.warning("Kafka error", extra={"error": str(error)})
                continue
            raw = RawRecord(
                record.topic(),
                record.partition(),
                record.offset(),
                record.key(),
                record.value(),
                tuple(record.headers() or ()),
            )
            items.append(prepare(self.inbox, raw))
        return items

    def _still_wanted(self, items: list[Item]) -> list[Item]:
        """The items to apply now: not of a partition paused for a retry (read before it was
        sought back; read again after the seek) or no longer assigned."""
        wanted = []
        for item in items:
            tp = item.tp
            if tp in self._waiting or tp not in self._assigned:
                continue
            failure = self._failures.get(tp)
            if failure is not None and failure.offset == item.record.offset:
                item.failures = failure.attempts
            wanted.append(item)
        return wanted

    def _apply(self, items: Sequence[Item]) -> BatchResult | None:
        """On the database thread: apply one batch; while the database is out of reach, keep
        it and try again with backoff. None when stopped meanwhile (nothing of it
        committed: it is read again)."""
        assert self._applier is not None
        outage = 0
        while True:
            started = time.perf_counter()
            try:
                result = self._applier.apply(items)
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
                    return None
                continue
            self.health.database_ok = True
            self.metrics.batch_seconds.observe(time.perf_counter() - started)
            return result

    def _settle(self, consumer: Consumer, leaving: Collection[TP] = ()) -> None:
        """Wait for the batch in hand and take in its result: the offsets to commit, and the
        partitions a failing record holds back (sought back to it and paused, unless they
        are ``leaving``)."""
        in_hand, self._in_hand = self._in_hand, None
        result = in_hand.result() if in_hand is not None else None
        if result is None:
            return
        self.offsets.applied(result.next_offsets)
        for tp, next_offset in result.next_offsets.items():
            failure = self._failures.get(tp)
            if failure is not None and next_offset > failure.offset:
                del self._failures[tp]
        for tp, failure in result.blocked.items():
            self._failures[tp] = failure
            if tp in leaving or tp not in self._assigned:
                continue
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
            self.health.missing_topics.discard(p.topic)
            tp = (p.topic, p.partition)
            self._assigned.add(tp)
            self._failures.pop(tp, None)
            self._waiting.pop(tp, None)
        self.metrics.assigned.set(len(self._assigned))
        log.info("partitions assigned", extra={"partitions": sorted(self._assigned)})

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        revoked = {(p.topic, p.partition) for p in partitions}
        self._settle(consumer, leaving=revoked)  # the batch in hand is finished first
        self.offsets.commit_now(consumer, only=revoked)  # then committed, before others read
        self._forget(consumer, revoked)

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Lost, not revoked: another member may own them already; do not commit for them.
        lost = {(p.topic, p.partition) for p in partitions}
        self._settle(consumer, leaving=lost)
        self._forget(consumer, lost)

    def _forget(self, consumer: Consumer, partitions: set[TP]) -> None:
        # A partition paused for a retry stays paused in the client after it is unassigned,
        # also when it is assigned again (the eager protocol revokes and assigns every
        # partition on each rebalance): resumed while it is still assigned, it is read
        # again from its committed offset if it comes back.
        paused = [TopicPartition(t, p) for t, p in partitions if (t, p) in self._waiting]
        if paused:
            try:
                consumer.resume(paused)
            except KafkaException as exc:
                log.warning("could not resume partitions that go", extra={"error": str(exc)})
        self.offsets.forget(partitions)
        for tp in partitions:
            self._failures.pop(tp, None)
            self._waiting.pop(tp, None)
            self._assigned.discard(tp)
            with contextlib.suppress(KeyError):  # no lag reported for it yet
                self.metrics.lag.remove(tp[0], str(tp[1]))
        self.metrics.assigned.set(len(self._assigned))

    # -- housekeeping -------------------------------------------------------------------------

    def _topic_missing(self, topic: str) -> None:
        if topic in self.health.missing_topics:
            return
        self.health.missing_topics.add(topic)
        log.warning(
            f"subscribed topic {topic} does not exist: nothing is read from it until it is "
            f"created (outbox topics create {topic})",
            extra={"topic": topic, "group": self.inbox.group},
        )

    def _recheck_missing_topics(self, consumer: Consumer) -> None:
        """Whether the topics that were missing exist now: another member of the group may be
        given all their partitions, so an assignment is not the only sign."""
        for topic in sorted(self.health.missing_topics):
            try:
                found = consumer.list_topics(topic, timeout=TOPIC_CHECK_TIMEOUT).topics.get(topic)
            except KafkaException:
                return  # Kafka out of reach: the next turn asks again
            if found is not None and found.error is None:
                self.health.missing_topics.discard(topic)
                log.info(f"subscribed topic {topic} exists now", extra={"topic": topic})

    def _update_lag(self, consumer: Consumer) -> None:
        if not self._assigned:
            return
        try:
            positions = consumer.position([TopicPartition(t, p) for t, p in self._assigned])
            if positions and not self.health.kafka_ok:
                # Out of reach last we heard: one call that must reach the broker tells an
                # idle consumer (nothing to commit, no rebalance) that Kafka is back.
                consumer.get_watermark_offsets(positions[0], timeout=1.0, cached=False)
                self.health.kafka_ok = True
            for position in positions:
                _, high = consumer.get_watermark_offsets(position, cached=True)
                if position.offset >= 0 and high >= 0:
                    lag = max(high - position.offset, 0)
                    self.metrics.lag.labels(position.topic, str(position.partition)).set(lag)
        except KafkaException:
            pass  # a metric, not worth failing a loop over

    def _apply_requeued(self) -> None:
        """On the database thread, between two batches."""
        assert self._applier is not None
        try:
            self._applier.apply_requeued()
        except DatabaseUnavailable as exc:
            # An idle consumer learns of an outage here only: /healthz must see it too.
            self.health.database_ok = False
            log.warning("could not look for requeued messages", extra={"error": str(exc)})
            return
        self.health.database_ok = True

    def _purge(self, engine: sa.Engine, retention: timedelta) -> None:
        try:
            deleted = self.store.purge_processed(engine, retention)
        except sa.exc.SQLAlchemyError as exc:
            log.warning("inbox purge failed", extra={"error": str(exc).splitlines()[0]})
            return
        if deleted:
            log.info("inbox rows purged", extra={"deleted": deleted})

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
        if error.code() == KafkaError._TRANSPORT:
            return  # librdkafka logs each of these itself (outbox.kafka): one line per cause
        log.warning(f"Kafka client error: {error}")
