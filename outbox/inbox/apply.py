"""Applying a batch of records in one database transaction: the heart of the inbox.

For each record, in the order read: insert its inbox row; if the row was there already, skip
the record (a duplicate); otherwise run its handler. One commit covers the handlers' writes,
the inbox rows, the parked rows and whatever the handlers published through the outbox.

Two ways through a batch:

- **fast**: all inbox rows in one statement, then the handlers, no savepoints. A batch in
  which every handler succeeds (nearly all of them) costs one round trip for the inbox.
- **careful**: a savepoint per record, so a failing handler rolls back its own record only.
  A batch falls back to it when a handler fails on the fast way (after rolling it all back),
  and takes it at once when it holds a record that failed before.

A failing record blocks the rest of its partition in this batch (order per partition); the
runner seeks back to it and retries after a backoff, and parks it after the last attempt.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from outbox.inbox.api import Inbox, InboxMessage, RawRecord
from outbox.inbox.metrics import InboxMetrics
from outbox.inbox.schema import HANDLER_FAILED
from outbox.inbox.store import Claim, InboxStore
from outbox.tracing import consumer_span

log = logging.getLogger("outbox.inbox")

TopicPartition = tuple[str, int]


class DatabaseUnavailable(Exception):
    """The database could not be reached (or the connection broke): nothing was applied."""


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


def _short_error(exc: BaseException) -> str:
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return text[:2000]


def _broken_connection(exc: BaseException) -> bool:
    return isinstance(exc, sa.exc.DBAPIError) and bool(exc.connection_invalidated)


class _Ledger:
    """Counts and offsets of one batch, the same for every way through it."""

    def __init__(self, inbox: Inbox, metrics: InboxMetrics, max_attempts: int) -> None:
        self.inbox = inbox
        self.metrics = metrics
        self.max_attempts = max_attempts
        self.result = BatchResult()
        self.seen: set[str] = set()
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

    def parked(self, item: Item, reason: str) -> None:
        self.result.parked += 1
        self.parked_topics.append((item.record.topic, reason))
        self.done(item)

    def failed(self, item: Item, exc: BaseException) -> tuple[str, int] | None:
        """A handler failed: returns (error, attempts) when the record is to be parked now,
        None when its partition waits for a retry."""
        attempts = item.failures + 1
        error = _short_error(exc)
        self.metrics.retried.labels(item.record.topic).inc()
        if attempts >= self.max_attempts:
            log.warning(
                "handler failed on its last attempt: message parked",
                extra={"topic": item.record.topic, "offset": item.record.offset, "error": error},
            )
            return error, attempts
        self.result.blocked[item.tp] = Failure(item.record.offset, attempts, error)
        self.result.next_offsets[item.tp] = item.record.offset
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
        for topic in self.applied_topics:
            m.processed.labels(topic).inc()
        for topic in self.duplicate_topics:
            m.duplicates.labels(topic).inc()
        for topic, reason in self.parked_topics:
            m.parked.labels(topic, reason).inc()
        return self.result


def _claim(item: Item) -> Claim:
    assert item.identity is not None
    r = item.record
    return Claim(item.identity, r.topic, r.partition, r.offset)


class _FastPathFailed(Exception):
    def __init__(self, item: Item) -> None:
        self.item = item


class SyncApplier:
    """Applies batches with plain handlers, each given the batch's ``Session``."""

    def __init__(
        self,
        engine: sa.Engine,
        inbox: Inbox,
        store: InboxStore,
        metrics: InboxMetrics,
        max_attempts: int,
    ) -> None:
        self.engine = engine
        self.inbox = inbox
        self.store = store
        self.metrics = metrics
        self.max_attempts = max_attempts

    def apply(self, items: Sequence[Item]) -> BatchResult:
        try:
            if not any(item.failures for item in items):
                try:
                    return self._run(items, careful=False)
                except _FastPathFailed as failed:
                    # Rolled back; the careful way applies the others and retries this one.
                    item, cause = failed.item, failed.__cause__
                    assert cause is not None
                    item.failures += 1
                    item.last_error = _short_error(cause)
                    self.metrics.retried.labels(item.record.topic).inc()
            return self._run(items, careful=True)
        except DatabaseUnavailable:
            raise
        except (sa.exc.DBAPIError, OSError) as exc:
            raise DatabaseUnavailable(_short_error(exc)) from exc

    def _run(self, items: Sequence[Item], careful: bool) -> BatchResult:
        ledger = _Ledger(self.inbox, self.metrics, self.max_attempts)
        group = self.inbox.group
        with Session(self.engine) as session, session.begin():
            new: set[str] = set()
            if not careful:
                claims = [_claim(i) for i in items if i.park is None]
                new = self.store.claim_many(session, group, claims)
            for item in items:
                if ledger.blocked(item):
                    continue
                if item.park is not None:
                    self._park(session, ledger, item, *item.park, attempts=0)
                    continue
                if not ledger.first_time(item):
                    ledger.duplicate(item)
                    continue
                if careful:
                    self._careful(session, ledger, item)
                elif item.identity not in new:
                    ledger.duplicate(item)
                else:
                    try:
                        self._call(session, item)
                    except Exception as exc:
                        if _broken_connection(exc):
                            raise DatabaseUnavailable(_short_error(exc)) from exc
                        raise _FastPathFailed(item) from exc
                    ledger.applied(item)
        return ledger.publish_metrics()

    def _careful(self, session: Session, ledger: _Ledger, item: Item) -> None:
        if item.failures >= self.max_attempts:  # its last attempt was on the fast way
            error = item.last_error or "handler failed"
            self._park(session, ledger, item, HANDLER_FAILED, error, attempts=item.failures)
            return
        savepoint = session.begin_nested()
        try:
            if not self.store.claim_one(session, self.inbox.group, _claim(item)):
                savepoint.commit()
                ledger.duplicate(item)
                return
            self._call(session, item)
            savepoint.commit()
        except Exception as exc:
            if _broken_connection(exc):
                raise DatabaseUnavailable(_short_error(exc)) from exc
            try:
                savepoint.rollback()
            except sa.exc.DBAPIError as lost:
                raise DatabaseUnavailable(_short_error(lost)) from exc
            parked = ledger.failed(item, exc)
            if parked is not None:
                self._park(session, ledger, item, HANDLER_FAILED, parked[0], attempts=parked[1])
            return
        ledger.applied(item)

    def _call(self, session: Session, item: Item) -> None:
        assert item.message is not None
        handler = self.inbox.handlers[item.record.topic]
        started = time.perf_counter()
        with consumer_span(item.record.topic, item.record.headers, self.inbox.group):
            handler(item.message, session)
        if session.new or session.dirty or session.deleted:
            session.flush()  # the handler's ORM writes fail here, on their own record
        self.metrics.observe_handler(item.record.topic, time.perf_counter() - started)

    def _park(
        self, session: Session, ledger: _Ledger, item: Item, reason: str, error: str, attempts: int
    ) -> None:
        self.store.park(
            session, self.inbox.group, item.record, item.identity, reason, error, attempts
        )
        ledger.parked(item, reason)

    def apply_requeued(self, limit: int = 100) -> int:
        """Apply parked messages an operator marked for retry; returns how many were handled."""
        try:
            with Session(self.engine) as session, session.begin():
                rows = self.store.take_requeued(session, self.inbox.group, limit)
                for row in rows:
                    item = requeued_item(self.inbox, row)
                    savepoint = session.begin_nested()
                    try:
                        if item.park is not None:
                            raise ValueError(item.park[1])
                        if self.store.claim_one(session, self.inbox.group, _claim(item)):
                            self._call(session, item)
                        savepoint.commit()
                    except Exception as exc:
                        savepoint.rollback()
                        self.store.repark(session, row.id, _short_error(exc))
                        continue
                    self.store.unpark(session, row.id)
                return len(rows)
        except (sa.exc.DBAPIError, OSError) as exc:
            raise DatabaseUnavailable(_short_error(exc)) from exc


