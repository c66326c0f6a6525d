"""Sending batches to Kafka: what the relay asks of its producers, and the at-least-once sender.

A sender starts batches (the loop's thread) and is served by a thread of its own
(:meth:`Sender.serve`), which hands back the batches that ended with what Kafka said of each
message. Exactly-once is :mod:`outbox.relay.transactions`.

At-least-once, every shard shares one idempotent producer (``acks=all``), with several
batches in flight on it (:mod:`outbox.flights`). It sets ``enable.gapless.guarantee``: when
the broker refuses a request for good (a record too large for the topic, say), librdkafka
would otherwise renumber the requests after it and let them land, and a key's later messages
would go before the refused ones. With it the producer fails at once: nothing after the
refused request lands, the records it had not reported on are given back unsent, and a new
producer takes over (the relay then sends the refused records one at a time, see
:mod:`outbox.relay.core`).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from confluent_kafka import KafkaException, Producer
from confluent_kafka.admin import AdminClient, ConfigResource  # type: ignore[attr-defined]

from outbox.flights import Flight, IdempotentSender
from outbox.records import OutboxRecord
from outbox.relay.commands import Batch
from outbox.relay.policy import classify
from outbox.sending import Ack, BatchResult

#: librdkafka's own lines (connection failures, ...) go through this logger, so that they come
#: out as JSON lines like the relay's (they are handed over while the client is polled).
KAFKA_LOG = logging.getLogger("outbox.kafka")
log = logging.getLogger("outbox.relay")


#: librdkafka's default ``batch.size``: the most bytes of one partition's records in a request.
DEFAULT_BATCH_BYTES = 1_000_000
#: Room left under a topic's ``max.message.bytes`` for the record batch's own framing.
BATCH_FRAMING_BYTES = 512


class TopicLimits:
    """The most bytes a record batch may hold on each topic (its ``max.message.bytes``),
    asked of the brokers the first time a refusal needs it, then kept for the process's
    life (restart the relay after raising a topic's limit to lift the smaller batches)."""

    def __init__(
        self,
        kafka_config: Mapping[str, Any],
        describe: Callable[[str], int | None] | None = None,
    ) -> None:
        self._config = {
            k: v
            for k, v in kafka_config.items()
            if not k.startswith(
                ("linger", "compression", "acks", "enable.", "max.in.flight", "delivery.", "batch.")
            )
        }
        self._describe = describe or self._from_brokers
        self._known: dict[str, int | None] = {}
        self._asked: set[str] = set()
        self._lock = threading.Lock()

    def of(self, topic: str) -> int | None:
        """``topic``'s limit, or None when the brokers do not say (no DescribeConfigs right)."""
        with self._lock:
            if topic not in self._known:
                self._known[topic] = self._describe(topic)
            return self._known[topic]

    def learned(self, topic: str) -> tuple[bool, int | None]:
        """Whether ``topic``'s limit was learned, and the limit (as :meth:`of`); one not
        learned yet is learned in the background: a topic seen for the first time costs its
        first batch no wait."""
        if topic in self._known:
            return True, self._known[topic]
        with self._lock:
            if topic not in self._asked:
                self._asked.add(topic)
                threading.Thread(target=self.of, args=(topic,), daemon=True).start()
        return False, None

    def _from_brokers(self, topic: str) -> int | None:
        settings: dict[str, Any] = {**self._config, "logger": KAFKA_LOG}
        admin: AdminClient | None = None
        try:
            admin = AdminClient(settings)
            resource = ConfigResource("topic", topic)
            found = admin.describe_configs([resource], request_timeout=10)[resource].result(15)
            entry = found.get("max.message.bytes")
            return int(entry.value) if entry is not None and entry.value else None
        except Exception as error:  # any failure (a timeout is the built-in
            # TimeoutError) leaves the limit unknown: the topic's batches must not wait for
            # an answer that will not come.
            log.info("the limit of topic %s is unknown: %s", topic, error)
            return None
        finally:
            if admin is not None:
                admin.poll(0)


def batch_room(limit: int) -> int:
    """The request size that fits a topic whose record batches may hold ``limit`` bytes."""
    return max(limit // 2, limit - BATCH_FRAMING_BYTES)


class Sender(Protocol):
    """What the relay asks of Kafka (at-least-once or exactly-once)."""

    def start(self, batch: Batch) -> None:
        """Start sending ``batch`` (its shards have nothing else in flight)."""

    def serve(self, timeout: float) -> list[tuple[Batch, BatchResult]]:
        """Serve the client up to ``timeout`` seconds or until a batch ends; return the
        batches that ended, with what Kafka said (the sender's own thread calls it)."""
        ...

    def take_over(self, shards: Sequence[int]) -> dict[int, list[Ack]]:
        """Exactly-once: fence the last owners of ``shards``, return what their last
        committed transactions sent (blocking: run off the loop)."""
        ...

    def let_go(self, shards: Sequence[int]) -> None:
        """Drop what serves ``shards`` (exactly-once: their producers), without waiting."""

    def stop_sending(self) -> None:
        """This relay lost or gave up its shards: stop what is in flight where it can be
        stopped (what Kafka did not acknowledge is given back)."""

    def probe(self, timeout: float) -> bool:
        """Whether a broker answers a metadata request in time (blocking: run off the loop)."""
        ...

    @property
    def in_flight(self) -> int: ...

    def close(self) -> None: ...


class AtLeastOnceSender:
    """One idempotent producer for every shard this relay owns (see the module), and a
    *narrow* one for the topics that take smaller requests than it makes.

    A topic whose ``max.message.bytes`` is below the producer's request size refuses whole
    requests of healthy records. The first such refusal names no record: its records go back
    unsent, and the topic is learned (its limit asked of the brokers) and sent from then on
    through the narrow producer, whose requests fit the smallest limit learned. There a
    record refused as too large was alone in its request, and the refusal is its own; the
    narrow producer needs no gap-less guarantee (a refused request holds nothing else of its
    partition). A key's messages all go to one topic, so to one producer, in order.
    """

    def __init__(
        self,
        kafka_config: Mapping[str, Any],
        delivery_timeout_ms: int,
        give_up: Callable[[], bool] = lambda: False,
        *,
        clock: Callable[[], float] = time.monotonic,
        producer_factory: Callable[[dict[str, Any]], Producer] = Producer,
        limits: TopicLimits | None = None,
    ) -> None:
        self.limits = limits or TopicLimits(kafka_config)
        self._settings = (dict(kafka_config), delivery_timeout_ms, give_up, clock, producer_factory)
        self.sender = self._make(self._main_settings())
        self.narrow: IdempotentSender | None = None
        #: Topics sent through the narrow producer (their limit is below the main one's).
        self.narrow_topics: dict[str, int] = {}
        #: Batches split over both producers: the parts still in flight, and what is known.
        self._parts: dict[int, tuple[int, BatchResult]] = {}
        self._lock = threading.Lock()
        #: Narrow producers replaced by a narrower one: served until their batches ended.
        self._retired: list[IdempotentSender] = []
        #: Topics whose limit was learned and that go to the right producer since.
        self._routed: set[str] = set()
        #: Batches waiting for their topics' limits to be learned.
        self._waiting: list[Batch] = []
        #: Held while topics are routed to a producer (the loop's thread and the serving one).
        self._routing = threading.Lock()

    @staticmethod
    def _main_settings() -> dict[str, Any]:
        """The main producer keeps the gap-less guarantee (see the module)."""
        return {"enable.gapless.guarantee": True}

    def _make(self, extra: dict[str, Any]) -> IdempotentSender:
        kafka_config, delivery_timeout_ms, give_up, clock, producer_factory = self._settings
        return IdempotentSender(
            kafka_config,
            delivery_timeout_ms,
            give_up,
            # No deadline watchdog: the sender's own thread serves the producers all the time.
            extra_config={"logger": KAFKA_LOG, **extra},
            clock=clock,
            watchdog=False,
            producer_factory=producer_factory,
        )

    def start(self, batch: Batch) -> None:
        """Start ``batch``; one with a topic whose limit is not learned yet waits for it (a
        few milliseconds, once per topic), so that no request is larger than its topic
        takes."""
        new = {record.topic for record in batch.records} - self._routed
        if new and not all(self.limits.learned(topic)[0] for topic in new):
            with self._lock:
                self._waiting.append(batch)
            return
        self._route(new)
        self._produce(batch)

    def _route(self, topics: set[str]) -> None:
        with self._routing:
            self._route_now(topics)

    def _route_now(self, topics: set[str]) -> None:
        for topic in topics:
            _, limit = self.limits.learned(topic)
            self._routed.add(topic)
            room = None if limit is None else batch_room(limit)
            if (
                room is not None
                and room < self.sender.batch_bytes
                and topic not in self.narrow_topics
            ):
                self._narrow(topic, room)

    def _produce(self, batch: Batch) -> None:
        narrow_topics = self.narrow_topics
        wide = [r for r in batch.records if r.topic not in narrow_topics]
        narrow = [r for r in batch.records if r.topic in narrow_topics]
        if narrow and self.narrow is not None:
            with self._lock:
                self._parts[batch.number] = (int(bool(wide)) + 1, BatchResult())
            self.narrow.start(narrow, tag=batch)
            if wide:
                self.sender.start(wide, tag=batch)
        else:
            self.sender.start(batch.records, tag=batch)

    def _start_waiting(self) -> None:
        """Start the batches that waited for their topics' limits, in order, once learned."""
        with self._lock:
            waiting, self._waiting = self._waiting, []
        for position, batch in enumerate(waiting):
            new = {record.topic for record in batch.records} - self._routed
            if not all(self.limits.learned(topic)[0] for topic in new):
                with self._lock:  # the later ones wait behind it: a shard's order
                    self._waiting = waiting[position:] + self._waiting
                return
            self._route(new)
            self._produce(batch)

    def serve(self, timeout: float) -> list[tuple[Batch, BatchResult]]:
        ended: list[tuple[Batch, BatchResult]] = []
        if self._waiting:
            self._start_waiting()
            timeout = min(timeout, 0.005)
        for retired in list(self._retired):
            ended.extend(self._ended(retired.wait(0), narrow=True))
            if not retired.in_flight:
                self._retired.remove(retired)
                retired.close(1.0)
        narrow = self.narrow
        if narrow is not None and narrow.in_flight:
            # Both producers are served: neither waits long for the other.
            timeout = min(timeout, 0.005)
            ended.extend(self._ended(narrow.wait(0), narrow=True))
        ended.extend(self._ended(self.sender.wait(timeout), narrow=False))
        return ended

    def _ended(self, flights: list[Flight], narrow: bool) -> list[tuple[Batch, BatchResult]]:
        ended = []
        for flight in flights:
            batch = flight.tag
            assert isinstance(batch, Batch)
            result = flight.result
            if narrow:
                result.refused_alone.update(_too_large(result))
            else:
                self._judge(flight.records, result)
            with self._lock:
                parts = self._parts.get(batch.number)
                if parts is not None:
                    left, merged = parts
                    _merge(merged, result)
                    if left > 1:
                        self._parts[batch.number] = (left - 1, merged)
                        continue
                    del self._parts[batch.number]
                    result = merged
            ended.append((batch, result))
        return ended

    def _judge(self, records: Sequence[OutboxRecord], result: BatchResult) -> None:
        """Refusals as too large on the main producer: a topic that takes smaller requests
        goes to the narrow producer, and its records back unsent; a topic that takes the main
        producer's requests refused the record alone."""
        topics = {record.id: record.topic for record in records}
        room = self.sender.batch_bytes
        for record_id in _too_large(result):
            topic = topics[record_id]
            limit = self.limits.of(topic)
            if limit is None:
                continue  # the brokers do not say: the relay sends it alone to judge it
            if batch_room(limit) >= room:
                result.refused_alone.add(record_id)
                continue
            del result.errors[record_id]
            result.not_attempted.append(record_id)
            with self._routing:
                if topic not in self.narrow_topics:
                    self._narrow(topic, batch_room(limit))

    def _narrow(self, topic: str, room: int) -> None:
        log.warning(
            "topic %s takes record batches of at most %d bytes (its max.message.bytes), less "
            "than the relay's requests: its messages go through a producer of smaller "
            "requests from now on (restart the relay after raising the topic's limit)",
            topic,
            room + BATCH_FRAMING_BYTES,
        )
        smallest = min([room, *self.narrow_topics.values()])
        if self.narrow is None or self.narrow.batch_bytes > smallest:
            # A new narrow producer (the old one's flights, if any, end given back).
            old, self.narrow = self.narrow, self._make({"batch.size": smallest})
            if old is not None:
                old.purge()
                self._retired.append(old)
        self.narrow_topics = {**self.narrow_topics, topic: room}

    def take_over(self, shards: Sequence[int]) -> dict[int, list[Ack]]:
        return {}  # at-least-once there is nobody to fence and nothing to recover

    def let_go(self, shards: Sequence[int]) -> None:
        return None

    def stop_sending(self) -> None:
        with self._lock:
            self._waiting = []  # forgotten by the relay with the rest
        self.sender.purge()
        if self.narrow is not None:
            self.narrow.purge()

    def probe(self, timeout: float) -> bool:
        try:
            self.sender.check_reachable(timeout)
        except KafkaException:
            return False
        return True

    @property
    def in_flight(self) -> int:
        narrow = self.narrow.in_flight if self.narrow else 0
        return self.sender.in_flight + narrow + len(self._waiting)

    @property
    def producer(self) -> Producer:
        return self.sender.producer

    def close(self) -> None:
        self.sender.close(10.0)
        if self.narrow is not None:
            self.narrow.close(10.0)


def _too_large(result: BatchResult) -> list[uuid.UUID]:
    """The records refused as too large whose refusal is not known to be their own."""
    return [
        record_id
        for record_id, error in result.errors.items()
        if record_id not in result.refused_alone and classify(error) == "message_too_large"
    ]


def _merge(into: BatchResult, part: BatchResult) -> None:
    into.acks.extend(part.acks)
    into.errors.update(part.errors)
    into.not_attempted.extend(part.not_attempted)
    into.refused_alone.update(part.refused_alone)
