"""What an operator does to the outbox table: look a message up, see the dead ones grouped by
cause, retry or purge them.

One implementation for both faces: the ``outbox dead ...`` commands and the dashboard
(:mod:`outbox.dashboard`) call these functions, so a retry from a browser is the retry of
the command line. Each takes a connection in the caller's transaction.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any, Literal

import sqlalchemy as sa

from outbox.failed_rows import dead_rows
from outbox.fingerprints import ReasonGroup, group_by_reason, ids_of_reason
from outbox.queries import Queries
from outbox.wake import wake_relays

#: The named queries of the two bulk actions on dead messages.
DeadAction = Literal["retry_dead", "purge_dead"]


def find_message(conn: sa.Connection, queries: Queries, message_id: uuid.UUID) -> Any:
    """The message's row, every column (a ``RowMapping``), or None when there is none."""
    return conn.execute(queries["show_message"], {"id": message_id}).mappings().first()


def dead_groups(
    conn: sa.Connection, queries: Queries, topic: str | None = None
) -> list[ReasonGroup[uuid.UUID]]:
    """The dead messages (of ``topic``, if given) grouped by cause, the largest group first:
    the groups of ``outbox dead list --by-reason``."""
    return group_by_reason(dead_rows(conn, queries, topic))


def act_on_dead(
    conn: sa.Connection,
    queries: Queries,
    action: DeadAction,
    *,
    ids: Sequence[uuid.UUID] | None = None,
    topic: str | None = None,
    reason: str | None = None,
) -> int:
    """Retry (back to pending, with a fresh attempt count) or purge dead messages: those
    named by ``ids``, or of ``topic``, or of the cause ``reason`` names (a fingerprint or an
    unambiguous prefix of one, of ``topic``'s dead messages if given), or every one when
    nothing narrows them. Returns how many. Retried messages wake a sleeping relay at commit.

    Prepared messages check-back left dead are never retried here: nobody knows whether
    their step happened (``outbox prepared commit/rollback`` decides them)."""
    chosen: list[uuid.UUID] | None = list(ids) if ids else None
    if reason is not None:
        chosen = ids_of_reason(dead_rows(conn, queries, topic), reason)
        if not chosen:
            return 0
    count = int(conn.execute(queries[action], {"ids": chosen, "topic": topic}).rowcount)
    if count and action == "retry_dead":
        wake_relays(conn, queries)  # pending again: a sleeping relay sends them now
    return count
