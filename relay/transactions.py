"""Exactly-once sending: one transactional producer per owned shard, a Kafka transaction per batch.

``transactional.id`` is ``<prefix>-<shard>``: the next owner of a shard fences the last
(``init_transactions`` bumps the epoch and aborts what it left open). Each batch of a shard is
one transaction holding its records and one progress record (:mod:`outbox.relay.progress`)
listing every message with the partition and offset it got; a take-over reads the shard's
last committed progress records, so that a crash between "Kafka committed" and "rows marked
sent" never republishes them.

Each shard's transaction runs on a thread of its own (every owned shard can have one open at
once); a producer that cannot go on (fenced, failed for good, or a commit Kafka does not
answer before the transaction's own timeout) is dropped, and the batch reports its shard
lost: the relay lets the shard go, and a take-over settles its transaction.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from enum import Enum
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer

from outbox.records import OutboxRecord
from outbox.relay.commands import Batch
from outbox.relay.policy import classify
from outbox.relay.progress import encode_progress, last_committed_of
from outbox.relay.sender import DEFAULT_BATCH_BYTES, KAFKA_LOG, TopicLimits, batch_room
from outbox.schema import SHARD_COUNT
from outbox.sending import Ack, BatchResult, kafka_error_of, produce_batch, sending_config

log = logging.getLogger(__name__)

#: How much longer than the delivery timeout a Kafka transaction may stay open.
TRANSACTION_MARGIN_MS = 30_000
#: ``linger.ms`` of the transactional producers unless set: a batch's records fill larger
#: requests while they are produced, and its end costs nothing, since the ``flush()`` that
#: waits for them (and the commit's own) sends at once whatever lingers. Measured (16 shards,
#: batches of 2,000): about 10% more messages a second for less CPU than with 0.
TRANSACTION_LINGER_MS = 5
#: Seconds a take-over's ``init_transactions`` may wait for the transaction coordinator.
#: Kafka out of reach, the take-over fails after this long and is tried again at a later
#: rebalance: an outage costs at most this long after Kafka returns, not librdkafka's minute.
INIT_TIMEOUT = 10.0

_FENCED = {KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH}


class Outcome(Enum):
    """How a batch's transaction ended."""

    COMMITTED = "committed"
    ABORTED = "aborted"
    #: The producer could not finish it (fenced, fatal, or Kafka did not answer in time).
    LOST = "lost"


