"""The producer's side of prepared messages: RocketMQ's transactional messages on the outbox.

A plain outbox write is atomic with the business rows of the same database. When the business
step happens elsewhere (a payment provider's API, a second database, another service), there
is no common transaction; a prepared message takes RocketMQ's way instead::

    prepared = PreparedMessages(Outbox(engine))

    message = prepared.prepare("orders", {"type": "OrderPlaced", "id": 7}, key=7)
    # committed in a short transaction of its own, and invisible to the relay
    try:
        create_order_in_the_other_database(7)
    except OrderRefused:  # refused before anything was written: surely not done
        message.rollback()  # never published
        raise
    # any other exception leaves it prepared: the step may have happened, the checker tells
    message.commit()  # pending from now on: the relay publishes it

If the process dies before ``commit()`` or ``rollback()``, the check-back runner of the
service asks its checker (see :mod:`outbox.prepared.checkers`). The one-call form,
:meth:`PreparedMessages.send_in_transaction`, mirrors RocketMQ's ``sendMessageInTransaction``.
"""

from __future__ import annotations

import inspect
import logging
import math
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, TypeAlias

import sqlalchemy as sa
from sqlalchemy.exc import SQLAlchemyError

from outbox.errors import (
    ConfigError,
    IdempotencyKeyTaken,
    NotPrepared,
    NotRolledBack,
    OutboxError,
)
from outbox.ids import as_message_id
from outbox.message import NO_KEY, EncodedMessage, Message, NoKey, encode_message
from outbox.prepared.answers import COMMIT, ROLLBACK, UNKNOWN, Answer, parse_answer
from outbox.prepared.checkers import validate_group
from outbox.prepared.store import CHECK, EXPIRED, OPERATOR, PRODUCER, UNRESOLVED, PreparedStore
from outbox.publisher import Outbox
from outbox.schema import CANCELLED, DEAD, PENDING, PREPARED, ROLLED_BACK, SCHEDULED, SENT
from outbox.tracing import current_trace_headers
from outbox.validation import HeadersLike, KeyLike

log = logging.getLogger("outbox.prepared")

#: Seconds from prepare to the first check-back, unless the producer says otherwise: longer
#: than the business step normally takes (RocketMQ's transactionTimeout, 6 s there).
DEFAULT_CHECK_AFTER = 60.0

#: The longest check_after (ten years): more is a mistake, and overflows the database's
#: interval arithmetic.
MAX_CHECK_AFTER = 10 * 365 * 86400.0

#: Where a committed message may stand (a scheduled one may be cancelled after its commit).
COMMITTED = (PENDING, SENT, SCHEDULED, CANCELLED)

LocalTransaction: TypeAlias = Callable[[uuid.UUID], "Answer | str"]
AsyncLocalTransaction: TypeAlias = Callable[[uuid.UUID], "Answer | str | Awaitable[Answer | str]"]


@dataclass(frozen=True)
class Prepared:
    """A prepared message: :meth:`commit` or :meth:`rollback` it once the business step is
    done (``acommit``/``arollback`` from asyncio).

    ``duplicate`` is true when its idempotency key was prepared (or published) before: then
    ``message_id`` is that earlier message's and nothing new was written.
    """

    message_id: uuid.UUID
    duplicate: bool = False
    _messages: PreparedMessages | None = field(default=None, repr=False, compare=False)

    def commit(self) -> None:
        """:meth:`PreparedMessages.commit` of this message."""
        self._owner.commit(self.message_id)

    def rollback(self) -> None:
        """:meth:`PreparedMessages.rollback` of this message."""
        self._owner.rollback(self.message_id)

    async def acommit(self) -> None:
        """:meth:`PreparedMessages.acommit` of this message."""
        await self._owner.acommit(self.message_id)

    async def arollback(self) -> None:
        """:meth:`PreparedMessages.arollback` of this message."""
        await self._owner.arollback(self.message_id)

    @property
    def _owner(self) -> PreparedMessages:
        if self._messages is None:
            raise ConfigError("this Prepared was made by hand: use PreparedMessages.commit(id)")
        return self._messages


