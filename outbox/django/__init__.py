"""Publishing from a Django service, in the transaction of Django's own connection.

::

    from django.db import transaction

    import outbox.django

    with transaction.atomic():
        order = Order.objects.create(total=30)
        outbox.django.publish("orders", {"order_id": order.id}, key=order.id)

The message's row is written on the connection Django's ``atomic()`` block holds (psycopg 3
or psycopg2, whichever Django runs), so it commits or rolls back with the order. The table
comes from the ``outbox.django`` app's migration (``INSTALLED_APPS``, then ``manage.py
migrate``) or from ``outbox db upgrade``; docs/django.md shows both, and the test helper
(``outbox.django.testing``).

Importing this module imports Django; ``import outbox`` never does.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from django.db import DEFAULT_DB_ALIAS, connections
from sqlalchemy.dialects import registry
from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg
from sqlalchemy.dialects.postgresql.psycopg2 import PGDialect_psycopg2
from sqlalchemy.pool import NullPool

from outbox.errors import ConfigError, NotInTransaction
from outbox.message import NO_KEY, Message, NoKey, PublishResult
from outbox.validation import HeadersLike, KeyLike

if TYPE_CHECKING:
    from outbox.publisher import Outbox
    from outbox.testing import PublishedMessages

__all__ = ["connection", "publish", "publish_many", "published_messages"]

_engines: dict[str, sa.Engine] = {}
_engines_lock = threading.Lock()


def publish(
    topic: str,
    value: Any = None,
    *,
    key: KeyLike | NoKey = NO_KEY,
    headers: HeadersLike = None,
    idempotency_key: str | None = None,
    type: str | None = None,
    subject: str | None = None,
    deliver_after: float | timedelta | None = None,
    deliver_at: datetime | None = None,
    using: str = DEFAULT_DB_ALIAS,
    outbox: Outbox | None = None,
) -> PublishResult:
    """Add one message to the transaction of Django's connection ``using``: call it inside
    ``transaction.atomic()`` (or a view under ``ATOMIC_REQUESTS``).

    The options are :meth:`outbox.Outbox.publish`'s. ``outbox``: the :class:`~outbox.Outbox`
    whose table, serializer and envelope to use (default: the module-level one, see
    :func:`outbox.configure`). Raises :class:`~outbox.errors.NotInTransaction` outside an
    ``atomic()`` block, where each statement would commit on its own, and the
    :class:`~outbox.errors.InvalidMessage` subclasses before writing anything.
    """
    message = Message(
        topic,
        value,
        key,
        headers,
        idempotency_key,
        deliver_after,
        deliver_at,
        type=type,
        subject=subject,
    )
    return publish_many([message], using=using, outbox=outbox)[0]


def publish_many(
    messages: Iterable[Message], *, using: str = DEFAULT_DB_ALIAS, outbox: Outbox | None = None
) -> list[PublishResult]:
    """Add several messages to the transaction of Django's connection ``using``, in one
    statement (see :meth:`outbox.Outbox.publish_many`)."""
    from outbox import _outbox

    writer = outbox if outbox is not None else _outbox()
    with connection(using) as conn:
        return writer.publish_many(conn, messages)


@contextmanager
def connection(using: str = DEFAULT_DB_ALIAS) -> Iterator[sa.Connection]:
    """A SQLAlchemy Connection in the open ``atomic()`` block of Django's connection
    ``using``, for :meth:`outbox.Outbox.publish` and the other calls that take one (a
    scheduled message's cancel, say). Its commit and rollback are Django's to do: the block's
    end decides, as for the queries of your models."""
    wrapper = connections[using]
    if wrapper.vendor != "postgresql":
        raise ConfigError(f"the outbox needs PostgreSQL; database {using!r} is {wrapper.vendor}")
    if not wrapper.in_atomic_block:
        raise NotInTransaction(
            "publish needs Django's transaction: call it inside `with transaction.atomic():` "
            "(or a view under ATOMIC_REQUESTS), so that the message commits with your rows"
        )
    wrapper.validate_no_broken_transaction()
    with _engine(using).connect() as conn, conn.begin():
        yield conn


def published_messages(using: str = DEFAULT_DB_ALIAS, **options: Any) -> PublishedMessages:
    """A :class:`~outbox.testing.PublishedMessages` that reads through Django's connection
    ``using``: inside a test's transaction (pytest-django's ``db``, Django's ``TestCase``) it
    sees what the code under test wrote there, committed or not. ``options``: its
    ``schema``, ``table`` and ``deserializer``."""
    from outbox.testing import PublishedMessages

    return PublishedMessages(_engine(using), **options)


def _engine(using: str) -> sa.Engine:
    """The engine whose every connection is the calling thread's Django connection ``using``
    (Django keeps one per thread): made once per alias."""
    with _engines_lock:
        engine = _engines.get(using)
        if engine is None:
            from django.db.backends.postgresql.psycopg_any import is_psycopg3

            driver = "outbox_django_psycopg" if is_psycopg3 else "outbox_django_psycopg2"
            engine = _engines[using] = sa.create_engine(
                f"postgresql+{driver}://",
                creator=lambda: _JoinedConnection(using),
                poolclass=NullPool,
                pool_reset_on_return=None,
                use_native_hstore=False,
            )
        return engine


class _DjangoPsycopg(PGDialect_psycopg):
    """SQLAlchemy's psycopg dialect, minus what it does to each connection it opens (a notice
    handler): Django's connection is Django's, and here it is "opened" at every publish."""

    supports_statement_cache = True

    def on_connect(self) -> None:
        return None


class _DjangoPsycopg2(PGDialect_psycopg2):
    """SQLAlchemy's psycopg2 dialect, minus what it does to each connection it opens (type
    registrations: Django registers its own, UUID's among them)."""

    supports_statement_cache = True

    def on_connect(self) -> None:
        return None


registry.register("postgresql.outbox_django_psycopg", __name__, "_DjangoPsycopg")
registry.register("postgresql.outbox_django_psycopg2", __name__, "_DjangoPsycopg2")


class _JoinedConnection:
    """Django's DB-API connection as SQLAlchemy sees it here: every call goes to it, except
    commit, rollback and close, which are Django's (``atomic()`` commits or rolls back, Django
    closes). SQLAlchemy's transaction on it is only a view of Django's."""

    def __init__(self, using: str) -> None:
        wrapper = connections[using]
        wrapper.ensure_connection()
        object.__setattr__(self, "_dbapi", wrapper.connection)

    def commit(self) -> None:
        pass

    def rollback(self) -> None:
        pass

    def close(self) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dbapi, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._dbapi, name, value)
