"""The outbox rows a sender (the relay or the immediate sender) sends, and what it records of
each outcome: one implementation for both."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from outbox.engines import sender_engine
from outbox.queries import Queries
from outbox.records import OutboxRecord
from outbox.schema import OutboxTableSpec
from outbox.sending import Ack
from outbox.wake import wake_relays

#: error_kind of a row that cannot even be turned into a Kafka record.
UNDECODABLE = "undecodable"


# Not frozen: a frozen dataclass's __init__ sets each field through object.__setattr__, three
# times the cost of a plain one, and the relay builds one of these per message it reads.
@dataclass(slots=True)
class PendingRow:
    """A pending row to send: the record to produce, or why it cannot be one."""

    id: uuid.UUID
    shard: int
    attempts: int
    created_at: datetime
    record: OutboxRecord | None
    problem: str | None = None


@dataclass(frozen=True)
class Failure:
    """A row that was not sent: retried after ``delay`` seconds, or dead when ``delay`` is None."""

    id: uuid.UUID
    kind: str
    error: str
    delay: float | None


#: The columns of ``read_batch``, in order: :func:`pending_row_of` decodes its plain tuples.
READ_COLUMNS = (
    "id",
    "seq",
    "shard",
    "topic",
    "key",
    "value",
    "content_type",
    "header_names",
    "header_values",
    "attempts",
    "created_at",
    "generation",
    "id_text",
)


def pending_row_of(values: Sequence[Any]) -> PendingRow:
    """Decode a ``read_batch`` row as a plain tuple (cheaper than a mapping per row)."""
    (message_id, seq, shard, topic, key, value, content_type) = values[:7]
    (names, header_values, attempts, created_at, generation, id_text) = values[7:]
    try:
        record: OutboxRecord | None = OutboxRecord.from_columns(
            message_id,
            seq,
            shard,
            topic,
            key,
            value,
            content_type,
            names,
            header_values,
            generation,
            id_text,
        )
        problem = None
    except (ValueError, TypeError, UnicodeError) as error:
        record, problem = None, f"{UNDECODABLE}: {error}"
    return PendingRow(message_id, shard, attempts, created_at, record, problem)


def pending_row(row: Any) -> PendingRow:
    """Decode a result row; a row that does not make a Kafka record carries the reason."""
    try:
        record: OutboxRecord | None = OutboxRecord.from_row(dict(row))
        problem = None
    except (ValueError, TypeError, UnicodeError) as error:
        record, problem = None, f"{UNDECODABLE}: {error}"
    return PendingRow(
        id=row["id"],
        shard=row["shard"],
        attempts=row["attempts"],
        created_at=row["created_at"],
        record=record,
        problem=problem,
    )


def array_literal(values: Iterable[int]) -> str:
    """An array of numbers as one PostgreSQL array literal, for ``CAST(:p AS t[])``.

    A Python list is adapted element by element in Python; a batch's marks are its largest
    parameters, and one string is several times cheaper to build and send.
    """
    return "{" + ",".join(map(str, values)) + "}"


def id_array_literal(ids: Iterable[uuid.UUID]) -> str:
    """An array of ids as one literal for ``CAST(:p AS uuid[])``: each as its 32 hex digits,
    which PostgreSQL reads as the same uuid, at a third of the cost of ``str()``."""
    return "{" + ",".join(message_id.hex for message_id in ids) + "}"


class OutboxRows:
    """Records outcomes on the outbox table for one sender.

    ``owner`` is an immediate sender's name: its marks then touch only rows it still holds.
    The relay passes None: it owns the shards of the rows it sends.
    """

    def __init__(
        self,
        url: str | sa.URL,
        spec: OutboxTableSpec,
        owner: str | None = None,
        delete_on_send: bool = False,
    ) -> None:
        self.spec = spec
        self.owner = owner
        self.delete_on_send = delete_on_send
        self.queries = Queries(spec)
        # Marking joins the table to arrays of the batch's ids: hash joins only (see
        # outbox.engines.hash_joins_only), set once per session.
        self.marking_engine = sender_engine(url, nested_loops=False)

    def record_outcome(
        self,
        acks: Sequence[Ack],
        failures: Sequence[Failure] = (),
        released: Sequence[uuid.UUID] = (),
    ) -> None:
        """Mark acknowledged rows sent (or delete them), failed ones for retry or dead, and
        give ``released`` rows back to the relay (immediate send), in one transaction."""
        statements = self._outcome_statements(acks, failures)
        if released:
            statements.append(("release", {"ids": list(released)}))
        if not statements:
            return
        # The usual batch is all sent: one statement, run without BEGIN/COMMIT round trips.
        scope = (
            self.autocommit(self.marking_engine)
            if len(statements) == 1 and not released
            else self.marking_engine.begin()
        )
        with scope as conn:
            for name, params in statements:
                conn.execute(self.queries[name], {**params, "owner": self.owner})
            if released:
                wake_relays(conn, self.queries)  # given back: the relay sends them now

    def close(self) -> None:
        self.marking_engine.dispose()

    def _outcome_statements(
        self, acks: Sequence[Ack], failures: Sequence[Failure]
    ) -> list[tuple[str, dict[str, Any]]]:
        retry = [f for f in failures if f.delay is not None]
        dead = [f for f in failures if f.delay is None]
        statements: list[tuple[str, dict[str, Any]]] = []
        # Whoever holds the shards: a relay names its owner session (see RelayStore).
        anywhere = {"owner_key": None, **self.spec.owner_session_keys}
        if acks and self.delete_on_send:
            statements.append(
                ("delete_sent", {"ids": id_array_literal(a.id for a in acks), **anywhere})
            )
        elif acks:
            statements.append(
                (
                    "mark_sent",
                    {
                        **anywhere,
                        "ids": id_array_literal(a.id for a in acks),
                        "partitions": array_literal(a.partition for a in acks),
                        "offsets": array_literal(a.offset for a in acks),
                        "generations": array_literal(a.generation for a in acks),
                    },
                )
            )
        if retry:
            statements.append(
                (
                    "mark_retry",
                    {
                        **anywhere,
                        "ids": [f.id for f in retry],
                        "delays": [f.delay for f in retry],
                        "kinds": [f.kind for f in retry],
                        "errors": [f.error[:2000] for f in retry],
                    },
                )
            )
        if dead:
            statements.append(
                (
                    "mark_dead",
                    {
                        **anywhere,
                        "ids": [f.id for f in dead],
                        "kinds": [f.kind for f in dead],
                        "errors": [f.error[:2000] for f in dead],
                    },
                )
            )
        return statements

    @staticmethod
    @contextmanager
    def autocommit(engine: sa.Engine) -> Iterator[sa.Connection]:
        with engine.connect() as conn:
            yield conn.execution_options(isolation_level="AUTOCOMMIT")
