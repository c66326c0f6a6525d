"""Applying a batch of records in one database transaction: the heart of the inbox.

For each record, in the order read: insert its inbox row; if the row was there already, skip
the record (a duplicate); otherwise run its handler. One commit covers the handlers' writes,
the inbox rows, the parked rows and whatever the handlers published through the outbox.

Two ways through a batch:

- **fast**: all inbox rows in one statement, then the handlers, no savepoints; a batch
  handler gets all its topic's new messages in one call, and the session is flushed once,
  at the end. A batch in which every handler succeeds (nearly all of them) costs one round
  trip for the inbox.
- **careful**: a savepoint per record, so a failing handler rolls back its own record only
  (a batch handler gets one-message lists there). A batch falls back to it when anything
  fails on the fast way (after rolling it all back), and takes it at once when it holds a
  record that failed before.

A failing record blocks the rest of its partition in this batch (order per partition); the
runner seeks back to it and retries after a backoff, and parks it after the last attempt.

A handler's write that breaks a deferred constraint (``DEFERRABLE INITIALLY DEFERRED``)
fails only at the commit, where no record can be blamed. The batch is then run the careful
way with the deferred constraints checked at the end of each record's handler, inside its
savepoint (``SET CONSTRAINTS ALL IMMEDIATE``, then ``ALL DEFERRED`` for the next record), so
that the record whose writes break one fails alone, and the others commit.

The algorithm is written once, as coroutines, for both kinds of session:
:mod:`outbox.inbox.sessions` runs it on a plain ``Session`` (where no step ever waits) and
on an ``AsyncSession``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

import sqlalchemy as sa

from outbox.errors import OutboxError
from outbox.inbox.api import Inbox, RawRecord
from outbox.inbox.error_text import MAX_ERROR_TEXT, handler_error
from outbox.inbox.error_text import short_error as _short_error
from outbox.inbox.ledger import BatchResult, Failure, Item, TopicPartition
from outbox.inbox.ledger import Ledger as _Ledger
from outbox.inbox.metrics import InboxMetrics
from outbox.inbox.schema import HANDLER_FAILED
from outbox.inbox.store import Claim, InboxStore
from outbox.tracing import consumer_span, otel_loaded

log = logging.getLogger("outbox.inbox")

__all__ = [
    "MAX_ERROR_TEXT",
    "Applier",
    "BatchResult",
    "DatabaseUnavailable",
    "Failure",
    "Item",
    "TopicPartition",
    "handler_error",
    "prepare",
    "requeued_item",
]


class DatabaseUnavailable(Exception):
    """The database could not be reached (or the connection broke): nothing was applied."""


class Transaction(Protocol):
    """One open database transaction, as the applier drives it (see
    :mod:`outbox.inbox.sessions` for the two kinds)."""

    #: what handlers get: a ``Session`` or an ``AsyncSession``
    session: Any

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(connection_or_session, *args)``: one of the store's statements."""

    async def call(self, handler: Callable[..., Any], argument: Any) -> None:
        """``handler(argument, session)``, awaited when it is a coroutine function."""

    def pending_writes(self) -> bool:
        """Whether handlers left ORM writes not flushed yet."""

    async def flush(self) -> None:
        """Send the handlers' pending ORM writes, so that they fail here if they fail."""

    async def savepoint(self) -> Any: ...

    async def release(self, savepoint: Any) -> None: ...

    async def rollback(self, savepoint: Any) -> None: ...


#: Opens a transaction that commits when the block ends (rolls back on an exception).
Begin = Callable[[], AbstractAsyncContextManager[Transaction]]


def _broken_connection(exc: BaseException) -> bool:
    return isinstance(exc, sa.exc.DBAPIError) and bool(exc.connection_invalidated)


def _check_deferred_constraints(session: Any) -> None:
    """Check the writes so far against the deferred constraints now (a violation raises
    here), then defer them again for the next record's handler."""
    session.execute(sa.text("SET CONSTRAINTS ALL IMMEDIATE"))
    session.execute(sa.text("SET CONSTRAINTS ALL DEFERRED"))