@dataclass(frozen=True)
class TransactionResult:
    """What :meth:`PreparedMessages.send_in_transaction` did."""

    message_id: uuid.UUID
    #: What the local transaction answered.
    answer: Answer
    #: Whether the message is decided: committed or rolled back as answered. False after
    #: UNKNOWN, or when the database could not be told: check-back then decides it.
    resolved: bool
    #: The message's idempotency key was taken already: nothing was prepared and ``local``
    #: did not run. ``message_id`` is the earlier message's, and ``answer`` and ``resolved``
    #: say where it stands: COMMIT when it was committed (or published as a plain message),
    #: UNKNOWN (not resolved) while it waits for a verdict.
    duplicate: bool = False


class PreparedMessages:
    """Prepared messages on ``outbox``'s table (its engine, serializer and size limit).

    ``group``: the name the service's checker is registered under (RocketMQ's producer
    group); by default each message's topic. ``check_after``: how long after prepare the
    first check-back may come (seconds or a ``timedelta``; default 60 s); give the business
    step time to finish, a check that comes too early only answers UNKNOWN.
    """

    def __init__(
        self,
        outbox: Outbox,
        *,
        group: str | None = None,
        check_after: float | timedelta = DEFAULT_CHECK_AFTER,
    ) -> None:
        if not isinstance(outbox, Outbox):
            raise ConfigError(f"PreparedMessages needs an outbox.Outbox, got {type(outbox)}")
        self.outbox = outbox
        self.group = None if group is None else validate_group(group)
        self.check_after = _seconds(check_after)
        self.store = PreparedStore(outbox.spec)

    # -- prepare ------------------------------------------------------------------------------

    def prepare(
        self,
        topic: str,
        value: Any = None,
        *,
        key: KeyLike | NoKey = NO_KEY,
        headers: HeadersLike = None,
        idempotency_key: str | None = None,
        group: str | None = None,
        check_after: float | timedelta | None = None,
        type: str | None = None,
        subject: str | None = None,
        deliver_after: float | timedelta | None = None,
        deliver_at: datetime | None = None,
    ) -> Prepared:
        """Write a prepared message in a transaction of its own and commit it.

        The relay does not see it until :meth:`commit`. The message is validated and
        serialized as :meth:`outbox.Outbox.publish` does it (``key`` left out means no key;
        ``key=None`` is refused there too): bad input raises an
        :class:`~outbox.errors.InvalidMessage` subclass (and a bad ``group`` or
        ``check_after`` a :class:`~outbox.errors.ConfigError`) before anything is written.
        With a CloudEvents envelope, ``type`` and ``subject`` are the event's, and its
        ``time`` is the time of ``prepare()``.
        ``deliver_after``/``deliver_at`` (counted from now) schedule it: committed before
        it is due, it waits as a scheduled message (docs/scheduled.md).
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
        return self._insert_sync(*self._checked(message, group, check_after))

    async def aprepare(
        self,
        topic: str,
        value: Any = None,
        *,
        key: KeyLike | NoKey = NO_KEY,
        headers: HeadersLike = None,
        idempotency_key: str | None = None,
        group: str | None = None,
        check_after: float | timedelta | None = None,
        type: str | None = None,
        subject: str | None = None,
        deliver_after: float | timedelta | None = None,
        deliver_at: datetime | None = None,
    ) -> Prepared:
        """The asyncio version of :meth:`prepare`."""
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
        return await self._insert_async(*self._checked(message, group, check_after))

    # -- commit and rollback ------------------------------------------------------------------

    def commit(self, message_id: uuid.UUID | str, *, after_rollback: bool = False) -> None:
        """Commit a prepared message: it becomes pending, and the relay publishes it.

        It takes its place among its key's messages now, after every message of the key
        committed before it. Committing a message already committed does nothing; one that
        was rolled back (by a check, say) raises :class:`~outbox.errors.NotPrepared`.

        ``after_rollback=True`` commits a message that check-back or an operator rolled back
        when its step committed after all: the answer to a ``NotPrepared`` after the step
        committed (docs/prepared-messages.md). It takes back the idempotency key it gave up at
        the rollback. A message rolled back by its producer still raises ``NotPrepared``, one
        whose key another message took since the rollback (a retry of the same event)
        :class:`~outbox.errors.IdempotencyKeyTaken`, and one still waiting for a verdict
        (prepared, or dead for an operator) :class:`~outbox.errors.NotRolledBack`.
        """
        self._decide_sync(as_message_id(message_id), COMMIT, after_rollback)

    def rollback(self, message_id: uuid.UUID | str) -> None:
        """Roll a prepared message back: it is never published. Rolling back one already
        rolled back does nothing; one already committed raises
        :class:`~outbox.errors.NotPrepared` (it may be on its topic already)."""
        self._decide_sync(as_message_id(message_id), ROLLBACK)

    async def acommit(self, message_id: uuid.UUID | str, *, after_rollback: bool = False) -> None:
        """The asyncio version of :meth:`commit`."""
        await self._decide_async(as_message_id(message_id), COMMIT, after_rollback)

    async def arollback(self, message_id: uuid.UUID | str) -> None:
        """The asyncio version of :meth:`rollback`."""
        await self._decide_async(as_message_id(message_id), ROLLBACK)

    # -- the one-call form --------------------------------------------------------------------

    def send_in_transaction(
        self,
        message: Message,
        local: LocalTransaction,
        *,
        group: str | None = None,
        check_after: float | timedelta | None = None,
    ) -> TransactionResult:
        """Prepare ``message``, run ``local(message_id)``, then do what it answers.

        ``local`` runs the business step (RocketMQ's ``executeLocalTransaction``) and answers
        COMMIT, ROLLBACK or UNKNOWN. UNKNOWN leaves the message prepared for check-back.

        **An exception from ``local`` counts as UNKNOWN**, as in RocketMQ: the message stays
        prepared and the exception propagates. The step may have happened before it failed
        (a timeout from the payment provider after it took the money), so only a checker
        that looks at the step's outcome can tell; rolling back here could lose the message
        of a step that did happen. An answer that is none of the three raises
        :class:`~outbox.errors.InvalidAnswer` and also leaves the message prepared.

        If the database cannot be told the answer (it is out of reach), the result says
        ``resolved=False`` and check-back decides the message later. A permanent failure (the
        table missing, a privilege missing) raises its :class:`~outbox.errors.OutboxError`.

        **A message whose idempotency key is taken does not run ``local``**: the key says the
        step was done (or is under way) with the earlier message, so the result says
        ``duplicate=True`` and where that message stands (see :class:`TransactionResult`). A
        rolled-back message gives its key up: a retry after a rollback runs the step again.
        """
        if not callable(local) or inspect.iscoroutinefunction(local):
            raise ConfigError("local must be a plain function; use asend_in_transaction for async")
        prepared = self._insert_sync(*self._checked(message, group, check_after))
        message_id = prepared.message_id
        if prepared.duplicate:
            with self.outbox.engine.connect() as conn:
                return _existing(message_id, self.store.statuses(conn, [message_id]))
        answer = parse_answer(self._run_local(local, message_id), "the local transaction")
        if answer is UNKNOWN:
            return TransactionResult(message_id, answer, False)
        try:
            self._decide_sync(message_id, answer)
        except SQLAlchemyError as exc:
            return _left_to_check_back(message_id, answer, exc)
        return TransactionResult(message_id, answer, True)

    async def asend_in_transaction(
        self,
        message: Message,
        local: AsyncLocalTransaction,
        *,
        group: str | None = None,
        check_after: float | timedelta | None = None,
    ) -> TransactionResult:
        """The asyncio version of :meth:`send_in_transaction`; ``local`` may be a coroutine
        function or a plain one."""
        if not callable(local):
            raise ConfigError("local must be callable")
        prepared = await self._insert_async(*self._checked(message, group, check_after))
        message_id = prepared.message_id
        if prepared.duplicate:
            async with self.outbox.async_engine.connect() as conn:
                statuses = await conn.run_sync(lambda sync: self.store.statuses(sync, [message_id]))
            return _existing(message_id, statuses)
        raw = self._run_local(local, message_id)
        if inspect.isawaitable(raw):
            try:
                raw = await raw
            except BaseException:
                _local_failed(message_id)
                raise
        answer = parse_answer(raw, "the local transaction")
        if answer is UNKNOWN:
            return TransactionResult(message_id, answer, False)
        try:
            await self._decide_async(message_id, answer)
        except SQLAlchemyError as exc:
            return _left_to_check_back(message_id, answer, exc)
        return TransactionResult(message_id, answer, True)

    # -- internals ----------------------------------------------------------------------------

    def _insert_sync(self, encoded: EncodedMessage, group: str, after: float) -> Prepared:
        with self.outbox.engine.begin() as conn:
            message_id, duplicate = self.store.insert(conn, encoded, group, after)
        return Prepared(message_id, duplicate, self)

    async def _insert_async(self, encoded: EncodedMessage, group: str, after: float) -> Prepared:
        async with self.outbox.async_engine.begin() as conn:
            message_id, duplicate = await conn.run_sync(
                lambda sync: self.store.insert(sync, encoded, group, after)
            )
        return Prepared(message_id, duplicate, self)

    def _checked(
        self, message: Message, group: str | None, check_after: float | timedelta | None
    ) -> tuple[EncodedMessage, str, float]:
        """Validate everything before a row is written."""
        if not isinstance(message, Message):
            raise TypeError(f"expected an outbox.Message, got {type(message).__name__}")
        encoded = encode_message(
            message,
            self.outbox.serializer,
            self.outbox.max_message_bytes,
            current_trace_headers(),
            self.outbox.envelope,
        )
        name = validate_group(group) if group is not None else (self.group or message.topic)
        after = self.check_after if check_after is None else _seconds(check_after)
        return encoded, name, after

    @staticmethod
    def _run_local(local: Callable[[uuid.UUID], Any], message_id: uuid.UUID) -> Any:
        try:
            return local(message_id)
        except BaseException:
            _local_failed(message_id)
            raise

    def _decide_sync(
        self, message_id: uuid.UUID, answer: Answer, after_rollback: bool = False
    ) -> None:
        with self.outbox.engine.begin() as conn:
            self._decide(conn, message_id, answer, after_rollback)

    async def _decide_async(
        self, message_id: uuid.UUID, answer: Answer, after_rollback: bool = False
    ) -> None:
        async with self.outbox.async_engine.begin() as conn:
            await conn.run_sync(lambda sync: self._decide(sync, message_id, answer, after_rollback))

    def _decide(
        self, conn: sa.Connection, message_id: uuid.UUID, answer: Answer, after_rollback: bool
    ) -> None:
        with self.store.typed_errors():
            if answer is COMMIT:
                done = self.store.commit(
                    conn, [message_id], PRODUCER, after_rollback=after_rollback
                )
            else:
                done = self.store.rollback(conn, [message_id], PRODUCER)
        if done:
            return
        if answer is COMMIT and after_rollback:
            row = self.store.rolled_back_statuses(conn, [message_id]).get(message_id)
            refusal = after_rollback_refusal(message_id, row)
            if refusal is not None:
                raise refusal
            return
        row = self.store.statuses(conn, [message_id]).get(message_id)
        already_decided(message_id, row, answer)


def already_decided(
    message_id: uuid.UUID, row: Mapping[str, Any] | sa.RowMapping | None, answer: Answer
) -> None:
    """After a commit or rollback that changed nothing: return when the message (``row``:
    its status) was already decided the same way; raise :class:`~outbox.errors.NotPrepared`
    otherwise."""
    if row is None or row["prepared_at"] is None:
        status = None if row is None else row["status"]
        raise NotPrepared(f"no prepared message {message_id}", message_id=message_id, status=status)
    status = row["status"]
    committed = status in COMMITTED or (status == DEAD and row["error_kind"] != UNRESOLVED)
    if (answer is COMMIT and committed) or (answer is ROLLBACK and status == ROLLED_BACK):
        return
    decided = "committed" if committed else "rolled back"
    wanted = "committed" if answer is COMMIT else "rolled back"
    hint = ": it may be on its topic already" if committed else ""
    if answer is COMMIT and row["resolved_by"] in (CHECK, EXPIRED, OPERATOR):
        hint = (
            ": if its step did happen, commit it with commit(id, after_rollback=True) or "
            f"`outbox prepared commit --after-rollback {message_id}`"
        )
    raise NotPrepared(
        f"message {message_id} was already {decided} (by {row['resolved_by'] or 'unknown'}), "
        f"it cannot be {wanted}{hint}",
        message_id=message_id,
        status=status,
    )


def after_rollback_refusal(
    message_id: uuid.UUID, row: Mapping[str, Any] | sa.RowMapping | None
) -> OutboxError | None:
    """Why a commit after a rollback changed nothing (``row``: the message's
    :meth:`~outbox.prepared.store.PreparedStore.rolled_back_statuses`), as the error to raise;
    None when the message is committed already (doing it again is nothing)."""
    if row is None or row["prepared_at"] is None:
        status = None if row is None else row["status"]
        return NotPrepared(
            f"no prepared message {message_id}", message_id=message_id, status=status
        )
    status = row["status"]
    if status == PREPARED or (status == DEAD and row["error_kind"] == UNRESOLVED):
        where = (
            "is still prepared"
            if status == PREPARED
            else "is dead, left for an operator by check-back"
        )
        return NotRolledBack(
            f"message {message_id} {where}, not rolled back: it waits for a verdict; commit "
            f"it without after_rollback (`outbox prepared commit {message_id}`)",
            message_id=message_id,
            status=status,
        )
    if status != ROLLED_BACK:
        return None  # committed: the commit happened already
    if row["resolved_by"] == PRODUCER:
        return NotPrepared(
            f"message {message_id} was rolled back by its producer: it stays rolled back",
            message_id=message_id,
            status=status,
        )
    if row["key_holder"] is not None:
        key = row["released_idempotency_key"]
        return IdempotencyKeyTaken(
            f"message {message_id} gave its idempotency key {key!r} up at its rollback, and "
            f"message {row['key_holder']} took it since (a retry of the same event): "
            "committing this one too would publish the event twice",
            message_id=message_id,
            idempotency_key=key,
            holder=row["key_holder"],
        )
    return NotPrepared(  # taken and released again meanwhile: the caller may try again
        f"message {message_id} could not be committed after its rollback: try again",
        message_id=message_id,
        status=status,
    )


def _existing(
    message_id: uuid.UUID, statuses: Mapping[uuid.UUID, Mapping[str, Any] | sa.RowMapping]
) -> TransactionResult:
    """The result of a send whose idempotency key was taken by ``message_id``: where that
    message stands (``statuses``: its status row, if it still has one)."""
    row = statuses.get(message_id)
    status = None if row is None else row["status"]
    if row is not None and row["prepared_at"] is None:  # a plain message: it was written
        committed = True
    else:
        committed = status in COMMITTED or (
            status == DEAD and row is not None and row["error_kind"] != UNRESOLVED
        )
    if committed:
        return TransactionResult(message_id, COMMIT, True, duplicate=True)
    if status == ROLLED_BACK:
        return TransactionResult(message_id, ROLLBACK, True, duplicate=True)
    return TransactionResult(message_id, UNKNOWN, False, duplicate=True)


def _local_failed(message_id: uuid.UUID) -> None:
    log.warning(
        "local transaction raised: the message stays prepared and check-back decides it",
        extra={"message_id": str(message_id)},
    )


def _left_to_check_back(
    message_id: uuid.UUID, answer: Answer, error: SQLAlchemyError
) -> TransactionResult:
    log.warning(
        f"could not {answer} the message: it stays prepared and check-back decides it",
        extra={"message_id": str(message_id), "error": str(error).splitlines()[0]},
    )
    return TransactionResult(message_id, answer, False)


def _seconds(value: object) -> float:
    seconds = value.total_seconds() if isinstance(value, timedelta) else value
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, int | float)
        or not math.isfinite(seconds)
        or not 0 <= seconds <= MAX_CHECK_AFTER
    ):
        raise ConfigError(
            "check_after must be a number of seconds from 0 to "
            f"{MAX_CHECK_AFTER:g} (ten years), got {value!r}"
        )
    return float(seconds)
