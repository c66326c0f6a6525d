"""The publish API: write outbox rows inside the caller's database transaction."""

from __future__ import annotations

import functools
import os
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, asynccontextmanager, contextmanager
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy import event, exc
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from outbox.binds import checked_connection as _checked_connection
from outbox.binds import session_connection as _session_connection
from outbox.cloudevents import CloudEvents
from outbox.database_errors import constraint_of, sqlstate_of
from outbox.errors import (
    ConfigError,
    NotInTransaction,
    OutboxError,
    OutboxTableMissing,
    PermissionDenied,
)
from outbox.message import (
    NO_KEY,
    EncodedMessage,
    Message,
    NoKey,
    PublishResult,
    encode_message,
)
from outbox.schema import OutboxTableSpec
from outbox.serialization import JsonSerializer, Serializer
from outbox.tracing import current_trace_headers
from outbox.transactions import AsyncOutboxTransaction, OutboxTransaction
from outbox.validation import HeadersLike, KeyLike

if TYPE_CHECKING:
    from outbox.immediate import ImmediateSender

#: Kafka's default producer limit (message.max.bytes); raise it with the topic's own limit.
DEFAULT_MAX_MESSAGE_BYTES = 1_000_000

_SESSION_IDS_KEY = "outbox.published_ids"

#: Rounds of look-up-then-insert before concurrent writers of the same keys give up.
KEYED_WRITE_ATTEMPTS = 5