def database_error(exc: BaseException) -> DatabaseUnavailable:
    """What the appliers raise for an error of the database itself."""
    return DatabaseUnavailable(_short_error(exc))


def _claim(item: Item) -> Claim:
    assert item.identity is not None
    r = item.record
    return Claim(item.identity, r.topic, r.partition, r.offset)


class _FastPathFailed(Exception):
    """Something failed on the fast way; ``item`` is the record whose handler raised, when
    one record can be blamed (not for a batch handler, nor for the final flush, nor when
    earlier handlers' ORM writes were still to be flushed)."""

    def __init__(self, item: Item | None) -> None:
        self.item = item


class Applier:
    """Applies batches of :class:`Item` through the inbox's handlers, in transactions that
    ``begin`` opens."""

    def __init__(
        self,
        begin: Begin,
        inbox: Inbox,
        store: InboxStore,
        metrics: InboxMetrics,
        max_attempts: int,
    ) -> None:
        self.begin = begin
        self.inbox = inbox
        self.store = store
        self.metrics = metrics
        self.max_attempts = max_attempts
        self._handlers = inbox.handlers

    async def apply(self, items: Sequence[Item]) -> BatchResult:
        """Apply ``items`` in one transaction; raises :class:`DatabaseUnavailable` when the
        database failed (then nothing of the batch committed)."""
        if not any(item.failures for item in items):
            try:
                return await self._run(items, careful=False)
            except _FastPathFailed as failed:
                # Rolled back; the careful way applies the others and retries the culprit.
                if failed.item is not None:
                    cause = failed.__cause__
                    assert cause is not None
                    failed.item.failures += 1
                    failed.item.last_error = handler_error(cause)
                    self.metrics.retried.labels(failed.item.record.topic).inc()
            except sa.exc.IntegrityError as exc:
                return await self._refused_at_commit(items, exc)
        try:
            return await self._run(items, careful=True)
        except sa.exc.IntegrityError as exc:
            return await self._refused_at_commit(items, exc)

    async def _refused_at_commit(
        self, items: Sequence[Item], exc: sa.exc.IntegrityError
    ) -> BatchResult:
        """The commit broke a deferred constraint: find the record whose writes did, by
        checking the constraints after each record's handler."""
        if _broken_connection(exc):
            raise database_error(exc) from exc
        log.warning(
            "the batch's commit broke a deferred constraint: checking each record's writes",
            extra={"error": _short_error(exc).splitlines()[0]},
        )
        return await self._run(items, careful=True, check_deferred=True)

    async def _run(
        self, items: Sequence[Item], careful: bool, check_deferred: bool = False
    ) -> BatchResult:
        ledger = _Ledger(self.metrics, self.max_attempts)
        group = self.inbox.group
        async with self.begin() as tx:
            new: set[str] = set()
            if not careful:
                claims = [_claim(i) for i in items if i.park is None]
                new = await tx.run(self.store.claim_many, group, claims)
            batches: dict[str, list[Item]] = {}  # batch handlers' new messages, per topic
            for item in items:
                if ledger.blocked(item):
                    continue
                if item.park is not None:
                    await self._park(tx, ledger, item, *item.park, attempts=0)
                    continue
                if await self._copy_of_unsettled(tx, ledger, item):
                    continue
                if not ledger.first_time(item):
                    ledger.duplicate(item)
                    continue
                if careful:
                    await self._careful(tx, ledger, item, check_deferred)
                elif item.identity not in new:
                    ledger.duplicate(item)
                elif self.inbox.takes_batches(item.record.topic):
                    batches.setdefault(item.record.topic, []).append(item)
                else:
                    # A statement flushes the ORM writes earlier handlers left (autoflush):
                    # a failure then may be theirs, so this record is not blamed for it.
                    blame = None if tx.pending_writes() else item
                    await self._fast(tx, item, blame)
                    ledger.applied(item)
            for topic_items in batches.values():
                await self._fast(tx, topic_items, None)
                for item in topic_items:
                    ledger.applied(item)
            if not careful:
                await self._fast(tx, None, None)  # the handlers' ORM writes, in one flush
        return ledger.publish_metrics()

    async def _copy_of_unsettled(self, tx: Transaction, ledger: _Ledger, item: Item) -> bool:
        """A copy of an id whose first copy in this batch was parked is parked beside it, and
        one whose first copy is held back for a retry is held back too: neither was applied,
        so neither is a duplicate (whose offset would be committed as if it were)."""
        assert item.identity is not None
        unsettled = ledger.unsettled.get(item.identity)
        if unsettled is None:
            return False
        first, parked = unsettled
        if parked is None:
            ledger.hold(item, first)
            return True
        reason, error = parked
        r = first.record
        copy = f"a copy of the message parked from {r.topic}[{r.partition}]@{r.offset}: {error}"
        await self._park(tx, ledger, item, reason, copy[:MAX_ERROR_TEXT], attempts=0)
        return True

    async def _fast(
        self, tx: Transaction, what: Item | list[Item] | None, blame: Item | None
    ) -> None:
        """Run one handler call (a record, a topic's batch) or, for None, the final flush;
        a failure becomes :class:`_FastPathFailed` (or :class:`DatabaseUnavailable`)."""
        try:
            if what is None:
                await tx.flush()
            else:
                await self._call(tx, what)
        except Exception as exc:
            if _broken_connection(exc):
                raise database_error(exc) from exc
            raise _FastPathFailed(blame) from exc

    async def _careful(
        self, tx: Transaction, ledger: _Ledger, item: Item, check_deferred: bool = False
    ) -> None:
        if item.failures >= self.max_attempts:  # its last attempt was on the fast way
            error = item.last_error or "handler failed"
            log.warning(
                "handler failed on its last attempt: message parked",
                extra={"topic": item.record.topic, "offset": item.record.offset, "error": error},
            )
            await self._park(tx, ledger, item, HANDLER_FAILED, error, attempts=item.failures)
            return
        savepoint = await tx.savepoint()
        try:
            if not await tx.run(self.store.claim_one, self.inbox.group, _claim(item)):
                await tx.release(savepoint)
                ledger.duplicate(item)
                return
            await self._call(tx, [item] if self.inbox.takes_batches(item.record.topic) else item)
            await tx.flush()
            if check_deferred:
                await tx.run(_check_deferred_constraints)
            await tx.release(savepoint)
        except Exception as exc:
            if _broken_connection(exc):
                raise database_error(exc) from exc
            try:
                await tx.rollback(savepoint)
            except sa.exc.DBAPIError as lost:
                raise database_error(lost) from exc
            parked = ledger.failed(item, exc)
            if parked is not None:
                await self._park(tx, ledger, item, HANDLER_FAILED, parked[0], attempts=parked[1])
            return
        ledger.applied(item)

    async def _call(self, tx: Transaction, what: Item | list[Item]) -> None:
        """Call the handler of one record, or the batch handler of one topic's records."""
        first = what if isinstance(what, Item) else what[0]
        argument: Any = what.message if isinstance(what, Item) else [i.message for i in what]
        topic = first.record.topic
        handler = self._handlers[topic]
        started = time.perf_counter()
        if otel_loaded():
            with consumer_span(topic, first.record.headers, self.inbox.group):
                await tx.call(handler, argument)
        else:
            await tx.call(handler, argument)
        seconds = time.perf_counter() - started
        if isinstance(what, Item):
            self.metrics.observe_handler(topic, seconds)
        else:
            self.metrics.observe_batch_handler(topic, seconds)

    async def _park(
        self, tx: Transaction, ledger: _Ledger, item: Item, reason: str, error: str, attempts: int
    ) -> None:
        group = self.inbox.group
        parked_id = await tx.run(
            self.store.park, group, item.record, item.identity, reason, error, attempts
        )
        if parked_id is not None:  # None: this record was parked before, with its letter
            await self._dead_letter(tx, item, reason, error, attempts, parked_id)
        ledger.parked(item, reason, error)

    async def _repark(self, tx: Transaction, row: Any, item: Item, error: str) -> None:
        """A retried message failed again: parked again, with a new dead letter."""
        log.warning(
            "parked message failed again on retry: parked again",
            extra={
                "parked_id": row.id,
                "message_id": row.message_id,
                "topic": row.topic,
                "offset": row.kafka_offset,
                "error": error,
            },
        )
        await tx.run(self.store.repark, row.id, error)
        await self._dead_letter(tx, item, row.reason, error, row.attempts + 1, row.id)

    async def _dead_letter(
        self, tx: Transaction, item: Item, reason: str, error: str, attempts: int, parked_id: int
    ) -> None:
        """The dead letter of a record parked in this transaction, when the inbox has them."""
        letters = self.inbox.dead_letters
        if letters is None:
            return
        args = (self.inbox.group, item.record, item.identity, reason, error, attempts, parked_id)
        try:
            await tx.run(letters.write, *args)
        except OutboxError as exc:
            # The outbox table dropped, a privilege revoked: without its dead letter the
            # record is not parked either; the batch waits, as for a database outage.
            raise DatabaseUnavailable(f"dead letter not written: {exc}") from exc

    async def apply_requeued(self, limit: int = 100) -> int:
        """Apply parked messages an operator marked for retry; returns how many were handled.

        Each in a savepoint of its own: one that fails again is parked again with its new
        error, one applied meanwhile (a later copy) only leaves the parked table. Deferred
        constraints are checked after each one, inside its savepoint, so that a message
        whose writes break one is parked again alone instead of failing the commit of all."""
        async with self.begin() as tx:
            rows = await tx.run(self.store.take_requeued, self.inbox.group, limit)
            for row in rows:
                item = requeued_item(self.inbox, row)
                if item.park is not None:  # still no identity, or still undecodable
                    await self._repark(tx, row, item, item.park[1])
                    continue
                savepoint = await tx.savepoint()
                try:
                    if await tx.run(self.store.claim_one, self.inbox.group, _claim(item)):
                        batch = self.inbox.takes_batches(item.record.topic)
                        await self._call(tx, [item] if batch else item)
                        await tx.flush()
                        await tx.run(_check_deferred_constraints)
                    await tx.release(savepoint)
                except Exception as exc:
                    await tx.rollback(savepoint)
                    await self._repark(tx, row, item, handler_error(exc))
                    continue
                await tx.run(self.store.unpark, row.id)
            return len(rows)


