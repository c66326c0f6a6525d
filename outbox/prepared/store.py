"""Every statement on prepared messages, behind named methods: the API, the check-back runner
and the CLI never see SQL (the queries are in ``outbox/sql/queries.sql``).

Methods that take a ``Connection`` run inside the caller's transaction; the runner's methods
take an ``Engine`` and run one short transaction each.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy import exc

from outbox.database_errors import sqlstate_of
from outbox.errors import OutboxError
from outbox.message import EncodedMessage
from outbox.prepared.answers import COMMIT, ROLLBACK
from outbox.publisher import translate_table_error
from outbox.queries import Queries
from outbox.redaction import mask_secrets
from outbox.schema import DEAD, ROLLED_BACK, OutboxTableSpec
from outbox.wake import wake_relays

#: Who decided a prepared message (the ``resolved_by`` column).
PRODUCER, CHECK, EXPIRED, OPERATOR = "producer", "check", "expired", "operator"
#: error_kind of a message that check-back gave up on and left dead for an operator.
UNRESOLVED = "unresolved"
#: The ways a message may end when check-back gives up on it.
END_STATUSES = (ROLLED_BACK, DEAD)
#: Longest checker error (or answer) text recorded.
MAX_STORED_TEXT = 2000

log = logging.getLogger("outbox.checkback")

_INSERTED_COLUMNS = (
    "id",
    "shard",
    "topic",
    "key",
    "value",
    "content_type",
    "header_names",
    "header_values",
    "idempotency_key",
)


@dataclass(frozen=True)
class CheckRecord:
    """One check to record: the message, the answer (``commit``, ``rollback``, ``unknown``,
    ``error`` or ``timeout``), its error, and the seconds until the next check. ``final``: the
    last check, asked to decide (``--on-max-checks rollback``): its ROLLBACK ends the message
    rolled back by ``expired``."""

    id: uuid.UUID
    answer: str
    error: str | None
    delay: float
    final: bool = False


@dataclass(frozen=True)
class Recorded:
    """What recording a round of checks did: the rows still held and prepared (the others were
    decided meanwhile, by their producer or an operator), and which of them were committed,
    rolled back or given up on (``expired``: each with the status it ended in)."""

    recorded: frozenset[uuid.UUID]
    committed: tuple[uuid.UUID, ...]
    rolled_back: tuple[uuid.UUID, ...]
    expired: tuple[tuple[uuid.UUID, str], ...]


class PreparedStore:
    """The statements on one outbox table's prepared messages."""

    def __init__(self, spec: OutboxTableSpec) -> None:
        self.spec = spec
        self.queries = Queries(spec)

    # -- the producer's side ------------------------------------------------------------------

    def insert(
        self, conn: sa.Connection, encoded: EncodedMessage, check_group: str, check_after: float
    ) -> tuple[uuid.UUID, bool]:
        """Insert a prepared message; returns its id and whether its idempotency key was
        stored already (then nothing was written and the id is the earlier message's)."""
        params: dict[str, Any] = {name: encoded.row.get(name) for name in _INSERTED_COLUMNS}
        params.update(
            check_group=check_group, check_after=check_after, deliver_at=encoded.deliver_at
        )
        # Twice at most: the row holding the key may be rolled back (and give the key up)
        # between the insert that found it and the look for it.
        for _ in range(2):
            with self.typed_errors():
                inserted = conn.execute(self.queries["insert_prepared"], params).scalar()
            if inserted is not None:
                return inserted, False
            key = {"key": encoded.idempotency_key}
            found = conn.execute(self.queries["find_idempotency_key"], key).scalar()
            if found is not None:
                return found, True
        raise OutboxError(
            f"idempotency key {encoded.idempotency_key!r} is being released and taken again "
            "at the same time: try again"
        )

    @contextmanager
    def typed_errors(self) -> Iterator[None]:
        """Raise a permanent failure (the table missing or not upgraded, a privilege missing)
        as the :class:`~outbox.errors.OutboxError` that says so, not as a database error."""
        try:
            yield
        except exc.ProgrammingError as error:
            translated = self._translated(error)
            if translated is None:
                raise
            raise translated from error

    def commit(
        self,
        conn: sa.Connection,
        ids: Iterable[uuid.UUID],
        by: str,
        *,
        after_rollback: bool = False,
    ) -> int:
        """Make prepared messages pending, in the order they were prepared (their UUIDv7 ids),
        and wake a sleeping relay at commit. Returns how many were prepared.

        ``after_rollback``: commit messages that check-back or an operator rolled back
        instead (never one its producer rolled back, nor one whose idempotency key another
        message took since the rollback): the step happened after all. They take their keys
        back."""
        ordered = sorted(set(ids))
        if not ordered:
            return 0
        # One statement per id, sent as one batch: each takes its new seq in this order.
        params = [{"id": message_id, "by": by} for message_id in ordered]
        query = "commit_rolled_back" if after_rollback else "commit_prepared"
        try:
            count = int(conn.execute(self.queries[query], params).rowcount)
        except exc.IntegrityError as error:
            if not after_rollback or self.spec.idempotency_index not in str(error.orig):
                raise
            # A retry wrote the key between the look for it and the commit's taking it back.
            raise OutboxError(
                "a message with the idempotency key of a message being committed after its "
                "rollback was written at the same moment: nothing was committed; see which "
                "holds the key now (outbox prepared show ID)"
            ) from error
        if count:
            wake_relays(conn, self.queries)
        return count

    def rollback(
        self, conn: sa.Connection, ids: Iterable[uuid.UUID], by: str, *, checked: bool = False
    ) -> int:
        """Roll prepared messages back for good. Returns how many were prepared.

        ``checked``: their checker, asked just now, answered ROLLBACK (an operator's
        rollback through it): that check is recorded with the rollback."""
        wanted = list(set(ids))
        if not wanted:
            return 0
        params = {"ids": wanted, "by": by}
        query = "rollback_checked" if checked else "rollback_prepared"
        return int(conn.execute(self.queries[query], params).rowcount)

    def statuses(
        self, conn: sa.Connection, ids: Collection[uuid.UUID]
    ) -> dict[uuid.UUID, sa.RowMapping]:
        """Where the given messages stand (``status``, ``error_kind``, ``prepared_at``,
        ``resolved_by``); an id with no row is absent."""
        rows = conn.execute(self.queries["prepared_statuses"], {"ids": list(ids)}).mappings()
        return {row["id"]: row for row in rows}

    def rolled_back_statuses(
        self, conn: sa.Connection, ids: Collection[uuid.UUID]
    ) -> dict[uuid.UUID, sa.RowMapping]:
        """:meth:`statuses`, with the idempotency key each rollback gave up
        (``released_idempotency_key``) and the message holding it now (``key_holder``)."""
        rows = conn.execute(self.queries["rolled_back_statuses"], {"ids": list(ids)}).mappings()
        return {row["id"]: row for row in rows}

    # -- the check-back runner's side ---------------------------------------------------------

    def claim_due(
        self,
        engine: sa.Engine,
        owner: str,
        groups: Sequence[str],
        limit: int,
        lease_seconds: float,
    ) -> list[sa.RowMapping]:
        """Lease up to ``limit`` prepared rows of ``groups`` whose check is due to ``owner``."""
        params = {
            "owner": owner,
            "groups": list(groups),
            "limit": limit,
            "lease_seconds": lease_seconds,
        }
        with engine.begin() as conn:
            return list(conn.execute(self.queries["claim_due_checks"], params).mappings())

    def record_checks(
        self,
        engine: sa.Engine,
        owner: str,
        checks: Sequence[CheckRecord],
        max_checks: int,
    ) -> Recorded:
        """Record a round of checks and act on the answers, in one transaction: COMMIT and
        ROLLBACK decide the message (a ROLLBACK to a ``final`` check ends it ``expired``);
        after ``max_checks`` checks without a verdict it ends dead, for an operator. Only rows
        ``owner`` still holds are touched."""
        if not checks:
            return Recorded(frozenset(), (), (), ())
        try:
            return self._record(engine, owner, checks, max_checks)
        except exc.DataError:
            if len(checks) == 1:
                raise
        # A check the database refuses must not cost the others their verdicts: one by one.
        parts: list[Recorded] = []
        for check in checks:
            try:
                parts.append(self._record(engine, owner, [check], max_checks))
            except exc.DataError as error:
                log.error(
                    "could not record a check: the message is checked again after its lease",
                    extra={"id": str(check.id), "error": str(error.orig).splitlines()[0]},
                )
        return Recorded(
            frozenset().union(*(part.recorded for part in parts)),
            tuple(i for part in parts for i in part.committed),
            tuple(i for part in parts for i in part.rolled_back),
            tuple(i for part in parts for i in part.expired),
        )

    def _record(
        self,
        engine: sa.Engine,
        owner: str,
        checks: Sequence[CheckRecord],
        max_checks: int,
    ) -> Recorded:
        params = {
            "owner": owner,
            "ids": [c.id for c in checks],
            "answers": [stored_text(c.answer) for c in checks],
            "errors": [stored_text(c.error) for c in checks],
            "delays": [c.delay for c in checks],
        }
        with engine.begin() as conn:
            rows = conn.execute(self.queries["record_checks"], params)
            recorded = frozenset(row.id for row in rows)
            held = [c for c in checks if c.id in recorded]
            committed = tuple(c.id for c in held if c.answer == COMMIT)
            rolled_back = tuple(c.id for c in held if c.answer == ROLLBACK and not c.final)
            # The last check, asked to decide, blocked the step: check-back gives up on the
            # message by rolling it back.
            given_up = tuple(c.id for c in held if c.answer == ROLLBACK and c.final)
            undecided = [c.id for c in held if c.answer not in (COMMIT, ROLLBACK)]
            self.commit(conn, committed, CHECK)
            self.rollback(conn, rolled_back, CHECK)
            self.rollback(conn, given_up, EXPIRED)
            expired = tuple((message_id, ROLLED_BACK) for message_id in given_up)
            if undecided:
                expired += tuple(
                    (row.id, row.status)
                    for row in conn.execute(
                        self.queries["expire_prepared"],
                        {"ids": undecided, "max_checks": max_checks},
                    )
                )
        return Recorded(recorded, committed, rolled_back, expired)

    def counts(self, engine: sa.Engine, groups: Sequence[str]) -> dict[str, tuple[int, float]]:
        """Per check group: prepared messages, and the age in seconds of the oldest."""
        with engine.connect() as conn:
            rows = conn.execute(self.queries["count_prepared"], {"groups": list(groups)})
            return {row.check_group: (int(row.prepared), float(row.oldest)) for row in rows}

    def problem(self, engine: sa.Engine) -> str | None:
        """Why the runner cannot work on this table, or None when it can."""
        name = self.spec.qualified_name
        with engine.connect() as conn:
            found = conn.execute(self.queries["checkback_access"], {"name": name}).one()
        if not found.table_exists:
            return f"table {name} does not exist: run `outbox db upgrade`"
        if not found.prepared:
            return _too_old(self.spec)
        if not found.upgraded:
            return (
                f"table {name} predates revision 0007_check_failures (failed checks counted "
                "apart): run `outbox db upgrade`"
            )
        if not found.keeps_released_keys:
            return _lacks_released_keys(self.spec)
        if not found.allowed:
            return (
                f"role {found.role} needs SELECT and UPDATE on {name} (docs/prepared-messages.md)"
            )
        return None

    # -- the operator's side ------------------------------------------------------------------

    def unresolved(
        self,
        conn: sa.Connection,
        *,
        ids: Sequence[uuid.UUID] | None = None,
        topic: str | None = None,
        check_group: str | None = None,
        limit: int | None = None,
    ) -> list[sa.RowMapping]:
        """Messages waiting for a verdict (prepared, or left dead by check-back), oldest first."""
        params: Mapping[str, Any] = {
            "ids": list(ids) if ids else None,
            "topic": topic,
            "check_group": check_group,
            "limit": limit,
        }
        return list(conn.execute(self.queries["select_unresolved"], params).mappings())

    def unblocked_rollbacks(
        self,
        conn: sa.Connection,
        *,
        topic: str | None = None,
        check_group: str | None = None,
        limit: int | None = None,
    ) -> list[sa.RowMapping]:
        """Rolled-back messages whose step nothing blocked before the rollback (it may have
        happened), newest first: check-back gave them up after UNKNOWN answers before it asked
        the last check to decide, or an operator rolled them back without a check."""
        params = {"topic": topic, "check_group": check_group, "limit": limit}
        return list(conn.execute(self.queries["select_unblocked_rollbacks"], params).mappings())

    def _translated(self, error: exc.ProgrammingError) -> OutboxError | None:
        translated = translate_table_error(error, self.spec)
        if translated is None and sqlstate_of(error) == "42703":  # undefined_column
            if "released_idempotency_key" in str(error.orig):
                return OutboxError(_lacks_released_keys(self.spec))
            translated = OutboxError(_too_old(self.spec))
        return translated


def stored_text(text: str | None) -> str | None:
    """A checker's text as it is stored and shown: passwords masked, NUL characters (which
    PostgreSQL refuses in text) written as ``\\x00``, at most ``MAX_STORED_TEXT``
    characters."""
    if text is None:
        return None
    return mask_secrets(text.replace("\x00", "\\x00"))[:MAX_STORED_TEXT]


def _lacks_released_keys(spec: OutboxTableSpec) -> str:
    return (
        f"table {spec.qualified_name} predates revision 0011_released_idempotency_keys "
        "(a rollback keeps the idempotency key it gives up): run `outbox db upgrade`"
    )


def _too_old(spec: OutboxTableSpec) -> str:
    return (
        f"table {spec.qualified_name} predates prepared messages (revision "
        "0004_prepared_messages): run `outbox db upgrade`"
    )
