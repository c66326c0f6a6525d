"""Offsets on their way to Kafka: recorded once the database committed, then committed.

Between batches the runner commits asynchronously: the loop never waits for the group
coordinator, and a commit that is lost or refused only means that records are read again,
which the inbox skips as duplicates. An offset stays pending until Kafka confirms it, and goes
again with the next commit until then (offsets are cumulative).

Before partitions go (revoked by a rebalance, or the consumer stopping), their offsets are
committed synchronously, and a commit refused because the group is between generations is
sent again until it is taken. During a rebalance a commit that waited behind the member's own
JoinGroup comes back ILLEGAL_GENERATION, and one sent before the group has its assignment
REBALANCE_IN_PROGRESS; once the group has its new generation the same offsets are taken, and
the partitions' next owner reads from them, not from older ones.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Mapping
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from outbox.inbox.metrics import InboxHealth

log = logging.getLogger("outbox.inbox")

TP = tuple[str, int]

#: Errors after which the same synchronous commit is sent again (until the timeout).
RETRIABLE = frozenset(
    {
        KafkaError.ILLEGAL_GENERATION,
        KafkaError.REBALANCE_IN_PROGRESS,
        KafkaError.COORDINATOR_NOT_AVAILABLE,
        KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
        KafkaError.NOT_COORDINATOR,
        KafkaError.REQUEST_TIMED_OUT,
        KafkaError._WAIT_COORD,
        KafkaError._IN_PROGRESS,
        KafkaError._TIMED_OUT,
        KafkaError._TRANSPORT,
    }
)
#: Refusals that come from the group being rebalanced, not from Kafka being out of reach.
GROUP_BUSY = frozenset(
    {
        KafkaError.ILLEGAL_GENERATION,
        KafkaError.REBALANCE_IN_PROGRESS,
        KafkaError.UNKNOWN_MEMBER_ID,
        KafkaError._IN_PROGRESS,
    }
)
#: Seconds a synchronous commit keeps trying (a rebalance waits for every member's join).
SETTLE_TIMEOUT = 30.0
RETRY_PAUSE = 0.2


def _partitions(offsets: Mapping[TP, int]) -> list[TopicPartition]:
    return [TopicPartition(t, p, o) for (t, p), o in offsets.items()]


class Offsets:
    """Per partition, the offset after the last record applied and not yet confirmed
    committed; the runner's thread is the only one that uses it (Kafka's commit callbacks
    run inside ``consume``, on that thread)."""

    def __init__(self, health: InboxHealth) -> None:
        self.health = health
        self._pending: dict[TP, int] = {}
        self._sent: dict[TP, int] = {}  # committed asynchronously, not confirmed yet
        self._sent_since: float | None = None
        self._failing = False

    @property
    def pending(self) -> Mapping[TP, int]:
        return self._pending

    def applied(self, next_offsets: Mapping[TP, int]) -> None:
        """Record offsets whose records' transaction committed."""
        self._pending.update(next_offsets)

    def forget(self, partitions: Collection[TP]) -> None:
        """Drop what is known of partitions this consumer no longer owns."""
        for tp in partitions:
            self._pending.pop(tp, None)
            self._sent.pop(tp, None)

    def commit_async(self, consumer: Consumer) -> None:
        """Send the pending offsets not already on their way; returns at once."""
        offsets = {tp: o for tp, o in self._pending.items() if self._sent.get(tp) != o}
        if not offsets:
            return
        if not self._sent:
            self._sent_since = time.monotonic()
            self.health.kafka_call_since = self._sent_since
        self._sent.update(offsets)
        try:
            consumer.commit(offsets=_partitions(offsets), asynchronous=True)
        except KafkaException as exc:
            for tp in offsets:
                self._sent.pop(tp, None)
            self._after_sent()
            self._refused(exc.args[0])

    def on_commit(self, error: KafkaError | None, partitions: list[TopicPartition]) -> None:
        """Kafka's answer to a commit (the consumer's ``on_commit`` callback)."""
        refused = error
        for p in partitions:
            tp = (p.topic, p.partition)
            if self._sent.get(tp) == p.offset:
                del self._sent[tp]
            if error is None and p.error is None:
                if self._pending.get(tp) == p.offset:
                    del self._pending[tp]
            elif refused is None:
                refused = p.error
        if self._sent:
            # Kafka answers. Behind a link slower than a batch the next commit leaves before
            # this answer arrives, so some commit is always on its way: the wait counts
            # from this answer, not from the first of those commits.
            self._sent_since = time.monotonic()
            self.health.kafka_call_since = self._sent_since
        self._after_sent()
        if refused is None:
            self._confirmed()
        else:
            self._refused(refused)

    def commit_now(
        self,
        consumer: Consumer,
        only: Collection[TP] | None = None,
        timeout: float = SETTLE_TIMEOUT,
    ) -> bool:
        """Commit the pending offsets (of ``only``) synchronously, sending them again while
        the group is between generations or its coordinator moves, for up to ``timeout``
        seconds. True when none of them is left pending."""
        deadline = time.monotonic() + timeout
        while True:
            offsets = {tp: o for tp, o in self._pending.items() if only is None or tp in only}
            if not offsets:
                return True
            error = self._commit_sync(consumer, offsets)
            if error is None:
                for tp, offset in offsets.items():
                    if self._pending.get(tp) == offset:
                        del self._pending[tp]
                self._confirmed()
                return True
            self._refused(error)
            if error.code() not in RETRIABLE or time.monotonic() >= deadline:
                log.warning(
                    "offsets not committed; the next owner reads their records again",
                    extra={"error": str(error), "offsets": sorted(offsets.items())},
                )
                return False
            time.sleep(RETRY_PAUSE)

    def _commit_sync(self, consumer: Consumer, offsets: Mapping[TP, int]) -> KafkaError | None:
        # A synchronous commit blocks while the group's coordinator is away: the health
        # reports Kafka out of reach meanwhile.
        self.health.kafka_call_since = time.monotonic()
        try:
            answer: Any = consumer.commit(offsets=_partitions(offsets), asynchronous=False)
        except KafkaException as exc:
            return exc.args[0]  # type: ignore[no-any-return]
        finally:
            self.health.kafka_call_since = self._sent_since
        return next((p.error for p in answer or () if p.error is not None), None)

    def _after_sent(self) -> None:
        if not self._sent:
            self._sent_since = None
            self.health.kafka_call_since = None

    def _confirmed(self) -> None:
        self._failing = False
        self.health.kafka_ok = True

    def _refused(self, error: KafkaError) -> None:
        if error.code() not in GROUP_BUSY:
            self.health.kafka_ok = False
        if not self._failing:
            # Kept, and sent again with the next commit: a commit lost for good (the process
            # dies first) replays records the inbox then skips.
            log.warning(f"offset commit failed; will retry: {error}")
        self._failing = True
