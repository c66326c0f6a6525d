"""A checker that cannot lie: the business step records its message id, the checker answers
by that id, and answers ROLLBACK only after making sure the step can never record it.

A checker that looks the business row up by a business key (the order id) answers for any
message about that key: a retried step that failed on a duplicate key gets COMMIT for the
first attempt's row, and two messages are published. One that answers ROLLBACK when "the
step should have ended by now" lies whenever the step runs late (a lock wait, a pause), and
the step commits after its message was rolled back.

:class:`StepLog` closes both holes with one small table in the step's own database::

    steps = StepLog()  # the table outbox_steps: steps.create(orders_db) once

    def local(message_id):  # the step, in the orders database
        with orders_db.begin() as conn:
            steps.record(conn, message_id)  # first, in the step's transaction
            conn.execute(insert(orders).values(...))
        return COMMIT

    @registry.checker("order-service")
    def order_created(message):
        return steps.answer(orders_db, message)

:meth:`StepLog.record` writes the message id in the step's transaction: it commits if and
only if the step does. :meth:`StepLog.answer` answers COMMIT when that row is there;
otherwise it writes the id itself, marked *abandoned*, and commits that before answering
ROLLBACK: from then on the step's :meth:`~StepLog.record` fails
(:class:`StepAbandoned`), so the step can no longer happen. While the step's
transaction is still open (its row written, not committed), the checker's write waits for it
at most ``lock_timeout`` and raises :class:`StepInProgress` (a failed check): it is asked
again later.
"""

from __future__ import annotations

import uuid
from datetime import timedelta

import sqlalchemy as sa
from sqlalchemy import exc
from sqlalchemy.dialects import postgresql as pg

from outbox.database_errors import sqlstate_of
from outbox.errors import ConfigError, OutboxError
from outbox.prepared.answers import COMMIT, ROLLBACK, UNKNOWN, Answer
from outbox.prepared.checkers import CheckMessage
from outbox.validation import validate_identifier

#: The step recorded its message: it happened.
DONE = "done"
#: The checker recorded the message first: the step can never happen with it.
ABANDONED = "abandoned"

_LOCK_NOT_AVAILABLE = "55P03"


class StepAbandoned(OutboxError):
    """Check-back abandoned the message before the step recorded it: the step must not
    happen (roll its transaction back); the message is, or will be, rolled back."""

    def __init__(self, text: str, *, message_id: uuid.UUID) -> None:
        super().__init__(text)
        self.message_id = message_id


class StepInProgress(OutboxError):
    """The step's transaction still holds the message id when the checker would abandon it:
    undecided. Raised by :meth:`StepLog.answer` so that the check counts as a failed one:
    check-back never ends such a message rolled back (at ``max_checks`` it ends dead, for an
    operator), since the step can still commit."""


