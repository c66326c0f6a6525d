"""Transactional outbox for Python services on PostgreSQL and Kafka.

Business rows and outbox rows commit in one PostgreSQL transaction; the relay publishes the
rows to Kafka. The usual entry points::

    import outbox

    ob = outbox.Outbox("postgresql+psycopg://app:pw@db/shop")
    with ob.transaction() as tx:
        tx.session.add(order)
        tx.session.flush()  # a generated order.id is None until the INSERT runs
        tx.publish("orders", {"id": order.id, "total": order.total}, key=order.id)

    # or inside a transaction you already have (Session or Connection, sync or async):
    outbox.publish(session, "orders", {"id": 7}, key=7)

For a business step outside the outbox's database, prepared messages with check-back are in
:mod:`outbox.prepared`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, Any

from outbox.errors import (
    ConfigError,
    IdempotencyKeyTaken,
    InvalidAnswer,
    InvalidCloudEvent,
    InvalidHeaders,
    InvalidKey,
    InvalidMessage,
    InvalidTopic,
    LossyConversion,
    NotInTransaction,
    NotPrepared,
    NotRolledBack,
    OutboxError,
    OutboxTableMissing,
    PayloadTooLarge,
    PermissionDenied,
    SerializationError,
)

if TYPE_CHECKING:
    from outbox.immediate import ImmediateSender
    from outbox.message import ID_HEADER, NO_KEY, Message, NoKey, PublishResult
    from outbox.publisher import Outbox
    from outbox.serialization import BytesSerializer, JsonSerializer, Serializer
    from outbox.transactions import AsyncOutboxTransaction, OutboxTransaction

__version__ = "0.1.0"

__all__ = [
    "ID_HEADER",
    "NO_KEY",
    "AsyncOutboxTransaction",
    "BytesSerializer",
    "ConfigError",
    "IdempotencyKeyTaken",
    "ImmediateSender",
    "InvalidAnswer",
    "InvalidCloudEvent",
    "InvalidHeaders",
    "InvalidKey",
    "InvalidMessage",
    "InvalidTopic",
    "JsonSerializer",
    "LossyConversion",
    "Message",
    "NoKey",
    "NotInTransaction",
    "NotPrepared",
    "NotRolledBack",
    "Outbox",
    "OutboxError",
    "OutboxTableMissing",
    "OutboxTransaction",
    "PayloadTooLarge",
    "PermissionDenied",
    "PublishResult",
    "SerializationError",
    "Serializer",
    "apublish",
    "apublish_many",
    "atransaction",
    "configure",
    "publish",
    "publish_many",
    "transaction",
]

_default: Outbox | None = None


#: The names that load on first use, and their modules. SQLAlchemy (and for ImmediateSender
#: librdkafka) load with them: ``import outbox`` stays instant, so that the ``outbox``
#: command can take SIGTERM cleanly before it loads them (:mod:`outbox.early_stop`), and a
#: service that only writes to the outbox never loads the Kafka client.
_LAZY = {
    "ID_HEADER": "outbox.message",
    "NO_KEY": "outbox.message",
    "Message": "outbox.message",
    "NoKey": "outbox.message",
    "PublishResult": "outbox.message",
    "AsyncOutboxTransaction": "outbox.transactions",
    "Outbox": "outbox.publisher",
    "OutboxTransaction": "outbox.transactions",
    "BytesSerializer": "outbox.serialization",
    "JsonSerializer": "outbox.serialization",
    "Serializer": "outbox.serialization",
    "ImmediateSender": "outbox.immediate",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once loaded, an ordinary attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


def configure(*args: Any, **kwargs: Any) -> Outbox:
    """Set up the module-level outbox used by :func:`publish`, :func:`transaction` & co.

    Takes the same arguments as :class:`Outbox`; without a call, the defaults apply and
    :func:`transaction` reads ``OUTBOX_DATABASE_URL``.
    """
    from outbox.publisher import Outbox

    global _default
    _default = Outbox(*args, **kwargs)
    return _default


def _outbox() -> Outbox:
    from outbox.publisher import Outbox

    global _default
    if _default is None:
        _default = Outbox()
    return _default


def publish(bind: Any, topic: str, value: Any = None, **options: Any) -> PublishResult:
    """:meth:`Outbox.publish` on the module-level outbox."""
    return _outbox().publish(bind, topic, value, **options)


def publish_many(bind: Any, messages: Iterable[Message]) -> list[PublishResult]:
    """:meth:`Outbox.publish_many` on the module-level outbox."""
    return _outbox().publish_many(bind, messages)


async def apublish(bind: Any, topic: str, value: Any = None, **options: Any) -> PublishResult:
    """:meth:`Outbox.apublish` on the module-level outbox."""
    return await _outbox().apublish(bind, topic, value, **options)


async def apublish_many(bind: Any, messages: Iterable[Message]) -> list[PublishResult]:
    """:meth:`Outbox.apublish_many` on the module-level outbox."""
    return await _outbox().apublish_many(bind, messages)


@contextmanager
def transaction() -> Iterator[OutboxTransaction]:
    """:meth:`Outbox.transaction` on the module-level outbox."""
    with _outbox().transaction() as tx:
        yield tx


@asynccontextmanager
async def atransaction() -> AsyncIterator[AsyncOutboxTransaction]:
    """:meth:`Outbox.atransaction` on the module-level outbox."""
    async with _outbox().atransaction() as tx:
        yield tx
