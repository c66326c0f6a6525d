"""One batch's record: its items (records identified and decoded), and the ledger that
counts what became of each (applied, duplicate, parked, held back) and the offsets to commit,
the same for every way through a batch (see :mod:`outbox.inbox.apply`)."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

from outbox.inbox.api import InboxMessage, RawRecord
from outbox.inbox.error_text import handler_error
from outbox.inbox.metrics import InboxMetrics
from outbox.inbox.schema import HANDLER_FAILED

log = logging.getLogger("outbox.inbox")

TopicPartition = tuple[str, int]


@dataclass
class Item:
    """One record, identified and decoded before the transaction opens."""

    record: RawRecord
    identity: str | None
    message: InboxMessage | None
    #: (reason, error) when the record is parked without running a handler
    park: tuple[str, str] | None = None
    #: failed attempts so far (kept by the runner while the record is retried)
    failures: int = 0
    last_error: str | None = None

    @property
    def tp(self) -> TopicPartition:
        return (self.record.topic, self.record.partition)


@dataclass
class Failure:
    """A handler failure that holds its partition back until it is retried."""

    offset: int
    attempts: int
    error: str


@dataclass
class BatchResult:
    #: the offset to commit per partition (the next record to read)
    next_offsets: dict[TopicPartition, int] = field(default_factory=dict)
    #: partitions held back by a failing record
    blocked: dict[TopicPartition, Failure] = field(default_factory=dict)
    applied: int = 0
    duplicates: int = 0
    parked: int = 0


class Ledger:
    """Counts and offsets of one batch, the same for every way through it."""

    def __init__(self, metrics: InboxMetrics, max_attempts: int) -> None:
        self.metrics = metrics
        self.max_attempts = max_attempts
        self.result = BatchResult()
        self.seen: set[str] = set()
        #: ids whose copy earlier in this batch was not applied: parked ((reason, error)) or
        #: held back for a retry (None). A later copy is no duplicate of those.
        self.unsettled: dict[str, tuple[Item, tuple[str, str] | None]] = {}
        self.parked_topics: list[tuple[str, str]] = []
        self.applied_topics: list[str] = []
        self.duplicate_topics: list[str] = []

    def blocked(self, item: Item) -> bool:
        return item.tp in self.result.blocked

    def done(self, item: Item) -> None:
        self.result.next_offsets[item.tp] = item.record.offset + 1

    def duplicate(self, item: Item) -> None:
        self.result.duplicates += 1
        self.duplicate_topics.append(item.record.topic)
        self.done(item)

    def applied(self, item: Item) -> None:
        self.result.applied += 1
        self.applied_topics.append(item.record.topic)
        self.done(item)

    def parked(self, item: Item, reason: str, error: str) -> None:
        self.result.parked += 1
        self.parked_topics.append((item.record.topic, reason))
        # Only a handler's failure: an id whose copy could not even be decoded may be
        # applied from another copy (the fast way has claimed it already).
        if item.identity is not None and reason == HANDLER_FAILED:
            self.unsettled.setdefault(item.identity, (item, (reason, error)))
        self.done(item)

    def hold(self, item: Item, first: Item) -> None:
        """Hold ``item`` back like a failed record, without counting an attempt: its id's
        first copy failed and is retried; once that one is applied, this one is a true
        duplicate."""
        r = first.record
        error = f"waits for the copy at {r.topic}[{r.partition}]@{r.offset}, being retried"
        self.result.blocked[item.tp] = Failure(item.record.offset, item.failures, error)
        self.result.next_offsets[item.tp] = item.record.offset

    def failed(self, item: Item, exc: BaseException) -> tuple[str, int] | None:
        """A handler failed: returns (error, attempts) when the record is to be parked now,
        None when its partition waits for a retry."""
        attempts = item.failures + 1
        error = handler_error(exc)
        self.metrics.retried.labels(item.record.topic).inc()
        if attempts >= self.max_attempts:
            log.warning(
                "handler failed on its last attempt: message parked",
                extra={"topic": item.record.topic, "offset": item.record.offset, "error": error},
            )
            return error, attempts
        self.result.blocked[item.tp] = Failure(item.record.offset, attempts, error)
        self.result.next_offsets[item.tp] = item.record.offset
        if item.identity is not None:
            self.unsettled.setdefault(item.identity, (item, None))
        log.info(
            "handler failed: record will be retried",
            extra={
                "topic": item.record.topic,
                "partition": item.record.partition,
                "offset": item.record.offset,
                "attempt": attempts,
                "error": error,
            },
        )
        return None

    def first_time(self, item: Item) -> bool:
        """False for a second copy of an id within this batch."""
        assert item.identity is not None
        if item.identity in self.seen:
            return False
        self.seen.add(item.identity)
        return True

    def publish_metrics(self) -> BatchResult:
        m = self.metrics
        for topic, count in Counter(self.applied_topics).items():
            m.processed.labels(topic).inc(count)
        for topic, count in Counter(self.duplicate_topics).items():
            m.duplicates.labels(topic).inc(count)
        for (topic, reason), count in Counter(self.parked_topics).items():
            m.parked.labels(topic, reason).inc(count)
        return self.result
