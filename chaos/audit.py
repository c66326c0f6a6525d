"""After the run: what the database holds, what the topics hold, and whether they agree.

Missing, phantom and duplicate messages come from the reconciliation job; this module adds
what the job does not look at: per-key order on the topics (as far as the relay promises it:
:mod:`outbox.chaos.visibility`), rolled-back messages, atomicity with the business rows, and
commits the writers saw confirmed.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import sqlalchemy as sa
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from outbox import ID_HEADER
from outbox.chaos.visibility import MADE_PENDING_TABLE, MadeBy, must_precede
from outbox.chaos.writers import BUSINESS_TABLE


@dataclass(frozen=True)
class TopicRecord:
    """One record read back from a topic."""

    message_id: uuid.UUID | None
    topic: str
    partition: int
    offset: int
    key: bytes | None
    #: The producer's time (milliseconds since the epoch): when the record was sent.
    timestamp_ms: int = 0


@dataclass(frozen=True)
class RowFacts:
    """An outbox row, as far as ordering goes."""

    seq: int
    topic: str
    key: bytes | None
    #: The transaction that made it pending (None: unknown, ordered by seq alone).
    made_by: MadeBy | None = None


def read_topics(bootstrap: str, topics: Iterable[str], timeout: float = 120.0) -> list[TopicRecord]:
    """Every committed record of ``topics`` (read_committed), up to each partition's end."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"chaos-audit-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
            "enable.partition.eof": True,
        }
    )
    try:
        metadata = consumer.list_topics(timeout=30)
        partitions = [
            TopicPartition(topic, p, 0)  # offset 0: from the start
            for topic in topics
            for p in sorted(metadata.topics[topic].partitions)
        ]
        consumer.assign(partitions)
        pending = {(tp.topic, tp.partition) for tp in partitions}
        records: list[TopicRecord] = []
        deadline = time.monotonic() + timeout
        while pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"topics not read to their end in {timeout:.0f}s: {pending}")
            message = consumer.poll(0.5)
            if message is None:
                continue
            error = message.error()
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF:
                    pending.discard((message.topic(), message.partition()))
                    continue
                raise KafkaException(error)
            records.append(_record(message))
        return records
    finally:
        consumer.close()


def _record(message) -> TopicRecord:  # type: ignore[no-untyped-def]
    headers = dict(message.headers() or [])
    raw = headers.get(ID_HEADER)
    try:
        message_id = uuid.UUID(raw.decode()) if raw else None
    except ValueError:
        message_id = None
    return TopicRecord(
        message_id,
        message.topic(),
        message.partition(),
        message.offset(),
        message.key(),
        int(message.timestamp()[1]),
    )


def partition_ends(records: Iterable[TopicRecord]) -> dict[tuple[str, int], int]:
    """Per (topic, partition): the offset after its last record, where a consumer that read
    everything has committed."""
    ends: dict[tuple[str, int], int] = {}
    for r in records:
        slot = (r.topic, r.partition)
        ends[slot] = max(ends.get(slot, 0), r.offset + 1)
    return ends


def row_facts(engine: sa.Engine, topics: Iterable[str]) -> dict[uuid.UUID, RowFacts]:
    """The rows of ``topics``, each with the transaction that made it pending: its business
    row's, or the last that gave it a new seq (see outbox.chaos.visibility)."""
    with engine.connect() as conn:
        recorded = conn.execute(
            sa.text("SELECT to_regclass(:name) IS NOT NULL"), {"name": MADE_PENDING_TABLE}
        ).scalar()
        made_pending = (
            f"SELECT DISTINCT ON (id) id, xact, seen FROM {MADE_PENDING_TABLE} "
            "ORDER BY id, xact DESC"
            if recorded
            else "SELECT CAST(NULL AS uuid) AS id, CAST(NULL AS xid8) AS xact, "
            "CAST(NULL AS pg_snapshot) AS seen LIMIT 0"
        )
        rows = conn.execute(
            sa.text(
                f"""
                SELECT o.id, o.seq, o.topic, o.key,
                       CAST(coalesce(m.xact, b.xact) AS text) AS xact,
                       CAST(CASE WHEN m.id IS NULL THEN b.seen ELSE m.seen END AS text) AS seen
                  FROM outbox AS o
                  LEFT JOIN ({made_pending}) AS m ON m.id = o.id
                  LEFT JOIN (SELECT unnest(message_ids) AS id, xact, seen
                               FROM {BUSINESS_TABLE}) AS b ON b.id = o.id
                 WHERE o.topic = ANY(:topics)
                """
            ),
            {"topics": list(topics)},
        )
        return {
            row.id: RowFacts(row.seq, row.topic, row.key, MadeBy.parse(row.xact, row.seen))
            for row in rows
        }


