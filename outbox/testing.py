"""Test helpers for services that use the outbox, usable alone or as a pytest plugin.

- :class:`PublishedMessages` answers "what did this code publish?": the messages committed to
  the outbox table since it started watching, decoded as a consumer reads them. They went
  through the real publish path (validation, the real serializer, the real table), and a
  transaction that rolled back left none, as in production.
- :class:`InboxFeeder` hands messages to an inbox's handlers without Kafka, through the code
  path of ``outbox consume`` (identity, decoding, the inbox row, duplicates skipped, parking),
  each in a real transaction of the consumer's database.
- :func:`throwaway_database` makes a database of its own on a PostgreSQL server, with the
  outbox table (and the inbox tables when asked), and drops it afterwards.

As a pytest plugin (``pytest_plugins = ["outbox.testing"]`` in a ``conftest.py``) it adds the
fixtures ``outbox_database_url`` (a throwaway database on the server that
``OUTBOX_TEST_DATABASE_URL`` names; override the fixture to use your own), ``published`` and
``feed_inbox``. docs/testing.md shows them in use.

PYTEST_DONT_REWRITE: its checks raise their AssertionErrors themselves, so pytest has
nothing to rewrite here, and a ``conftest.py`` that imports this module before naming it
in ``pytest_plugins`` gets no PytestAssertRewriteWarning.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import make_url

from outbox.decoding import Deserializer, JsonDeserializer
from outbox.engines import own_driver_url
from outbox.message import NO_KEY, Message, NoKey, encode_message
from outbox.publisher import DEFAULT_MAX_MESSAGE_BYTES
from outbox.records import OutboxRecord
from outbox.schema import OutboxTableSpec
from outbox.serialization import JsonSerializer, Serializer
from outbox.validation import HeadersLike, KeyLike

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from outbox.inbox import Inbox
    from outbox.inbox.api import RawRecord

#: The server (any database on it) that the ``outbox_database_url`` fixture makes its
#: throwaway databases on, e.g. ``postgresql+psycopg://postgres:pw@127.0.0.1:5432/postgres``.
TEST_DATABASE_URL_ENV = "OUTBOX_TEST_DATABASE_URL"

_COLUMNS = "id, seq, shard, topic, key, value, content_type, header_names, header_values, status"


@dataclass(frozen=True)
class PublishedMessage:
    """One message as the outbox table holds it and a consumer would read it."""

    id: uuid.UUID
    topic: str
    key: bytes | None
    #: The value decoded by the content type, as the inbox decodes it (JSON to Python).
    value: Any
    raw_value: bytes | None
    #: The Kafka headers the relay sends: ``outbox-id``, ``content-type``, then your own.
    headers: tuple[tuple[str, bytes | None], ...]
    #: ``pending`` until a relay sends it (``sent``), or ``prepared``, ``dead``...
    status: str

    def header(self, name: str) -> bytes | None:
        """The last value of header ``name``, or None."""
        found = None
        for header, value in self.headers:
            if header == name:
                found = value
        return found


class PublishedMessages:
    """The messages committed to an outbox table since this object was made (or :meth:`reset`).

    >>> published = PublishedMessages(engine)                       # doctest: +SKIP
    >>> client.post("/orders", json={...})                          # doctest: +SKIP
    >>> published.one("orders").value["type"]                       # doctest: +SKIP
    'OrderPlaced'

    ``bind`` is an Engine, an AsyncEngine or a URL, of any PostgreSQL driver (psycopg 3,
    psycopg2, asyncpg). It reads the table on a connection of its own, so it sees what
    committed, whichever process or thread wrote it. ``bind=session`` (a Session or a
    Connection) on the read methods reads through that session's connection instead, seeing
    its transaction's own uncommitted messages too; for an AsyncSession, call them inside
    ``await session.run_sync(lambda sync: published.values(bind=sync))``.
    Messages of transactions that were open before it started are not counted.
    """

    def __init__(
        self,
        bind: sa.Engine | AsyncEngine | str,
        *,
        schema: str = "public",
        table: str = "outbox",
        deserializer: Deserializer | None = None,
    ) -> None:
        self._own_engine = not isinstance(bind, sa.Engine)
        if isinstance(bind, sa.Engine):
            self.engine = bind
        else:
            # A URL of any PostgreSQL driver, or an AsyncEngine (asyncpg's among them): its
            # own reads are plain blocking ones, through psycopg 3.
            url = bind if isinstance(bind, str) else bind.url
            self.engine = sa.create_engine(own_driver_url(url))
        self.spec = OutboxTableSpec(schema=schema, table=table)
        self.deserializer = deserializer or JsonDeserializer()
        self._since = 0
        self.reset()

    def reset(self) -> None:
        """Forget what was published so far: later reads show only what comes after."""
        with self.engine.connect() as conn:
            self._since = conn.execute(
                sa.text(f"SELECT coalesce(max(seq), 0) FROM {self.spec.qualified_name}")
            ).scalar_one()

    def all(self, topic: str | None = None, *, bind: Any = None) -> list[PublishedMessage]:
        """Every message since the start (of ``topic``, if given), in commit-time order."""
        query = sa.text(
            f"SELECT {_COLUMNS} FROM {self.spec.qualified_name} WHERE seq > :since "
            "AND (CAST(:topic AS text) IS NULL OR topic = :topic) ORDER BY seq"
        )
        params = {"since": self._since, "topic": topic}
        if bind is not None:
            rows = bind.execute(query, params).all()
        else:
            with self.engine.connect() as conn:
                rows = conn.execute(query, params).all()
        return [self._message(row) for row in rows]

    def values(self, topic: str | None = None, *, bind: Any = None) -> list[Any]:
        """The decoded values of :meth:`all`."""
        return [message.value for message in self.all(topic, bind=bind)]

    def one(self, topic: str | None = None, *, bind: Any = None) -> PublishedMessage:
        """The one message published (to ``topic``); AssertionError, listing them, otherwise."""
        found = self.all(topic, bind=bind)
        if len(found) != 1:
            listing = "".join(f"\n  {m.topic} {m.key!r}: {m.value!r}" for m in found)
            where = f" to {topic!r}" if topic else ""
            raise AssertionError(f"expected one message{where}, found {len(found)}{listing}")
        return found[0]

    def assert_none(self, topic: str | None = None, *, bind: Any = None) -> None:
        """AssertionError, listing them, if anything was published (to ``topic``)."""
        found = self.all(topic, bind=bind)
        if found:
            listing = "".join(f"\n  {m.topic} {m.key!r}: {m.value!r}" for m in found)
            raise AssertionError(f"expected no message, found {len(found)}{listing}")

    def close(self) -> None:
        """Dispose of the engine, if this object made it from a URL."""
        if self._own_engine:
            self.engine.dispose()

    def _message(self, row: Any) -> PublishedMessage:
        # psycopg2 reads bytea as memoryview; the record takes bytes.
        header_values = row.header_values and [
            bytes(value) if isinstance(value, memoryview) else value for value in row.header_values
        ]
        record = OutboxRecord.from_columns(
            row.id,
            row.seq,
            row.shard,
            row.topic,
            row.key,
            row.value,
            row.content_type,
            row.header_names,
            header_values,
            0,
        )
        return PublishedMessage(
            id=record.id,
            topic=record.topic,
            key=record.key,
            value=self.deserializer.deserialize(record.value, row.content_type),
            raw_value=record.value,
            headers=tuple(record.headers),
            status=row.status,
        )


class HandlerFailed(AssertionError):
    """A handler raised while :class:`InboxFeeder` fed it a message: nothing of that message
    was applied (its transaction rolled back). ``error`` is the handler's exception as the
    consumer logs it."""

    def __init__(self, topic: str, error: str) -> None:
        super().__init__(f"the {topic!r} handler failed: {error}")
        self.topic = topic
        self.error = error


@dataclass(frozen=True)
class Fed:
    """What feeding one message did: exactly one of the three is true."""

    message_id: str
    applied: bool
    duplicate: bool
    parked: bool


class InboxFeeder:
    """Feeds messages to ``inbox``'s handlers in transactions of ``database_url``, as
    ``outbox consume`` applies records read from Kafka, but without Kafka.

    The database needs the inbox tables (``outbox inbox install``, or
    ``throwaway_database(..., inbox=True)``). Each :meth:`feed` runs one transaction: the
    handler's writes and the inbox row commit together; a message id already applied is a
    duplicate and is skipped; a handler that raises rolls its message back and
    :class:`HandlerFailed` is raised (with ``park_failures=True``, the message is parked
    instead, as the consumer parks it after its last attempt).
    """

    def __init__(
        self,
        inbox: Inbox,
        database_url: str,
        *,
        schema: str = "public",
        table: str = "inbox",
        serializer: Serializer | None = None,
        park_failures: bool = False,
    ) -> None:
        from outbox.inbox.metrics import InboxMetrics
        from outbox.inbox.schema import InboxTableSpec
        from outbox.inbox.sessions import AsyncApplier, SyncApplier
        from outbox.inbox.store import InboxStore

        self.inbox = inbox
        self.serializer = serializer or JsonSerializer()
        self._offsets: dict[tuple[str, int], int] = {}
        # The applier tries a failing message twice in one batch (once with the batch, once
        # alone): a bound it cannot reach leaves the failure to raise, 1 parks at once.
        max_attempts = 1 if park_failures else 1_000_000
        args = (inbox, InboxStore(InboxTableSpec(schema, table)), InboxMetrics(), max_attempts)
        self._engine: sa.Engine | None = None
        self._applier: SyncApplier | AsyncApplier
        if inbox.is_async:
            self._applier = AsyncApplier(database_url, *args)
        else:
            self._engine = sa.create_engine(database_url)
            self._applier = SyncApplier(self._engine, *args)

    def feed(
        self,
        topic: str,
        value: Any = None,
        *,
        key: KeyLike | NoKey = NO_KEY,
        headers: HeadersLike = None,
        message_id: uuid.UUID | str | None = None,
        partition: int = 0,
    ) -> Fed:
        """Apply one message built as the outbox would publish it (the serializer, the
        ``outbox-id`` and ``content-type`` headers). A ``message_id`` given twice is applied
        once: pass the same one again to test what a redelivery does."""
        encoded = encode_message(
            Message(topic, value, key, headers), self.serializer, DEFAULT_MAX_MESSAGE_BYTES
        )
        row = encoded.row
        record = OutboxRecord.from_columns(
            encoded.id,
            0,
            row["shard"],
            topic,
            row.get("key"),
            row.get("value"),
            row.get("content_type"),
            row.get("header_names"),
            row.get("header_values"),
            0,
            id_text=str(message_id) if message_id is not None else None,
        )
        return self.feed_record(record.topic, record.key, record.value, record.headers, partition)

    def feed_published(self, message: PublishedMessage) -> Fed:
        """Apply a message another service published (see :class:`PublishedMessages`)."""
        return self.feed_record(message.topic, message.key, message.raw_value, message.headers)

    def feed_record(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: Sequence[tuple[str, bytes | str | None]],
        partition: int = 0,
    ) -> Fed:
        """Apply one record as Kafka would deliver it (raw bytes and headers)."""
        from outbox.inbox.api import RawRecord
        from outbox.inbox.apply import prepare

        as_bytes = tuple(
            (name, header.encode() if isinstance(header, str) else header)
            for name, header in headers
        )
        offset = self._offsets.get((topic, partition), 0)
        self._offsets[(topic, partition)] = offset + 1
        record: RawRecord = RawRecord(topic, partition, offset, key, value, as_bytes)
        item = prepare(self.inbox, record)
        result = self._applier.apply([item])
        failure = result.blocked.get((topic, partition))
        if failure is not None:
            raise HandlerFailed(topic, failure.error)
        return Fed(
            message_id=item.identity or "",
            applied=result.applied == 1,
            duplicate=result.duplicates == 1,
            parked=result.parked == 1,
        )

    def close(self) -> None:
        """Release the database connections."""
        self._applier.close()
        if self._engine is not None:
            self._engine.dispose()


@contextmanager
def throwaway_database(
    server_url: str, *, outbox: bool = True, inbox: bool = False, prefix: str = "outbox_test"
) -> Iterator[str]:
    """A new database on ``server_url``'s server (the role must be allowed to create
    databases), with the outbox table (``outbox``) and the inbox tables (``inbox``) at their
    newest revision; yields its URL and drops it afterwards.

    The URL keeps ``server_url``'s driver (psycopg2 or asyncpg, say: what the service's code
    runs on); the database is made and migrated through psycopg 3."""
    from outbox import migrate
    from outbox.inbox import migrate as inbox_migrate

    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    server = make_url(server_url)
    admin = sa.create_engine(own_driver_url(server), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
        url = server.set(database=name).render_as_string(hide_password=False)
        own_url = own_driver_url(server.set(database=name)).render_as_string(hide_password=False)
        try:
            if outbox:
                migrate.upgrade(own_url)
            if inbox:
                inbox_migrate.install(own_url)
            yield url
        finally:
            with admin.connect() as conn:
                conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        admin.dispose()


def test_server_url() -> str:
    """The PostgreSQL server ``OUTBOX_TEST_DATABASE_URL`` names, for a fixture of the
    service's own that makes a database there (see docs/testing.md); without it, a
    ``pytest.UsageError`` (a ``RuntimeError`` outside pytest) says to set it."""
    server = os.environ.get(TEST_DATABASE_URL_ENV)
    if server:
        return server
    problem = (
        f"set {TEST_DATABASE_URL_ENV} to a PostgreSQL server the tests may create databases "
        "on, or override the outbox_database_url fixture"
    )
    try:
        import pytest
    except ImportError:
        raise RuntimeError(problem) from None
    raise pytest.UsageError(problem)


test_server_url.__test__ = False  # type: ignore[attr-defined]  # not a test, for pytest


# -- the pytest plugin -------------------------------------------------------------------------

try:
    import pytest
except ImportError:  # the helpers above work without pytest
    pass
else:

    @pytest.fixture
    def outbox_database_url() -> Iterator[str]:
        """A throwaway database with the outbox and inbox tables, on the server that
        ``OUTBOX_TEST_DATABASE_URL`` names. Override this fixture to use a database of yours."""
        with throwaway_database(test_server_url(), inbox=True) as url:
            yield url

    @pytest.fixture
    def published(outbox_database_url: str) -> Iterator[PublishedMessages]:
        """What the test publishes to ``outbox_database_url``'s outbox, from now on."""
        watcher = PublishedMessages(outbox_database_url)
        yield watcher
        watcher.close()

    @pytest.fixture
    def feed_inbox(outbox_database_url: str) -> Iterator[Callable[[Inbox], InboxFeeder]]:
        """``feed_inbox(inbox)``: an :class:`InboxFeeder` on ``outbox_database_url``."""
        feeders: list[InboxFeeder] = []

        def make(inbox: Inbox) -> InboxFeeder:
            feeders.append(InboxFeeder(inbox, outbox_database_url))
            return feeders[-1]

        yield make
        for feeder in feeders:
            feeder.close()
