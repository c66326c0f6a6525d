"""The two kinds of session the inbox applies batches in: ``Session`` and ``AsyncSession``.

:class:`~outbox.inbox.apply.Applier` is written once, as coroutines. On a plain ``Session``
none of its steps waits for anything, so :class:`SyncApplier` runs it to its end in one step,
on the calling thread, without an event loop; :class:`AsyncApplier` runs it on an event loop
of its own, so that the runner around it stays plain threads. Either is used from one thread
only (the runner's database thread).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.orm import Session

from outbox.inbox.api import Inbox
from outbox.inbox.apply import (
    Applier,
    BatchResult,
    DatabaseUnavailable,
    Item,
    Transaction,
    database_error,
)
from outbox.inbox.metrics import InboxMetrics
from outbox.inbox.store import InboxStore

T = TypeVar("T")


def _has_orm_writes(session: Any) -> bool:
    return bool(session.new or session.dirty or session.deleted)


class _SyncTransaction:
    """A :class:`~outbox.inbox.apply.Transaction` on a ``Session``: every step returns at
    once."""

    def __init__(self, session: Session) -> None:
        self.session = session

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(self.session, *args)

    async def call(self, handler: Callable[..., Any], argument: Any) -> None:
        handler(argument, self.session)

    def pending_writes(self) -> bool:
        return _has_orm_writes(self.session)

    async def flush(self) -> None:
        if _has_orm_writes(self.session):
            self.session.flush()

    async def savepoint(self) -> Any:
        return self.session.begin_nested()

    async def release(self, savepoint: Any) -> None:
        savepoint.commit()

    async def rollback(self, savepoint: Any) -> None:
        savepoint.rollback()


class _AsyncTransaction:
    """A :class:`~outbox.inbox.apply.Transaction` on an ``AsyncSession``."""

    def __init__(self, session: Any) -> None:
        self.session = session

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await self.session.run_sync(fn, *args)

    async def call(self, handler: Callable[..., Any], argument: Any) -> None:
        await handler(argument, self.session)

    def pending_writes(self) -> bool:
        return _has_orm_writes(self.session)

    async def flush(self) -> None:
        if _has_orm_writes(self.session):
            await self.session.flush()

    async def savepoint(self) -> Any:
        return await self.session.begin_nested()

    async def release(self, savepoint: Any) -> None:
        await savepoint.commit()

    async def rollback(self, savepoint: Any) -> None:
        await savepoint.rollback()


def run_at_once(step: Coroutine[Any, Any, T]) -> T:
    """The result of a coroutine none of whose awaits waits (every step on a ``Session``)."""
    try:
        step.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    step.close()
    raise RuntimeError("a step on a plain Session waited for an event loop")


class _Applying:
    """What both appliers share: the algorithm, and database errors turned into
    :class:`~outbox.inbox.apply.DatabaseUnavailable`."""

    _applier: Applier

    def apply(self, items: Sequence[Item]) -> BatchResult:
        """Apply one batch in one transaction (see :class:`~outbox.inbox.apply.Applier`)."""
        return self._database(self._applier.apply(items))

    def apply_requeued(self, limit: int = 100) -> int:
        """Apply parked messages an operator marked for retry."""
        return self._database(self._applier.apply_requeued(limit))

    def close(self) -> None:
        """Release what the applier holds."""

    def _drive(self, step: Coroutine[Any, Any, T]) -> T:
        raise NotImplementedError

    def _database(self, step: Coroutine[Any, Any, T]) -> T:
        try:
            return self._drive(step)
        except DatabaseUnavailable:
            raise
        except (sa.exc.DBAPIError, OSError) as exc:
            raise database_error(exc) from exc


#: What the runner applies batches with: :class:`SyncApplier`, :class:`AsyncApplier`, or a
#: stand-in for tests without a database.
BatchApplier = _Applying


class SyncApplier(_Applying):
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
        self._applier = Applier(self._begin, inbox, store, metrics, max_attempts)

    @asynccontextmanager
    async def _begin(self) -> AsyncIterator[Transaction]:
        with Session(self.engine) as session, session.begin():
            yield _SyncTransaction(session)

    def _drive(self, step: Coroutine[Any, Any, T]) -> T:
        return run_at_once(step)


class AsyncApplier(_Applying):
    """Applies batches with coroutine handlers, each given an ``AsyncSession``, on an event
    loop of its own (made in the thread that constructs it and used from that thread)."""

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
        self._applier = Applier(self._begin, inbox, store, metrics, max_attempts)

    @asynccontextmanager
    async def _begin(self) -> AsyncIterator[Transaction]:
        from sqlalchemy.ext.asyncio import AsyncSession

        async with AsyncSession(self.engine) as session, session.begin():
            yield _AsyncTransaction(session)

    def _drive(self, step: Coroutine[Any, Any, T]) -> T:
        return self._loop.run(step)

    def close(self) -> None:
        self._loop.run(self.engine.dispose())
        self._loop.close()


async def _make_engine(factory: Callable[..., Any], url: str) -> Any:
    # Made inside the loop that will use it.
    return factory(url)