class ExactlyOnceSender:
    """One transactional producer per owned shard; each batch is one Kafka transaction."""

    def __init__(
        self,
        kafka_config: Mapping[str, Any],
        *,
        transactional_id_prefix: str,
        progress_topic: str,
        owner: str,
        delivery_timeout_ms: int,
        give_up: Callable[[], bool] = lambda: False,
        clock: Callable[[], float] = time.monotonic,
        executor: Executor | None = None,
        producer_factory: Callable[[dict[str, Any]], Producer] = Producer,
        consumer_factory: Callable[[dict[str, Any]], Consumer] = Consumer,
        limits: TopicLimits | None = None,
        close_inline: bool = False,
        init_pool: Callable[[int], Executor] | None = None,
    ) -> None:
        self.give_up = give_up
        self.limits = limits or TopicLimits(kafka_config)
        #: Where a take-over's shards fence their last owners side by side.
        self._init_pool = init_pool or (lambda shards: ThreadPoolExecutor(max_workers=shards))
        #: The most bytes of one partition's records in a request: lowered when a topic
        #: refuses larger ones (see judge_refusals); each shard's producer is made again with
        #: it at its next batch.
        self.batch_bytes = int(kafka_config.get("batch.size", DEFAULT_BATCH_BYTES))
        self._made_with: dict[int, int] = {}
        self.clock = clock
        self.kafka_config = dict(kafka_config)
        self.prefix = transactional_id_prefix
        self.progress_topic = progress_topic
        self.owner = owner
        self.delivery_timeout_ms = delivery_timeout_ms
        # A transaction must outlive the deliveries inside it (librdkafka insists).
        self.transaction_timeout_ms = delivery_timeout_ms + TRANSACTION_MARGIN_MS
        self._make_producer = producer_factory
        self.producers: dict[int, Producer] = {}
        self._running: set[Future[BatchResult]] = set()
        self._ended: deque[tuple[Batch, BatchResult]] = deque()
        self._ended_now = threading.Event()
        self._executor = executor or ThreadPoolExecutor(
            max_workers=SHARD_COUNT, thread_name_prefix="outbox-eos"
        )
        consumer_config = {
            key: value
            for key, value in self.kafka_config.items()
            if not key.startswith(("linger", "compression", "acks", "enable.idempotence"))
            and key not in {"max.in.flight.requests.per.connection", "delivery.timeout.ms"}
        }
        consumer_config = {
            **consumer_config,
            "group.id": f"{self.prefix}-progress-reader",
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "auto.offset.reset": "earliest",
            "logger": KAFKA_LOG,
        }
        self._make_consumer = consumer_factory
        #: Served for events and used by probes; the take-overs read with their own, which
        #: reads to a partition's end (the broker need not hold its empty fetches long).
        self._consumer = consumer_factory(consumer_config)
        self._progress_config = {**consumer_config, "fetch.wait.max.ms": 10}
        self._progress = consumer_factory(self._progress_config)
        self._progress_lock = threading.Lock()
        #: Held while a shard's producer is let go or replaced: a producer made again after
        #: its shard was let go would send for a shard another relay may own.
        self._swap_lock = threading.Lock()
        #: Producers let go of, closed off the loop (a flush can wait while brokers are down).
        self._closing: queue.SimpleQueue[tuple[int, Producer] | None] = queue.SimpleQueue()
        self._closer: threading.Thread | None = None
        if not close_inline:  # (the model-based test closes them in its own thread)
            self._closer = threading.Thread(target=self._close_dropped, name="outbox-eos-close")
            self._closer.start()

    # -- sending -----------------------------------------------------------------------------

    def start(self, batch: Batch) -> None:
        """One Kafka transaction for ``batch`` (of one shard), on a thread of its own."""
        (shard,) = batch.shards
        # The producer is picked now: a batch that waits for a thread must not use the
        # producer of a later take-over of its shard.
        future = self._executor.submit(
            self._one_shard, shard, batch.records, self.producers.get(shard)
        )
        self._running.add(future)
        future.add_done_callback(lambda done: self._ended_one(batch, done))

    def serve(self, timeout: float) -> list[tuple[Batch, BatchResult]]:
        if not self._ended:
            self._ended_now.wait(timeout)
        self._ended_now.clear()
        self._serve_events()
        ended = []
        while self._ended:
            ended.append(self._ended.popleft())
        return ended

    @property
    def in_flight(self) -> int:
        return len(self._running) + len(self._ended)

    def stop_sending(self) -> None:
        """Nothing to do: the next owner's take-over fences this relay's producers."""

    def probe(self, timeout: float) -> bool:
        try:
            self._consumer.list_topics(timeout=timeout)
        except KafkaException:
            return False
        finally:
            self._serve_events()
        return True

    # -- shards changing hands ---------------------------------------------------------------

    def take_over(self, shards: Sequence[int]) -> dict[int, list[Ack]]:
        """Fence the earlier owners of ``shards`` and return what their last committed
        transactions sent, per shard. Safe beside the loop's batches: the shards' producers
        are registered only once they fenced the earlier owner, and the progress records
        are read with a consumer of the take-overs' own."""
        began = self.clock()
        # Side by side: each waits for the coordinator, which may first have to abort the
        # earlier owner's open transaction (a relay killed mid-batch).
        with self._init_pool(len(shards) or 1) as pool:
            inits = {shard: pool.submit(self._fenced_producer, shard) for shard in shards}
        failure: BaseException | None = None
        for shard, init in inits.items():
            error = init.exception()
            if error is None:
                self.producers[shard] = init.result()
                self._made_with[shard] = self.batch_bytes
            elif failure is None:
                failure = error
        if failure is not None:
            raise failure  # the relay lets the fenced ones go with the shards
        fenced_at = self.clock()
        with self._progress_lock:
            try:
                found = last_committed_of(self._progress, self.progress_topic, shards)
            except (KafkaException, TimeoutError):
                # After a broker restart a client's metadata can stay wrong ("Unknown
                # partition" for minutes, seen in a chaos run); the next try gets a new one.
                self._progress.close()
                self._progress = self._make_consumer(self._progress_config)
                raise
        log.info(
            "shards %s: earlier owners fenced in %.2fs, progress read in %.2fs",
            list(shards),
            fenced_at - began,
            self.clock() - fenced_at,
        )
        return {shard: list(acks) for shard, acks in found.items()}

    def let_go(self, shards: Sequence[int]) -> None:
        with self._swap_lock:
            dropped = [(shard, self.producers.pop(shard, None)) for shard in shards]
        self._retire(dropped)

    def _retire(self, dropped: Sequence[tuple[int, Producer | None]]) -> None:
        for shard, producer in dropped:
            if producer is not None:
                self._closing.put((shard, producer))
        if self._closer is None:
            self._closing.put(None)
            self._close_dropped()

    def producer_config(self, shard: int) -> dict[str, Any]:
        """The settings of ``shard``'s transactional producer."""
        config = {
            **sending_config(self.kafka_config, self.delivery_timeout_ms),
            "transactional.id": f"{self.prefix}-{shard}",
            "transaction.timeout.ms": self.transaction_timeout_ms,
            "logger": KAFKA_LOG,
        }
        if not {"linger.ms", "queue.buffering.max.ms"} & self.kafka_config.keys():
            config["linger.ms"] = TRANSACTION_LINGER_MS
        if self.batch_bytes != DEFAULT_BATCH_BYTES:
            config["batch.size"] = self.batch_bytes
        return config

    def close(self) -> None:
        for future in list(self._running):
            future.exception()  # waits for it
        for shard in list(self.producers):
            self.let_go([shard])
        self._closing.put(None)
        if self._closer is not None:
            self._closer.join()
        else:
            self._close_dropped()
        if isinstance(self._executor, ThreadPoolExecutor):
            self._executor.shutdown(wait=True)
        self._consumer.close()
        with self._progress_lock:
            self._progress.close()

    # -- internals -------------------------------------------------------------------------

    def _fenced_producer(self, shard: int) -> Producer:
        producer = self._make_producer(self.producer_config(shard))
        try:
            producer.init_transactions(INIT_TIMEOUT)  # fences the old owner, ends its transaction
        except BaseException:
            self._closing.put((shard, producer))
            raise
        return producer

    def _ended_one(self, batch: Batch, future: Future[BatchResult]) -> None:
        self._running.discard(future)
        error = future.exception()
        if error is None:
            result = future.result()
        else:  # a defect, not Kafka: the batch goes again, the shard with it
            log.error("exactly-once batch failed: %r", error)
            result = BatchResult(not_attempted=[r.id for r in batch.records])
            result.lost_shards.extend(batch.shards)
        self._ended.append((batch, result))
        self._ended_now.set()

    def _serve_events(self) -> None:
        """Hand over the clients' queued events (librdkafka's log lines), also while idle."""
        try:
            self._consumer.poll(0)  # assigned to nothing: only events
            for producer in list(self.producers.values()):
                producer.poll(0)
        except (KafkaException, SystemError) as exc:
            if kafka_error_of(exc) is None:
                raise
            # A producer failed for good: its next transaction finds it so, and lets go.

    def _one_shard(
        self, shard: int, records: Sequence[OutboxRecord], producer: Producer | None
    ) -> BatchResult:
        """One Kafka transaction: the records and the shard's progress record, or nothing."""
        result = BatchResult()
        if producer is None:
            result.not_attempted.extend(r.id for r in records)
            return result
        stale = self._made_with.get(shard, self.batch_bytes) > self.batch_bytes
        if stale and self.producers.get(shard) is producer:
            # Made before a topic refused its requests: made again, with smaller ones (not
            # once a later take-over of the shard replaced it: that one would be fenced).
            try:
                fresh = self._fenced_producer(shard)
            except KafkaException as exc:
                return self._lost(shard, producer, records, result, exc.args[0])
            with self._swap_lock:
                kept = self.producers.get(shard) is producer
                if kept:
                    self.producers[shard] = fresh
            if not kept:  # let go while the new one was made: send nothing with it
                self._retire([(shard, fresh)])
                result.not_attempted.extend(r.id for r in records)
                result.lost_shards.append(shard)
                return result
            self._retire([(shard, producer)])
            self._made_with[shard] = self.batch_bytes
            producer = fresh
        try:
            producer.begin_transaction()
        except KafkaException as exc:
            return self._lost(shard, producer, records, result, exc.args[0])
        # After this the coordinator aborts the transaction by itself: no use resuming a call.
        expires = self.clock() + self.transaction_timeout_ms / 1000
        batch_error: KafkaError | None = None
        try:
            produce_batch(
                producer,
                records,
                result,
                self.delivery_timeout_ms / 1000,
                self.give_up,
                purge_in_flight=False,  # the abort below waits for them, as librdkafka's does
                clock=self.clock,
            )
            self._judge(records, result, self._made_with.get(shard, self.batch_bytes))
            complete = not result.errors and len(result.acks) == len(records)
            if complete:
                try:
                    producer.produce(
                        self.progress_topic,
                        key=str(shard).encode(),
                        value=encode_progress(shard, self.owner, result.acks),
                        partition=shard,
                    )
                except KafkaException as exc:  # the progress record itself is refused
                    batch_error, complete = exc.args[0], False
        except (KafkaException, SystemError) as exc:
            error = kafka_error_of(exc)
            if error is None:
                raise
            log.warning("exactly-once batch of shard %d failed: %s", shard, error)
            complete = False
        outcome, finish_error = self._finish(producer, commit=complete, expires=expires)
        if outcome is Outcome.COMMITTED:
            return result
        if outcome is Outcome.LOST:
            return self._lost(shard, producer, records, result, None)
        # Aborted: the rows that failed keep their error (retry, dead); the rest go again. A
        # transaction that failed though each record was taken failed as a whole.
        if not result.errors:
            result.batch_error = batch_error or finish_error
        result.acks.clear()
        result.not_attempted = [r.id for r in records if r.id not in result.errors]
        return result

    def _judge(self, records: Sequence[OutboxRecord], result: BatchResult, made: int) -> None:
        """Refusals as too large: from requests larger than the topic takes (the shard's
        producer made before its limit was learned), the records go back unsent and every
        shard's producer is made again with requests that fit; from requests that fit, the
        refusal is the record's own. A topic whose limit the brokers do not say leaves its
        refusals to the relay, which sends each such record alone before it gives up."""
        topics = {record.id: record.topic for record in records}
        for record_id, error in list(result.errors.items()):
            if record_id in result.refused_alone or classify(error) != "message_too_large":
                continue
            limit = self.limits.of(topics[record_id])
            if limit is None:
                continue
            if batch_room(limit) >= made:
                result.refused_alone.add(record_id)
                continue
            del result.errors[record_id]
            result.not_attempted.append(record_id)
            if batch_room(limit) < self.batch_bytes:
                log.warning(
                    "topic %s takes record batches of at most %d bytes (its "
                    "max.message.bytes), less than the relay's requests: every shard's "
                    "requests stay under that from now on (restart the relay after raising "
                    "the topic's limit)",
                    topics[record_id],
                    limit,
                )
                self.batch_bytes = batch_room(limit)

    def _finish(
        self, producer: Producer, commit: bool, expires: float
    ) -> tuple[Outcome, KafkaError | None]:
        """Commit (or abort) the open transaction, resuming a call that timed out; returns
        how it ended and, when a commit could not be made, why."""
        why: KafkaError | None = None
        while True:
            # Each call may take as long as an init; one that timed out is made again (librdkafka
            # requires it: until the same call completes, every other transactional call
            # fails) until the transaction's own timeout would have ended it.
            timeout = min(INIT_TIMEOUT, expires - self.clock())
            if timeout <= 0:
                log.warning("transaction not finished before its timeout")
                return Outcome.LOST, why
            try:
                if commit:
                    producer.commit_transaction(timeout)
                    return Outcome.COMMITTED, None
                producer.abort_transaction(timeout)
                return Outcome.ABORTED, why
            except KafkaException as exc:
                error: KafkaError = exc.args[0]
                if error.fatal() or error.code() in _FENCED:
                    log.warning("transactional producer unusable: %s", error)
                    return Outcome.LOST, why
                if commit and error.txn_requires_abort():
                    commit, why = False, error  # the transaction cannot commit: abort it
                    continue
                if not error.retriable() or self.give_up():
                    log.warning("transaction not finished: %s", error)
                    return Outcome.LOST, why
                log.warning("%s timed out; resuming it: %s", "commit" if commit else "abort", error)

    def _lost(
        self,
        shard: int,
        producer: Producer,
        records: Sequence[OutboxRecord],
        result: BatchResult,
        error: KafkaError | None,
    ) -> BatchResult:
        """This producer cannot go on: the batch is released and the shard let go."""
        if error is not None:
            log.warning("shard %d: transactional producer cannot go on: %s", shard, error)
        if self.producers.get(shard) is producer:  # not a newer producer of a take-over
            self.let_go([shard])
        result.acks.clear()
        result.errors.clear()
        result.not_attempted = [r.id for r in records]
        result.lost_shards.append(shard)
        return result

    def _close_dropped(self) -> None:
        """Flush what each dropped producer still sends (briefly), then let it go, off the
        loop: with brokers down a flush waits its whole time."""
        while (item := self._closing.get()) is not None:
            shard, producer = item
            try:
                producer.flush(5)
            except (KafkaException, SystemError) as exc:
                error = kafka_error_of(exc)
                if error is None:
                    log.exception("shard %d: producer not closed", shard)
                    continue
                # Fenced or failed for good (often why the shard was let go): nothing of it is
                # waited for; the next owner's take-over settles its transaction.
                log.info("shard %d: producer let go as it stands: %s", shard, error)
            del producer