class StepLog:
    """The message ids of business steps, in a table of the step's own database.

    ``table``/``schema``: where it lives (``outbox_steps`` in the connection's default
    schema). Rows are small (an id, an outcome, a time); delete those older than the
    longest a message may stay prepared (``check_after`` plus every check) when they pile
    up.
    """

    def __init__(self, table: str = "outbox_steps", schema: str | None = None) -> None:
        validate_identifier(table, "step table")
        if schema is not None:
            validate_identifier(schema, "step schema")
        self.table = sa.Table(
            table,
            sa.MetaData(),
            sa.Column("message_id", sa.Uuid(as_uuid=True), primary_key=True),
            sa.Column("outcome", sa.Text, nullable=False),
            sa.Column(
                "recorded_at",
                sa.DateTime(timezone=True),
                nullable=False,
                server_default=sa.func.now(),
            ),
            sa.CheckConstraint(f"outcome IN ('{DONE}', '{ABANDONED}')"),
            schema=schema,
        )

    def create(self, bind: sa.Engine | sa.Connection) -> None:
        """Create the table if it does not exist (or add :attr:`table` to your migrations)."""
        self.table.create(bind, checkfirst=True)

    def record(self, conn: sa.Connection, message_id: uuid.UUID) -> None:
        """Record, in the step's open transaction, that the step happens with
        ``message_id``; call it first in that transaction. Raises
        :class:`StepAbandoned` when check-back abandoned the message (the
        transaction must then roll back: the message is, or will be, rolled back). Recording
        the same id twice is fine."""
        outcome = conn.execute(self._insert(message_id, DONE)).scalar()
        if outcome is None:
            outcome = conn.execute(self._outcome(message_id)).scalar()
        if outcome == ABANDONED:
            raise StepAbandoned(
                f"check-back abandoned message {message_id}: the step must not happen with it",
                message_id=message_id,
            )

    def answer(
        self,
        engine: sa.Engine,
        message: CheckMessage,
        *,
        abandon_after: timedelta = timedelta(0),
        lock_timeout: timedelta = timedelta(seconds=2),
    ) -> Answer:
        """The checker's answer for ``message``: COMMIT when its step recorded it; else, once
        the message is ``abandon_after`` old, ROLLBACK after recording it abandoned (so that
        the step can never record it); UNKNOWN before that. A check that must decide
        (:attr:`~outbox.prepared.CheckMessage.final`: the last one under ``--on-max-checks
        rollback``, an operator's rollback) abandons whatever the message's age. While the
        step's transaction holds the id (waited for at most ``lock_timeout``) it raises
        :class:`StepInProgress`: a failed check, which never ends the message rolled back."""
        if lock_timeout <= timedelta(0):
            raise ConfigError("lock_timeout must be positive")
        if message.age < abandon_after and not message.final:
            with engine.connect() as conn:
                done = conn.execute(self._outcome(message.id)).scalar()
            return COMMIT if done == DONE else UNKNOWN
        milliseconds = max(1, int(lock_timeout.total_seconds() * 1000))
        try:
            with engine.begin() as conn:
                conn.execute(sa.text(f"SET LOCAL lock_timeout = {milliseconds}"))
                if conn.execute(self._insert(message.id, ABANDONED)).scalar() is not None:
                    return ROLLBACK  # committed as the block ends, before the answer is used
                outcome = conn.execute(self._outcome(message.id)).scalar()
        except exc.OperationalError as error:
            if sqlstate_of(error) == _LOCK_NOT_AVAILABLE:
                # The step's transaction holds the id and can still commit: a failed check,
                # not an UNKNOWN, so that no count of checks ends the message rolled back.
                raise StepInProgress(
                    f"the step of message {message.id} still holds it after "
                    f"{lock_timeout.total_seconds():g}s: undecided",
                ) from error
            raise
        return COMMIT if outcome == DONE else ROLLBACK

    def _insert(self, message_id: uuid.UUID, outcome: str) -> sa.Executable:
        statement = pg.insert(self.table).values(message_id=message_id, outcome=outcome)
        returning: sa.Executable = statement.on_conflict_do_nothing().returning(
            self.table.c.outcome
        )
        return returning

    def _outcome(self, message_id: uuid.UUID) -> sa.Executable:
        return sa.select(self.table.c.outcome).where(self.table.c.message_id == message_id)


def bound_step(conn: sa.Connection, limit: timedelta) -> None:
    """Bound the step's open transaction on ``conn`` to fail rather than wait past ``limit``:
    on a lock (``lock_timeout``), in a statement (``statement_timeout``), or idle between
    statements (``idle_in_transaction_session_timeout``). Call it first in the step's
    transaction; the settings end with it.

    With :class:`StepLog` this is not needed for correctness (the checker never answers
    ROLLBACK while the step can still commit); it keeps a late step from making the checker
    wait and answer UNKNOWN, and a hung one from holding its locks."""
    milliseconds = int(limit.total_seconds() * 1000)
    if milliseconds < 1:
        raise ConfigError("the step's limit must be at least a millisecond")
    for setting in ("lock_timeout", "statement_timeout", "idle_in_transaction_session_timeout"):
        conn.execute(sa.text(f"SET LOCAL {setting} = {milliseconds}"))
