"""An operator's verdict on prepared messages: commit or roll back those waiting for one.

One implementation for both faces: ``outbox prepared commit|rollback`` and the dashboard
(:mod:`outbox.dashboard`) call :func:`decide`, so both keep the same rules: only a message
still waiting for a verdict (prepared, or left dead by check-back) is decided, and a message
check-back rolled back is committed only when asked by its id (``after_rollback``).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import sqlalchemy as sa

from outbox.prepared.store import OPERATOR, PreparedStore


def decide(
    conn: sa.Connection,
    store: PreparedStore,
    *,
    commit: bool,
    ids: Sequence[uuid.UUID] = (),
    topic: str | None = None,
    check_group: str | None = None,
    after_rollback: bool = False,
) -> int:
    """Commit (pending: the relay publishes them) or roll back for good the messages waiting
    for a verdict that ``ids``, ``topic`` and ``check_group`` pick (every one when none is
    given), in the caller's transaction. Returns how many were decided: a message decided
    meanwhile (by its producer, check-back or another operator) is not counted.

    ``after_rollback`` (with ``commit`` and ``ids`` only): commit the given messages that
    check-back rolled back instead; the operator knows the step happened after all."""
    if after_rollback:
        if not commit or topic or check_group or not ids:
            raise ValueError("after_rollback commits messages named by their ids only")
        return store.commit(conn, ids, OPERATOR, after_rollback=True)
    rows = store.unresolved(conn, ids=list(ids) or None, topic=topic, check_group=check_group)
    chosen = [row["id"] for row in rows]
    if commit:
        return store.commit(conn, chosen, OPERATOR)
    return store.rollback(conn, chosen, OPERATOR)
