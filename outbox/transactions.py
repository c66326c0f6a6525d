"""The handles ``Outbox.transaction()`` and ``Outbox.atransaction()`` yield: a session and the
publish methods bound to it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from outbox.message import Message, PublishResult

if TYPE_CHECKING:
    from outbox.publisher import Outbox

__all__ = ["AsyncOutboxTransaction", "OutboxTransaction"]


class OutboxTransaction:
    """The handle :meth:`Outbox.transaction` yields: its ``session`` plus publish methods."""

    def __init__(self, outbox: Outbox, session: Session) -> None:
        self.outbox = outbox
        self.session = session

    @property
    def connection(self) -> Connection:
        """The Connection of the transaction, for Core statements."""
        return self.session.connection()

    def publish(self, topic: str, value: Any = None, **options: Any) -> PublishResult:
        """:meth:`Outbox.publish` in this transaction."""
        return self.outbox.publish(self.session, topic, value, **options)

    def publish_many(self, messages: Iterable[Message]) -> list[PublishResult]:
        """:meth:`Outbox.publish_many` in this transaction."""
        return self.outbox.publish_many(self.session, messages)


class AsyncOutboxTransaction:
    """The handle :meth:`Outbox.atransaction` yields: its ``session`` plus publish methods."""

    def __init__(self, outbox: Outbox, session: AsyncSession) -> None:
        self.outbox = outbox
        self.session = session

    async def publish(self, topic: str, value: Any = None, **options: Any) -> PublishResult:
        """:meth:`Outbox.apublish` in this transaction."""
        return await self.outbox.apublish(self.session, topic, value, **options)

    async def publish_many(self, messages: Iterable[Message]) -> list[PublishResult]:
        """:meth:`Outbox.apublish_many` in this transaction."""
        return await self.outbox.apublish_many(self.session, messages)