def requeued_item(inbox: Inbox, row: Any) -> Item:
    """A parked row as an item to apply again."""
    headers = tuple(zip(row.header_names or (), row.header_values or (), strict=True))
    record = RawRecord(
        row.topic, row.kafka_partition, row.kafka_offset, row.key, row.value, headers
    )
    identity = row.message_id or f"{row.topic}/{row.kafka_partition}/{row.kafka_offset}"
    return prepare(inbox, record, identity=identity)


def prepare(inbox: Inbox, record: RawRecord, identity: str | None = None) -> Item:
    """Identify and decode a record; a record that cannot be is marked to be parked."""
    from outbox.inbox.api import MissingIdentity
    from outbox.inbox.schema import NO_IDENTITY, UNDECODABLE

    if identity is None:
        try:
            identity = inbox.identify(record)
        except MissingIdentity as exc:
            return Item(record, None, None, park=(NO_IDENTITY, str(exc)))
    if record.topic not in inbox.handlers:
        return Item(record, identity, None, park=(UNDECODABLE, f"no handler for {record.topic}"))
    try:
        message = inbox.decode(record, identity)
    except Exception as exc:  # any deserializer error: retrying would not help
        return Item(record, identity, None, park=(UNDECODABLE, _short_error(exc)))
    return Item(record, identity, message)


