"""The consuming side's audit: what the service applied, against what the writers committed.

Every committed message must be applied exactly once (one ``chaos_applied`` row), nothing
else may be applied, and for each topic and key the applications must have committed in the
order of the outbox's ``seq``, as far as the relay promises it (the order of messages whose
transactions overlapped is not: :mod:`outbox.chaos.visibility`). The checks are pure
functions of the rows, so they are tested on rows made by hand.
"""

from __future__ import annotations

import uuid
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import sqlalchemy as sa

from outbox.chaos.audit import KeyOrder, RowFacts
from outbox.chaos.service import APPLIED_TABLE, GROUP
from outbox.inbox.schema import InboxTableSpec


@dataclass(frozen=True)
class Application:
    """One row of the service's effect table: one application of a message."""

    message_id: uuid.UUID
    topic: str
    key: str
    key_seq: int  # the order of the key's applications, as they committed


@dataclass(frozen=True)
class AppliedAudit:
    """What the checks found; the lists hold message ids, ``order`` one line per violation."""

    applied: int
    missing: list[uuid.UUID]
    applied_twice: list[uuid.UUID]
    not_committed: list[uuid.UUID]
    order: list[str]


def audit_applied(
    applications: Iterable[Application], rows: Mapping[uuid.UUID, RowFacts]
) -> AppliedAudit:
    """Check the applications against the committed outbox rows (``rows``, by id)."""
    made = list(applications)
    times = Counter(a.message_id for a in made)
    return AppliedAudit(
        applied=len(made),
        missing=sorted(set(rows) - set(times)),
        applied_twice=sorted(i for i, count in times.items() if count > 1),
        not_committed=sorted(set(times) - set(rows)),
        order=order_violations(made, rows),
    )


def order_violations(
    applications: Iterable[Application], rows: Mapping[uuid.UUID, RowFacts]
) -> list[str]:
    """Per (topic, key), in the order the applications committed, the first application of
    each message must come in ``seq`` order, as on the topics (see
    :func:`outbox.chaos.audit.order_violations`). Second applications and messages that were
    never committed are counted by the other checks, not here."""
    by_key: dict[tuple[str, str], list[Application]] = defaultdict(list)
    for application in applications:
        by_key[(application.topic, application.key)].append(application)
    found: list[str] = []
    for (topic, key), applied in sorted(by_key.items()):
        seen: set[uuid.UUID] = set()
        order = KeyOrder()
        for application in sorted(applied, key=lambda a: a.key_seq):
            facts = rows.get(application.message_id)
            if facts is None or application.message_id in seen:
                continue
            seen.add(application.message_id)
            verdict = order.add(application.message_id, facts)
            if verdict is not None and verdict[0]:
                found.append(
                    f"{topic} key {key}: {application.message_id} (seq {facts.seq}) applied "
                    f"as number {application.key_seq}, after {verdict[1]}"
                )
    return found


def audit_service(
    database_url: str, rows: Mapping[uuid.UUID, RowFacts]
) -> tuple[AppliedAudit, dict[str, int]]:
    """The service's applications checked against ``rows``, and the inbox's own figures."""
    engine = sa.create_engine(database_url)
    try:
        return audit_applied(read_applications(engine), rows), inbox_figures(engine)
    finally:
        engine.dispose()


def read_applications(engine: sa.Engine) -> list[Application]:
    with engine.connect() as conn:
        rows = conn.execute(sa.text(f"SELECT message_id, topic, key, key_seq FROM {APPLIED_TABLE}"))
        return [Application(r.message_id, r.topic, r.key, r.key_seq) for r in rows]


def inbox_figures(engine: sa.Engine) -> dict[str, int]:
    """The inbox's own record: rows (messages it saw applied) and parked messages."""
    spec = InboxTableSpec()
    with engine.connect() as conn:
        counts = {
            name: conn.execute(
                sa.select(sa.func.count()).select_from(table).where(table.c.consumer_group == GROUP)
            ).scalar_one()
            for name, table in (("inbox_rows", spec.inbox), ("parked", spec.parked))
        }
    return {name: int(count) for name, count in counts.items()}
