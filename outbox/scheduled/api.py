"""Listing and cancelling scheduled messages from a service (``outbox scheduled ...`` is the
operator's way to do the same)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session

from outbox.binds import checked_connection, session_connection
from outbox.errors import ConfigError, NotScheduled
from outbox.ids import as_message_id
from outbox.publisher import Outbox
from outbox.scheduled.store import PRODUCER, ScheduledStore
from outbox.schema import CANCELLED


@dataclass(frozen=True)
class ScheduledMessage:
    """A message waiting for its time."""

    message_id: uuid.UUID
    topic: str
    key: bytes | None
    deliver_at: datetime
    #: When it was published.
    created_at: datetime
    idempotency_key: str | None


class ScheduledMessages:
    """The scheduled messages of ``outbox``'s table.

    Each method runs in a transaction of its own on the outbox's engine, or in the caller's
    when given ``bind`` (a Session, or a Connection inside a transaction), so that a cancel
    commits with the business change that calls for it.
    """

    def __init__(self, outbox: Outbox) -> None:
        if not isinstance(outbox, Outbox):
            raise ConfigError(f"ScheduledMessages needs an outbox.Outbox, got {type(outbox)}")
        self.outbox = outbox
        self.store = ScheduledStore(outbox.spec)

    def cancel(
        self, message_id: uuid.UUID | str, *, bind: Session | Connection | None = None
    ) -> None:
        """Cancel a scheduled message: it is never sent.

        Cancelling one already cancelled does nothing. One no longer scheduled (it fell due:
        the relay made it pending, it may be on its topic already), or no message at all,
        raises :class:`~outbox.errors.NotScheduled`, whose ``status`` says where it stands.
        """
        wanted = as_message_id(message_id)
        if bind is None:
            with self.outbox.engine.begin() as conn:
                return self._cancel(conn, wanted)
        if isinstance(bind, Session):
            return self._cancel(session_connection(bind), wanted)
        return self._cancel(checked_connection(bind), wanted)

    async def acancel(
        self, message_id: uuid.UUID | str, *, bind: AsyncSession | AsyncConnection | None = None
    ) -> None:
        """The asyncio version of :meth:`cancel`."""
        wanted = as_message_id(message_id)
        if bind is None:
            async with self.outbox.async_engine.begin() as conn:
                await conn.run_sync(lambda sync: self._cancel(sync, wanted))
            return
        if isinstance(bind, AsyncSession):
            await bind.run_sync(lambda session: self._cancel(session_connection(session), wanted))
            return
        await bind.run_sync(lambda conn: self._cancel(checked_connection(conn), wanted))

    def list(
        self,
        *,
        topic: str | None = None,
        limit: int = 100,
        bind: Session | Connection | None = None,
    ) -> list[ScheduledMessage]:
        """Scheduled messages (one topic's, or all), the soonest due first, at most ``limit``."""
        if bind is None:
            with self.outbox.engine.connect() as conn:
                rows = self.store.waiting(conn, topic=topic, limit=limit)
        else:
            conn = bind.connection() if isinstance(bind, Session) else bind
            rows = self.store.waiting(conn, topic=topic, limit=limit)
        return [
            ScheduledMessage(
                row["id"],
                row["topic"],
                row["key"],
                row["deliver_at"],
                row["created_at"],
                row["idempotency_key"],
            )
            for row in rows
        ]

    def _cancel(self, conn: Connection, message_id: uuid.UUID) -> None:
        if self.store.cancel(conn, [message_id], PRODUCER):
            return
        status = self.store.statuses(conn, [message_id]).get(message_id)
        if status == CANCELLED:
            return
        where = "there is no such message" if status is None else f"it is {status}"
        raise NotScheduled(
            f"message {message_id} is not scheduled: {where}",
            message_id=message_id,
            status=status,
        )