class Outbox:
    """Writes messages to the outbox table in the same transaction as the business rows.

    >>> ob = Outbox("postgresql+psycopg://app@localhost/shop")      # doctest: +SKIP
    >>> with ob.transaction() as tx:                                 # doctest: +SKIP
    ...     tx.session.add(order)
    ...     tx.session.flush()  # a generated order.id is None until the INSERT runs
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
        envelope: CloudEvents | None = None,
    ) -> None:
        if not isinstance(max_message_bytes, int) or max_message_bytes <= 0:
            raise ConfigError(
                f"max_message_bytes must be a positive int, got {max_message_bytes!r}"
            )
        if serializer is not None and not isinstance(serializer, Serializer):
            raise ConfigError("serializer must have serialize(value) and content_type")
        if envelope is not None and not isinstance(envelope, CloudEvents):
            raise ConfigError(
                f"envelope must be an outbox.cloudevents.CloudEvents, got {type(envelope).__name__}"
            )
        self.spec = OutboxTableSpec(schema=schema, table=table)
        self.serializer: Serializer = serializer or JsonSerializer()
        self.max_message_bytes = max_message_bytes
        self.immediate = immediate
        #: Writes each message as a CloudEvent when set (docs/cloudevents.md).
        self.envelope = envelope
        self._url = bind if isinstance(bind, str) else None
        self._engine = bind if isinstance(bind, Engine) else None
        self._async_engine = bind if isinstance(bind, AsyncEngine) else None
        # Engines (database + role) whose outbox table was found writable.
        self._verified: weakref.WeakSet[Engine] = weakref.WeakSet()
        table_obj = self.spec.table_obj
        self._insert = table_obj.insert()
        self._driver_sql: dict[tuple[str, ...], str] = {}
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
        with Session(self.engine, expire_on_commit=False) as session, session.begin():
            yield OutboxTransaction(self, session)

    @asynccontextmanager
    async def atransaction(self) -> AsyncIterator[AsyncOutboxTransaction]:
        """The asyncio version of :meth:`transaction` (an AsyncSession)."""
        async with (
            AsyncSession(self.async_engine, expire_on_commit=False) as session,
            session.begin(),
        ):
            yield AsyncOutboxTransaction(self, session)

    # -- publishing ------------------------------------------------------------------------

    def publish(
        self,
        bind: Session | Connection,
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
    ) -> PublishResult:
        """Add one message to ``bind``'s current transaction.

        ``value`` goes through the serializer (JSON by default; bytes pass through). ``key`` is
        bytes, str, int or UUID; leave it out (or pass :data:`outbox.NO_KEY`) for a message
        without one. ``key=None`` is refused with :class:`~outbox.errors.InvalidKey`: it is
        most often an id the database has not generated yet (flush the session first).
        ``headers`` is a mapping or a list of ``(name, bytes | str)``
        pairs. With ``idempotency_key``, a second publish of the same key writes nothing and
        returns the first message's id with ``duplicate=True``. ``deliver_after`` (seconds or
        a timedelta) or ``deliver_at`` (an aware datetime) schedule the message: the relay
        sends it when it is due, not before (docs/scheduled.md). ``type`` and ``subject``
        are the CloudEvents attributes of an outbox made with ``envelope=CloudEvents(...)``
        (``type`` defaults to the topic's type there; see docs/cloudevents.md).

        Raises an :class:`~outbox.errors.InvalidMessage` subclass before touching the database
        when the message is bad, :class:`~outbox.errors.NotInTransaction` when ``bind`` has no
        transaction, :class:`~outbox.errors.OutboxTableMissing` when the table is absent.
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
        return self.publish_many(bind, [message])[0]

    def publish_many(
        self, bind: Session | Connection, messages: Iterable[Message]
    ) -> list[PublishResult]:
        """Add several messages in one statement; results are in the order given.

        Every message is validated first: one bad message means none is written.
        """
        encoded = self._encode(messages)
        if isinstance(bind, Session):
            results = self._write(
                _session_connection(bind),
                encoded,
                functools.partial(_session_savepoint, bind),
                leased=self.immediate is not None,
            )
            self._remember(bind, results, encoded)
            return results
        if isinstance(bind, Connection):
            return self._write(_checked_connection(bind), encoded, bind.begin_nested)
        raise TypeError(
            f"publish needs a SQLAlchemy Session or Connection, got {type(bind).__name__}"
        )

    async def apublish(
        self,
        bind: AsyncSession | AsyncConnection,
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
    ) -> PublishResult:
        """The asyncio version of :meth:`publish`."""
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
        return (await self.apublish_many(bind, [message]))[0]

    async def apublish_many(
        self, bind: AsyncSession | AsyncConnection, messages: Iterable[Message]
    ) -> list[PublishResult]:
        """The asyncio version of :meth:`publish_many`."""
        encoded = self._encode(messages)
        if isinstance(bind, AsyncSession):

            def write_in_session(session: Session) -> list[PublishResult]:
                savepoint = functools.partial(_session_savepoint, session)
                results = self._write(
                    _session_connection(session),
                    encoded,
                    savepoint,
                    leased=self.immediate is not None,
                )
                self._remember(session, results, encoded)
                return results

            return await bind.run_sync(write_in_session)
        if isinstance(bind, AsyncConnection):
            if not bind.in_transaction():
                raise NotInTransaction("publish needs a connection inside a transaction: begin()")
            return await bind.run_sync(
                lambda conn: self._write(_checked_connection(conn), encoded, conn.begin_nested)
            )
        raise TypeError(
            f"apublish needs an AsyncSession or AsyncConnection, got {type(bind).__name__}"
        )

    # -- internals -------------------------------------------------------------------------

    def _encode(self, messages: Iterable[Message]) -> list[EncodedMessage]:
        encoded = []
        trace = current_trace_headers()  # the caller's trace context, once per call
        for message in messages:
            if not isinstance(message, Message):
                raise TypeError(f"publish_many takes Message objects, got {type(message).__name__}")
            encoded.append(
                encode_message(
                    message, self.serializer, self.max_message_bytes, trace, self.envelope
                )
            )
        return encoded

    def _write(
        self,
        conn: Connection,
        encoded: Sequence[EncodedMessage],
        savepoint: Callable[[], AbstractContextManager[Any]],
        leased: bool = False,
    ) -> list[PublishResult]:
        """Insert ``encoded``; ``leased``: for the immediate sender, which sends them after
        commit (the rows are written leased to it, so the relay leaves them alone)."""
        if not encoded:
            return []
        self._verify_table(conn)
        try:
            if all(m.idempotency_key is None for m in encoded):
                self._insert_rows(conn, encoded, leased)
                return [PublishResult(m.id) for m in encoded]
            return self._write_keyed(conn, encoded, savepoint, leased)
        except exc.ProgrammingError as error:
            translated = translate_table_error(error, self.spec)
            if translated is None:
                raise
            raise translated from error

    def _insert_rows(
        self, conn: Connection, messages: Sequence[EncodedMessage], leased: bool
    ) -> None:
        """INSERT ``messages``: those to send at once, then the scheduled ones (never leased
        to the immediate sender, and with columns of their own)."""
        for scheduled in (False, True):
            rows = [m.row for m in messages if (m.deliver_at is not None) == scheduled]
            if rows:
                self._insert_same(conn, _same_columns(rows), leased and not scheduled)

    def _insert_same(self, conn: Connection, rows: list[dict[str, Any]], leased: bool) -> None:
        """INSERT ``rows`` (all with the same columns) in one statement.

        With psycopg the statement is compiled by Core once per column set and then run as
        driver SQL: the hot path skips Core's per-call compile-cache and parameter work.
        """
        insert = self._insert
        if leased:
            assert self.immediate is not None
            owner = self.immediate.owner
            rows = [{**row, "lease_owner": owner} for row in rows]
            # The database's clock at the insert, as the relay's read compares it with now().
            seconds = float(self.immediate.lease_seconds)
            insert = insert.values(
                lease_until=sa.literal_column(
                    f"clock_timestamp() + make_interval(secs => {seconds!r})"
                )
            )
        dialect = conn.dialect
        if dialect.driver != "psycopg" or dialect.paramstyle != "pyformat":
            conn.execute(insert, rows)
            return
        columns = tuple(rows[0])
        statement = self._driver_sql.get(columns)
        if statement is None:
            compiled = insert.compile(dialect=dialect, column_keys=list(columns))
            statement = self._driver_sql[columns] = str(compiled)
        conn.exec_driver_sql(statement, rows[0] if len(rows) == 1 else rows)

    def _write_keyed(
        self,
        conn: Connection,
        encoded: Sequence[EncodedMessage],
        savepoint: Callable[[], AbstractContextManager[Any]],
        leased: bool,
    ) -> list[PublishResult]:
        """Write a batch with idempotency keys: the first message of each new key wins.

        Keys already stored are looked up first; the insert runs in a savepoint, so that a
        concurrent transaction committing the same key meanwhile costs a retry of this step,
        never the caller's transaction. (Not ON CONFLICT: a table still at revision 0002 has a
        NOTIFY rule, and rules forbid it.)
        """
        first: dict[str, EncodedMessage] = {}
        for message in encoded:
            if message.idempotency_key is not None:
                first.setdefault(message.idempotency_key, message)
        for _ in range(KEYED_WRITE_ATTEMPTS):
            found = conn.execute(self._existing, {"keys": list(first)})
            existing: dict[str, uuid.UUID] = {row[0]: row[1] for row in found}
            fresh = [
                m
                for m in encoded
                if m.idempotency_key is None
                or (first[m.idempotency_key] is m and m.idempotency_key not in existing)
            ]
            try:
                with savepoint():
                    if fresh:
                        self._insert_rows(conn, fresh, leased)
            except exc.IntegrityError as error:
                if constraint_of(error) != self.spec.idempotency_index:
                    raise
                continue  # a concurrent transaction committed one of the keys: look again
            written = {id(m) for m in fresh}
            return [
                PublishResult(m.id) if id(m) in written else _duplicate(m, existing, first)
                for m in encoded
            ]
        raise OutboxError(
            "idempotency keys kept colliding with concurrent transactions; retry the "
            "transaction (under REPEATABLE READ a committed duplicate stays invisible)"
        )

    def _verify_table(self, conn: Connection) -> None:
        """Check once per database and role that the table exists and takes inserts.

        Done before the first insert so that a missing table or privilege is reported without
        aborting the caller's transaction.
        """
        engine = conn.engine
        if engine in self._verified:
            return
        url = engine.url
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
        self._verified.add(engine)

    def _remember(
        self, session: Session, results: list[PublishResult], encoded: Sequence[EncodedMessage]
    ) -> None:
        """Note new message ids on the session so that they can be sent right after commit
        (not a scheduled message's: the relay sends it when it is due)."""
        if self.immediate is None:
            return
        ids: list[uuid.UUID] = session.info.setdefault(_SESSION_IDS_KEY, [])
        ids.extend(
            result.message_id
            for result, message in zip(results, encoded, strict=True)
            if not result.duplicate and message.deliver_at is None
        )
        if not event.contains(session, "after_commit", self._after_commit):
            event.listen(session, "after_commit", self._after_commit)
            event.listen(session, "after_rollback", _forget_ids)

    def _after_commit(self, session: Session) -> None:
        ids = session.info.pop(_SESSION_IDS_KEY, None)
        if ids and self.immediate is not None:
            self.immediate.submit(ids)


@contextmanager
def _session_savepoint(session: Session) -> Iterator[None]:
    with session.begin_nested():
        session.connection()  # emit the SAVEPOINT now: the insert runs on the Connection itself
        yield


def _duplicate(
    message: EncodedMessage, existing: dict[str, uuid.UUID], first: dict[str, EncodedMessage]
) -> PublishResult:
    key = message.idempotency_key
    assert key is not None
    return PublishResult(existing.get(key) or first[key].id, duplicate=True)


def _same_columns(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Give every row of a multi-row INSERT the same columns (NULL where one has none)."""
    if len(rows) == 1:
        return rows
    columns: dict[str, None] = {}
    for row in rows:
        columns.update(dict.fromkeys(row))
    if all(len(row) == len(columns) for row in rows):
        return rows
    return [{name: row.get(name) for name in columns} for row in rows]


def _forget_ids(session: Session) -> None:
    session.info.pop(_SESSION_IDS_KEY, None)


def translate_table_error(error: exc.ProgrammingError, spec: OutboxTableSpec) -> OutboxError | None:
    """The outbox error for a write refused because the table is missing or not writable."""
    code = sqlstate_of(error)
    if code == "42P01":  # undefined_table
        return OutboxTableMissing(
            f"table {spec.qualified_name} does not exist: run `outbox db upgrade`"
        )
    if code == "42501":  # insufficient_privilege
        return PermissionDenied(f"not allowed to write {spec.qualified_name}: {error.orig}")
    return None