def requeued_item(inbox: Inbox, row: Any) -> Item:
    """A parked row as an item to apply again."""
    headers = tuple(zip(row.header_names or (), row.header_values or (), strict=True))
    record = RawRecord(
        row.topic, row.kafka_partition, row.kafka_offset, row.key, row.value, headers
    )
    # A record parked without an identity is given one now as it would be when read: by the
    # inbox's missing_id (parked again, with the reason, under the default "park").
    return prepare(inbox, record, identity=row.message_id)


def prepare(inbox: Inbox, record: RawRecord, identity: str | None = None) -> Item:
    """Identify and decode a record; a record that cannot be is marked to be parked."""
    from outbox.inbox.api import MissingIdentity
    from outbox.inbox.schema import NO_IDENTITY, UNDECODABLE

    if identity is None:
        try:
            identity = inbox.identify(record)
        except MissingIdentity as exc:
            return Item(record, None, None, park=(NO_IDENTITY, str(exc)))
        except Exception as exc:  # an identity function (missing_id) that fails on it
            return Item(record, None, None, park=(NO_IDENTITY, _short_error(exc)))
    if record.topic not in inbox.handlers:
        return Item(record, identity, None, park=(UNDECODABLE, f"no handler for {record.topic}"))
    try:
        message = inbox.decode(record, identity)
    except Exception as exc:  # any deserializer error: retrying would not help
        return Item(record, identity, None, park=(UNDECODABLE, _short_error(exc)))
    return Item(record, identity, message)