def order_violations(
    records: Iterable[TopicRecord],
    rows: Mapping[uuid.UUID, RowFacts],
    unordered: list[str] | None = None,
) -> list[str]:
    """Per (topic, key): the first copy of each message must come after those of the key's
    messages with a lower ``seq`` that it must follow (all of them, unless their transactions
    overlapped: :func:`outbox.chaos.visibility.must_precede`), and a key must stay in one
    partition. Later copies (at-least-once redeliveries) are not ordered.

    Returns one line per violation; the inversions the promise allows are added to
    ``unordered`` when given.
    """
    seen: set[uuid.UUID] = set()
    partitions: dict[tuple[str, bytes | None], tuple[int, uuid.UUID]] = {}
    keys: dict[tuple[str, bytes | None], KeyOrder] = {}
    found: list[str] = []
    for record in sorted(records, key=lambda r: (r.topic, r.partition, r.offset)):
        message_id = record.message_id
        facts = rows.get(message_id) if message_id else None
        if message_id is None or facts is None or message_id in seen:
            continue  # phantoms are the reconciliation's; later copies are allowed anywhere
        seen.add(message_id)
        slot = (record.topic, record.key)
        first = partitions.setdefault(slot, (record.partition, message_id))
        verdict = keys.setdefault(slot, KeyOrder()).add(message_id, facts)
        if first[0] != record.partition:
            found.append(
                f"{record.topic} key {record.key!r}: {message_id} in partition "
                f"{record.partition}, {first[1]} in {first[0]}"
            )
        elif verdict is not None:
            broken, previous = verdict
            line = (
                f"{record.topic} key {record.key!r}: {message_id} (seq {facts.seq}) at offset "
                f"{record.offset}, after {previous}"
            )
            if broken:
                found.append(line)
            elif unordered is not None:
                unordered.append(line)
    return found


class KeyOrder:
    """The messages of one key in the order they came (to a topic, or to a consumer)."""

    def __init__(self) -> None:
        self._came: list[tuple[RowFacts, uuid.UUID]] = []
        self._highest = -1

    def add(self, message_id: uuid.UUID, facts: RowFacts) -> tuple[bool, str] | None:
        """Note the next message; None when it came after every message of the key with a
        higher seq, else whether one of those came first against the promise, and which
        (otherwise the highest, whose transaction overlapped its own)."""
        verdict = None
        if facts.seq < self._highest:  # rare: only then are the earlier ones looked at
            higher = [(f, i) for f, i in self._came if f.seq > facts.seq]
            broken = [(f, i) for f, i in higher if must_precede(facts.made_by, f.made_by)]
            if broken:
                verdict = True, f"{broken[0][1]} (seq {broken[0][0].seq})"
            else:
                other, other_id = max(higher, key=lambda pair: pair[0].seq)
                verdict = (
                    False,
                    (f"{other_id} (seq {other.seq}), whose transaction overlapped its own"),
                )
        self._came.append((facts, message_id))
        self._highest = max(self._highest, facts.seq)
        return verdict


def present_ids(engine: sa.Engine, ids: Iterable[uuid.UUID]) -> set[uuid.UUID]:
    """Which of ``ids`` have an outbox row."""
    wanted = list(ids)
    if not wanted:
        return set()
    with engine.connect() as conn:
        query = sa.text("SELECT id FROM outbox WHERE id = ANY(:ids)")
        return set(conn.execute(query, {"ids": wanted}).scalars())


def atomicity_breaks(engine: sa.Engine, topics: Iterable[str]) -> int:
    """Outbox rows without their business row, plus business rows missing a message.

    One hash full join: ``NOT IN`` over a subquery larger than work_mem is quadratic.
    """
    with engine.connect() as conn:
        query = sa.text(
            f"""
            SELECT count(*)
              FROM (SELECT unnest(message_ids) AS id FROM {BUSINESS_TABLE}) AS listed
              FULL JOIN (SELECT id FROM outbox WHERE topic = ANY(:topics)) AS rows
                ON rows.id = listed.id
             WHERE rows.id IS NULL OR listed.id IS NULL
            """
        )
        return int(conn.execute(query, {"topics": list(topics)}).scalar_one())


def status_counts(engine: sa.Engine) -> dict[str, int]:
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT status, count(*) FROM outbox GROUP BY status"))
        return {row[0]: int(row[1]) for row in rows}
