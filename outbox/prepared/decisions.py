"""An operator's verdict on prepared messages: commit or roll back those waiting for one.

One implementation for both faces: ``outbox prepared commit`` and the dashboard's commit
(:mod:`outbox.dashboard`) call :func:`decide`, ``outbox prepared rollback`` and the
dashboard's rollback call :func:`operator_rollback`, so both keep the same rules: only a
message still waiting for a verdict (prepared, or left dead by check-back) is decided, a
message rolled back by check-back or an operator is committed only when asked by its id
(``after_rollback``), and a rollback needs its step blocked first.

A message waiting for a verdict may have its step still running (its producer alive, the
step's transaction open, or about to start): rolled back then, the step commits without its
message. So an operator's rollback goes through the message's checker, asked to decide as
check-back's last check is (:func:`rollback_through_checkers`: a ``StepLog`` checker records
the id abandoned, and the step can no longer happen), or the operator says the step cannot
happen any more (``step_cannot_happen``); :func:`decide` refuses it otherwise.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import sqlalchemy as sa

from outbox.errors import ConfigError, StepNotBlocked
from outbox.prepared.answers import COMMIT, ROLLBACK, UNKNOWN
from outbox.prepared.calls import TIMEOUT, CheckCalls
from outbox.prepared.checkers import CheckMessage, CheckRegistry
from outbox.prepared.store import OPERATOR, PreparedStore, stored_text

#: Seconds an operator's rollback waits for each checker.
CHECK_TIMEOUT = 10.0


def decide(
    conn: sa.Connection,
    store: PreparedStore,
    *,
    commit: bool,
    ids: Sequence[uuid.UUID] = (),
    topic: str | None = None,
    check_group: str | None = None,
    after_rollback: bool = False,
    step_cannot_happen: bool = False,
) -> int:
    """Commit (pending: the relay publishes them) or roll back for good the messages waiting
    for a verdict that ``ids``, ``topic`` and ``check_group`` pick (every one when none is
    given), in the caller's transaction. Returns how many were decided: a message decided
    meanwhile (by its producer, check-back or another operator) is not counted.

    A rollback raises :class:`~outbox.errors.StepNotBlocked` (and changes nothing) unless
    ``step_cannot_happen``: the operator made sure that no chosen message's step can commit
    any more. Roll back through the checkers with :func:`rollback_through_checkers` instead.

    ``after_rollback`` (with ``commit`` and ``ids`` only): commit the given messages that
    check-back or an operator rolled back instead; the operator knows the step happened after
    all."""
    if after_rollback:
        if not commit or topic or check_group or not ids:
            raise ValueError("after_rollback commits messages named by their ids only")
        return store.commit(conn, ids, OPERATOR, after_rollback=True)
    rows = store.unresolved(conn, ids=list(ids) or None, topic=topic, check_group=check_group)
    chosen = [row["id"] for row in rows]
    if commit:
        return store.commit(conn, chosen, OPERATOR)
    return _rollback_unchecked(conn, store, chosen, step_cannot_happen)


def _rollback_unchecked(
    conn: sa.Connection, store: PreparedStore, chosen: list[uuid.UUID], step_cannot_happen: bool
) -> int:
    if chosen and not step_cannot_happen:
        raise StepNotBlocked(
            f"{len(chosen)} message(s) waiting for a verdict, none rolled back: its step may "
            "still commit (its producer may be running it now), and a step that commits after "
            "the rollback has no message. Roll back through the checkers, which block the "
            "step first as check-back does: `outbox prepared rollback --checker "
            "MODULE:REGISTRY ...`; or leave them to check-back; or, once you made sure the "
            "steps can no longer happen, pass --step-cannot-happen",
            message_ids=tuple(chosen),
        )
    return store.rollback(conn, chosen, OPERATOR)


@dataclass(frozen=True)
class CheckedRollback:
    """What :func:`operator_rollback` (or :func:`rollback_through_checkers`) did: the messages
    waiting for a verdict it found (``found``), how many of them it rolled back, and why each
    of the others was not (``refused``: by message id; one missing there was decided
    meanwhile)."""

    found: frozenset[uuid.UUID]
    rolled_back: int
    refused: dict[uuid.UUID, str] = field(default_factory=dict)


def rollback_through_checkers(
    engine: sa.Engine,
    store: PreparedStore,
    registry: CheckRegistry,
    *,
    ids: Sequence[uuid.UUID] = (),
    topic: str | None = None,
    check_group: str | None = None,
    check_timeout: float = CHECK_TIMEOUT,
) -> CheckedRollback:
    """Roll back the messages waiting for a verdict that ``ids``, ``topic`` and
    ``check_group`` pick, each once its checker in ``registry``, asked to decide
    (:attr:`~outbox.prepared.CheckMessage.final`), answered ROLLBACK: a checker answers so
    only once the step can no longer happen (``StepLog`` records the id abandoned first).
    Anything else leaves the message as it is: COMMIT (the step happened: check-back commits
    it), UNKNOWN, an error or no answer within ``check_timeout`` seconds (the step may still
    commit), no checker for its group. The checks run outside any transaction of the outbox;
    the rollbacks, recorded as checks answered ROLLBACK, in one afterwards."""
    with engine.connect() as conn:
        rows = store.unresolved(conn, ids=list(ids) or None, topic=topic, check_group=check_group)
    refused: dict[uuid.UUID, str] = {}
    messages: list[CheckMessage] = []
    for row in rows:
        if row["check_group"] not in registry.checkers:
            refused[row["id"]] = f"no checker for its check group {row['check_group']!r}"
            continue
        try:
            messages.append(registry.message(row, final=True))
        except Exception as exc:  # the deserializer's: no check, no rollback
            refused[row["id"]] = f"could not decode it: {type(exc).__name__}: {exc}"
    blocked: list[uuid.UUID] = []
    for outcome in CheckCalls(registry.checkers.__getitem__, check_timeout).run(messages):
        message_id = outcome.message.id
        if outcome.answer == ROLLBACK:
            blocked.append(message_id)
        elif outcome.answer == COMMIT:
            refused[message_id] = (
                "its checker answers COMMIT: the step happened (check-back commits it, or "
                f"`outbox prepared commit {message_id}`)"
            )
        elif outcome.answer == UNKNOWN:
            refused[message_id] = "its checker answers UNKNOWN: its step may still commit"
        elif outcome.answer == TIMEOUT:
            refused[message_id] = (
                f"its checker did not answer within {check_timeout:g}s: its step may still commit"
            )
        else:
            error = stored_text(outcome.error)
            refused[message_id] = f"its checker failed ({error}): its step may still commit"
    with engine.begin() as conn:
        count = store.rollback(conn, blocked, OPERATOR, checked=True)
    return CheckedRollback(frozenset(row["id"] for row in rows), count, refused)


def operator_rollback(
    engine: sa.Engine,
    store: PreparedStore,
    registry: CheckRegistry | None,
    *,
    ids: Sequence[uuid.UUID] = (),
    topic: str | None = None,
    check_group: str | None = None,
    step_cannot_happen: bool = False,
    check_timeout: float = CHECK_TIMEOUT,
) -> CheckedRollback:
    """An operator's rollback of the messages waiting for a verdict that ``ids``, ``topic``
    and ``check_group`` pick, as ``outbox prepared rollback`` and the dashboard do it: through
    ``registry``'s checkers when there is one (:func:`rollback_through_checkers`: only those
    whose checker blocked the step are rolled back); without one, only when the operator says
    that no chosen message's step can happen any more (``step_cannot_happen``), in one
    transaction, and otherwise not at all: :class:`~outbox.errors.StepNotBlocked`.

    A registry and ``step_cannot_happen`` together are refused
    (:class:`~outbox.errors.ConfigError`): the operator would not know which one decided."""
    if registry is not None:
        if step_cannot_happen:
            raise ConfigError(
                "roll back through the checkers or say the steps cannot happen, not both"
            )
        return rollback_through_checkers(
            engine,
            store,
            registry,
            ids=ids,
            topic=topic,
            check_group=check_group,
            check_timeout=check_timeout,
        )
    with engine.begin() as conn:
        rows = store.unresolved(conn, ids=list(ids) or None, topic=topic, check_group=check_group)
        chosen = [row["id"] for row in rows]
        count = _rollback_unchecked(conn, store, chosen, step_cannot_happen)
    return CheckedRollback(frozenset(chosen), count)
