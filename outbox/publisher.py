"""The publish API: write outbox rows inside the caller's database transaction."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy import event, exc
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from outbox.errors import (
    ConfigError,
    NotInTransaction,
    OutboxError,
    OutboxTableMissing,
    PermissionDenied,
)
from outbox.message import EncodedMessage, Message, PublishResult, encode_message
from outbox.schema import OutboxTableSpec
from outbox.serialization import JsonSerializer, Serializer
from outbox.validation import HeadersLike, KeyLike

if TYPE_CHECKING:
    from outbox.immediate import ImmediateSender

#: Kafka's default producer limit (message.max.bytes); raise it with the topic's own limit.
DEFAULT_MAX_MESSAGE_BYTES = 1_000_000

_SESSION_IDS_KEY = "outbox.published_ids"


class Outbox:
    """Writes messages to the outbox table in the same transaction as the business rows.

    >>> ob = Outbox("postgresql+psycopg://app@localhost/shop")      # doctest: +SKIP
    >>> with ob.transaction() as tx:                                 # doctest: +SKIP
    ...     tx.session.add(order)
    ...     tx.publish("orders", {"id": order.id}, key=order.id)

    ``bind`` (an Engine or a URL) is needed only by :meth:`transaction` and
    :meth:`atransaction`; :meth:`publish` joins whatever session or connection it is given.
    """

    def __init__(
        self,
        bind: Engine | AsyncEngine | str | None = None,
        *,
        schema: str = "public",
        table: str = "outbox",
        serializer: Serializer | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        immediate: ImmediateSender | None = None,
    ) -> None:
        if not isinstance(max_message_bytes, int) or max_message_bytes <= 0:
            raise ConfigError(
                f"max_message_bytes must be a positive int, got {max_message_bytes!r}"
            )
        if serializer is not None and not isinstance(serializer, Serializer):
            raise ConfigError("serializer must have serialize(value) and content_type")
        self.spec = OutboxTableSpec(schema=schema, table=table)
        self.serializer: Serializer = serializer or JsonSerializer()
        self.max_message_bytes = max_message_bytes
        self.immediate = immediate
        self._url = bind if isinstance(bind, str) else None
        self._engine = bind if isinstance(bind, Engine) else None
        self._async_engine = bind if isinstance(bind, AsyncEngine) else None
        self._verified: set[str] = set()
        table_obj = self.spec.table_obj
        self._insert = table_obj.insert()
        self._insert_keyed = (
            pg_insert(table_obj)
            .on_conflict_do_nothing(
                index_elements=[table_obj.c.idempotency_key],
                index_where=table_obj.c.idempotency_key.isnot(None),
            )
            .returning(table_obj.c.id, table_obj.c.idempotency_key)
        )
        self._existing = sa.select(table_obj.c.idempotency_key, table_obj.c.id).where(
            table_obj.c.idempotency_key.in_(sa.bindparam("keys", expanding=True))
        )

    # -- engines ---------------------------------------------------------------------------

    @property
    def engine(self) -> Engine:
        """The Engine used by :meth:`transaction`, made from the URL on first use."""
        if self._engine is None:
            self._engine = sa.create_engine(self._require_url(), pool_pre_ping=True)
        return self._engine

    @property
    def async_engine(self) -> AsyncEngine:
        """The AsyncEngine used by :meth:`atransaction`, made from the URL on first use."""
        if self._async_engine is None:
            self._async_engine = create_async_engine(self._require_url(), pool_pre_ping=True)
        return self._async_engine

    def _require_url(self) -> str:
        url = self._url or os.environ.get("OUTBOX_DATABASE_URL")
        if not url:
            raise ConfigError(
                "no database: pass an Engine or URL to Outbox(...) or set OUTBOX_DATABASE_URL"
            )
        self._url = url
        return url

    # -- transactions ------------------------------------------------------------------------

    @contextmanager
    def transaction(self) -> Iterator[OutboxTransaction]:
        """Open a Session and a transaction; commit business rows and messages together.

        An exception inside the block rolls everything back and propagates.
        """
        with Session(self.engine, expire_on_commit=False) as session:
            with session.begin():
                tx = OutboxTransaction(self, session)
                yield tx
            # Committed: hand the messages to the immediate sender, if there is one.
            self._after_commit(session)

    @asynccontextmanager
    async def atransaction(self) -> AsyncIterator[AsyncOutboxTransaction]:
        """The asyncio version of :meth:`transaction` (an AsyncSession)."""
        async with AsyncSession(self.async_engine, expire_on_commit=False) as session:
            async with session.begin():
                yield AsyncOutboxTransaction(self, session)
            self._after_commit(session.sync_session)

    # -- publishing ------------------------------------------------------------------------

    def publish(
        self,
        bind: Session | Connection,
        topic: str,
        value: Any = None,
        *,
        key: KeyLike = None,
        headers: HeadersLike = None,
        idempotency_key: str | None = None,
    ) -> PublishResult:
        """Add one message to ``bind``'s current transaction.

        ``value`` goes through the serializer (JSON by default; bytes pass through). ``key`` is
        bytes, str, int or UUID. ``headers`` is a mapping or a list of ``(name, bytes | str)``
        pairs. With ``idempotency_key``, a second publish of the same key writes nothing and
        returns the first message's id with ``duplicate=True``.

        Raises an :class:`~outbox.errors.InvalidMessage` subclass before touching the database
        when the message is bad, :class:`~outbox.errors.NotInTransaction` when ``bind`` has no
        transaction, :class:`~outbox.errors.OutboxTableMissing` when the table is absent.
        """
        message = Message(topic, value, key, headers, idempotency_key)
        return self.publish_many(bind, [message])[0]

    def publish_many(
        self, bind: Session | Connection, messages: Iterable[Message]
    ) -> list[PublishResult]:
        """Add several messages in one statement; results are in the order given.

        Every message is validated first: one bad message means none is written.
        """
        encoded = self._encode(messages)
        if isinstance(bind, Session):
            results = self._write(_session_connection(bind), encoded)
            self._remember(bind, results)
            return results
        if isinstance(bind, Connection):
            return self._write(_checked_connection(bind), encoded)
        raise TypeError(
            f"publish needs a SQLAlchemy Session or Connection, got {type(bind).__name__}"
        )

    async def apublish(
        self,
        bind: AsyncSession | AsyncConnection,
        topic: str,
        value: Any = None,
        *,
        key: KeyLike = None,
        headers: HeadersLike = None,
        idempotency_key: str | None = None,
    ) -> PublishResult:
        """The asyncio version of :meth:`publish`."""
        message = Message(topic, value, key, headers, idempotency_key)
        return (await self.apublish_many(bind, [message]))[0]

    async def apublish_many(
        self, bind: AsyncSession | AsyncConnection, messages: Iterable[Message]
    ) -> list[PublishResult]:
        """The asyncio version of :meth:`publish_many`."""
        encoded = self._encode(messages)
        if isinstance(bind, AsyncSession):

            def write_in_session(session: Session) -> list[PublishResult]:
                results = self._write(_session_connection(session), encoded)
                self._remember(session, results)
                return results

            return await bind.run_sync(write_in_session)
        if isinstance(bind, AsyncConnection):
            if not bind.in_transaction():
                raise NotInTransaction("publish needs a connection inside a transaction: begin()")
            return await bind.run_sync(lambda conn: self._write(_checked_connection(conn), encoded))
        raise TypeError(
            f"apublish needs an AsyncSession or AsyncConnection, got {type(bind).__name__}"
        )

    # -- internals -------------------------------------------------------------------------

    def _encode(self, messages: Iterable[Message]) -> list[EncodedMessage]:
        encoded = []
        for message in messages:
            if not isinstance(message, Message):
                raise TypeError(f"publish_many takes Message objects, got {type(message).__name__}")
            encoded.append(encode_message(message, self.serializer, self.max_message_bytes))
        return encoded

    def _write(self, conn: Connection, encoded: Sequence[EncodedMessage]) -> list[PublishResult]:
        if not encoded:
            return []
        self._verify_table(conn)
        rows = [m.row for m in encoded]
        keys = {m.idempotency_key for m in encoded if m.idempotency_key is not None}
        written: dict[str, uuid.UUID] = {}
        existing: dict[str, uuid.UUID] = {}
        try:
            if not keys:
                conn.execute(self._insert, rows)
            else:
                # One statement for all rows keeps their order; only keyed rows can conflict.
                for row in conn.execute(self._insert_keyed, rows):
                    if row.idempotency_key is not None:
                        written[row.idempotency_key] = row.id
                if missing := keys - set(written):
                    found = conn.execute(self._existing, {"keys": sorted(missing)})
                    existing = {row[0]: row[1] for row in found}
        except exc.ProgrammingError as error:
            translated = _translate(error, self.spec)
            if translated is None:
                raise
            raise translated from error
        results = []
        claimed: set[str] = set()
        for message in encoded:
            ikey = message.idempotency_key
            if ikey is None:
                results.append(PublishResult(message.id))
            elif ikey in written and ikey not in claimed:
                claimed.add(ikey)
                results.append(PublishResult(written[ikey]))
            else:
                results.append(PublishResult(written.get(ikey) or existing[ikey], duplicate=True))
        return results

    def _verify_table(self, conn: Connection) -> None:
        """Check once per database and role that the table exists and takes inserts.

        Done before the first insert so that a missing table or privilege is reported without
        aborting the caller's transaction.
        """
        url = conn.engine.url
        cache_key = f"{url.host}:{url.port}/{url.database}/{url.username}"
        if cache_key in self._verified:
            return
        exists, can_insert = conn.execute(
            sa.text(
                "SELECT t.oid IS NOT NULL, "
                "CASE WHEN t.oid IS NULL THEN false "
                "ELSE has_table_privilege(t.oid, 'INSERT') END "
                "FROM (SELECT to_regclass(:name) AS oid) AS t"
            ),
            {"name": self.spec.qualified_name},
        ).one()
        if not exists:
            raise OutboxTableMissing(
                f"table {self.spec.qualified_name} does not exist: run `outbox db upgrade` "
                "(or include the outbox migrations in your Alembic history)"
            )
        if not can_insert:
            raise PermissionDenied(
                f"role {url.username or '(current)'} may not INSERT into "
                f"{self.spec.qualified_name}: GRANT INSERT ON {self.spec.qualified_name} TO it"
            )
        self._verified.add(cache_key)

    def _remember(self, session: Session, results: list[PublishResult]) -> None:
        """Note new message ids on the session so that they can be sent right after commit."""
        if self.immediate is None:
            return
        ids: list[uuid.UUID] = session.info.setdefault(_SESSION_IDS_KEY, [])
        ids.extend(result.message_id for result in results if not result.duplicate)
        if not event.contains(session, "after_commit", self._after_commit):
            event.listen(session, "after_commit", self._after_commit)
            event.listen(session, "after_rollback", _forget_ids)

    def _after_commit(self, session: Session) -> None:
        ids = session.info.pop(_SESSION_IDS_KEY, None)
        if ids and self.immediate is not None:
            self.immediate.submit(ids)


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


def _session_connection(session: Session) -> Connection:
    try:
        conn = session.connection()  # begins the session's transaction if it has not yet
    except exc.InvalidRequestError as error:
        raise NotInTransaction(f"publish needs a session inside a transaction: {error}") from error
    return _checked_connection(conn, session_owned=True)


def _checked_connection(conn: Connection, session_owned: bool = False) -> Connection:
    if not session_owned and not conn.in_transaction():
        raise NotInTransaction(
            "publish needs a connection inside a transaction: use `with conn.begin():`"
        )
    dbapi_connection = conn.connection.dbapi_connection
    if getattr(dbapi_connection, "autocommit", False):
        raise NotInTransaction(
            "publish refuses an AUTOCOMMIT connection: each statement would commit on its own"
        )
    return conn


def _forget_ids(session: Session) -> None:
    session.info.pop(_SESSION_IDS_KEY, None)


def _translate(error: exc.ProgrammingError, spec: OutboxTableSpec) -> OutboxError | None:
    code = getattr(error.orig, "sqlstate", None)
    if code == "42P01":  # undefined_table
        return OutboxTableMissing(
            f"table {spec.qualified_name} does not exist: run `outbox db upgrade`"
        )
    if code == "42501":  # insufficient_privilege
        return PermissionDenied(f"not allowed to write {spec.qualified_name}: {error.orig}")
    return None