class AsyncApplier:
    """Applies batches with coroutine handlers, each given an ``AsyncSession``.

    Always the careful way (a savepoint per record). Runs on an event loop of its own, so the
    runner around it stays one plain thread.
    """

    def __init__(
        self,
        database_url: str,
        inbox: Inbox,
        store: InboxStore,
        metrics: InboxMetrics,
        max_attempts: int,
    ) -> None:
        from sqlalchemy.ext.asyncio import create_async_engine

        self._loop = asyncio.Runner()
        self.engine = self._loop.run(_make_engine(create_async_engine, database_url))
        self.inbox = inbox
        self.store = store
        self.metrics = metrics
        self.max_attempts = max_attempts

    def close(self) -> None:
        self._loop.run(self.engine.dispose())
        self._loop.close()

    def apply(self, items: Sequence[Item]) -> BatchResult:
        try:
            return self._loop.run(self._run(items))
        except DatabaseUnavailable:
            raise
        except (sa.exc.DBAPIError, OSError) as exc:
            raise DatabaseUnavailable(_short_error(exc)) from exc

    async def _run(self, items: Sequence[Item]) -> BatchResult:
        from sqlalchemy.ext.asyncio import AsyncSession

        ledger = _Ledger(self.inbox, self.metrics, self.max_attempts)
        group = self.inbox.group
        async with AsyncSession(self.engine) as session, session.begin():
            for item in items:
                if ledger.blocked(item):
                    continue
                if item.park is not None:
                    await self._park(session, ledger, item, *item.park, attempts=0)
                    continue
                if not ledger.first_time(item):
                    ledger.duplicate(item)
                    continue
                savepoint = await session.begin_nested()
                try:
                    new = await session.run_sync(self.store.claim_one, group, _claim(item))
                    if new:
                        await self._call(session, item)
                    await savepoint.commit()
                except Exception as exc:
                    if _broken_connection(exc):
                        raise DatabaseUnavailable(_short_error(exc)) from exc
                    try:
                        await savepoint.rollback()
                    except sa.exc.DBAPIError as lost:
                        raise DatabaseUnavailable(_short_error(lost)) from exc
                    parked = ledger.failed(item, exc)
                    if parked is not None:
                        await self._park(
                            session, ledger, item, HANDLER_FAILED, parked[0], attempts=parked[1]
                        )
                    continue
                if new:
                    ledger.applied(item)
                else:
                    ledger.duplicate(item)
        return ledger.publish_metrics()

    async def _call(self, session: Any, item: Item) -> None:
        handler = self.inbox.handlers[item.record.topic]
        started = time.perf_counter()
        with consumer_span(item.record.topic, item.record.headers, self.inbox.group):
            await handler(item.message, session)
        await session.flush()
        self.metrics.observe_handler(item.record.topic, time.perf_counter() - started)

    async def _park(
        self, session: Any, ledger: _Ledger, item: Item, reason: str, error: str, attempts: int
    ) -> None:
        group = self.inbox.group
        await session.run_sync(
            lambda s: self.store.park(s, group, item.record, item.identity, reason, error, attempts)
        )
        ledger.parked(item, reason)

    def apply_requeued(self, limit: int = 100) -> int:
        try:
            return self._loop.run(self._requeued(limit))
        except (sa.exc.DBAPIError, OSError) as exc:
            raise DatabaseUnavailable(_short_error(exc)) from exc

    async def _requeued(self, limit: int) -> int:
        from sqlalchemy.ext.asyncio import AsyncSession

        group = self.inbox.group
        async with AsyncSession(self.engine) as session, session.begin():
            rows = await session.run_sync(self.store.take_requeued, group, limit)
            for row in rows:
                item = requeued_item(self.inbox, row)
                savepoint = await session.begin_nested()
                try:
                    if item.park is not None:
                        raise ValueError(item.park[1])
                    if await session.run_sync(self.store.claim_one, group, _claim(item)):
                        await self._call(session, item)
                    await savepoint.commit()
                except Exception as exc:
                    await savepoint.rollback()
                    error = _short_error(exc)
                    await session.run_sync(self.store.repark, row.id, error)
                    continue
                await session.run_sync(self.store.unpark, row.id)
            return len(rows)


async def _make_engine(factory: Callable[..., Any], url: str) -> Any:
    # Made inside the loop that will use it.
    return factory(url)
