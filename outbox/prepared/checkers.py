"""The service's side of check-back: a :class:`CheckRegistry` of checkers, one per check group.

A checker is RocketMQ's ``checkLocalTransaction``: asked about a prepared message whose
producer never said COMMIT or ROLLBACK, it looks at the business step (an order in another
database, a payment at a provider) and answers::

    registry = CheckRegistry()
    steps = StepLog()  # the order's transaction ran steps.record(conn, message_id)

    @registry.checker("orders")
    def order_created(message: CheckMessage) -> Answer:
        return steps.answer(orders_engine, message)

A checker answers by the message id the step recorded, never by a business key (a retried
step would get the first attempt's COMMIT), and answers ROLLBACK only once the step can no
longer happen, never because "it should have ended by now" (see
:mod:`outbox.prepared.steps`). An exception or a timeout is no answer: checked again later.

The check-back runner (``outbox checkback myapp.checks:registry``, or
:class:`~outbox.prepared.CheckbackRunner` embedded) runs in the service, next to the code
and credentials the checkers need.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, TypeAlias

from sqlalchemy import RowMapping

from outbox.decoding import Deserializer, JsonDeserializer, last_header
from outbox.errors import ConfigError
from outbox.loading import load_target, register_once
from outbox.prepared.answers import Answer

#: Check groups are names in the outbox table; this is plenty and keeps them printable.
MAX_GROUP_LENGTH = 200


@dataclass(frozen=True)
class CheckMessage:
    """A prepared message, as a checker sees it."""

    id: uuid.UUID
    topic: str
    key: bytes | None
    #: The value as the registry's deserializer decoded it (JSON by default).
    value: Any
    #: The message's own headers (the ``outbox-id`` and ``content-type`` headers are added
    #: when it is published).
    headers: tuple[tuple[str, bytes | None], ...]
    #: The name the checker is registered under: the producer's group, or else the topic.
    group: str
    prepared_at: datetime
    #: Checks made before this one.
    checks: int
    #: The undecoded value.
    raw_value: bytes | None = None
    #: How long ago the message was prepared when it was claimed for this check, by the
    #: database's clock (the one ``prepared_at`` was taken by, whatever this host's says).
    #: Made by hand without it: by this host's clock.
    age_at_claim: timedelta | None = None
    #: This check must decide: on anything but a ROLLBACK the message is not rolled back
    #: (it ends dead for an operator, or the operator's rollback is refused), so a checker
    #: that can make the step impossible does it now and answers ROLLBACK, instead of
    #: UNKNOWN. Set on the last check under ``--on-max-checks rollback`` and on an
    #: operator's rollback through the checker (``outbox prepared rollback --checker``).
    final: bool = False

    @property
    def age(self) -> timedelta:
        """How long ago the message was prepared: :attr:`age_at_claim`, by the database's
        clock."""
        if self.age_at_claim is not None:
            return self.age_at_claim
        return datetime.now(UTC) - self.prepared_at

    def header(self, name: str) -> bytes | None:
        """The last value of header ``name``, or None."""
        return last_header(self.headers, name)


Checker: TypeAlias = Callable[[CheckMessage], "Answer | str | Awaitable[Answer | str]"]


def validate_group(group: object) -> str:
    """A check group name: a non-empty str of printable characters, at most 200 of them."""
    if not isinstance(group, str) or not group.strip():
        raise ConfigError(f"a check group must be a non-empty str, got {group!r}")
    if len(group) > MAX_GROUP_LENGTH or not group.isprintable():
        raise ConfigError(
            f"a check group has at most {MAX_GROUP_LENGTH} printable characters: {group!r}"
        )
    return group


class CheckRegistry:
    """The checkers of one service, by check group (a topic, or a producer group that the
    producer names when it prepares). ``deserializer`` decodes values for the checkers
    (default: what :class:`~outbox.JsonSerializer` wrote)."""

    def __init__(self, *, deserializer: Deserializer | None = None) -> None:
        if deserializer is not None and not callable(getattr(deserializer, "deserialize", None)):
            raise ConfigError("deserializer must have a deserialize(value, content_type) method")
        self.deserializer: Deserializer = deserializer or JsonDeserializer()
        self._checkers: dict[str, Checker] = {}

    def checker(self, *groups: str) -> Callable[[Checker], Checker]:
        """Decorator: ``fn(message) -> COMMIT | ROLLBACK | UNKNOWN`` answers for ``groups``.

        A plain function runs in a worker thread; a coroutine function runs in an event loop
        of its own in that thread. Either is bounded by the runner's check timeout.
        """

        def register(fn: Checker) -> Checker:
            self.add_checker(fn, *groups)
            return fn

        return register

    def add_checker(self, fn: Checker, *groups: str) -> None:
        """Register ``fn`` for ``groups`` (what :meth:`checker` does)."""
        register_once(
            self._checkers,
            fn,
            groups,
            validate=validate_group,
            what="checker",
            name_kind="check group",
        )

    @property
    def groups(self) -> list[str]:
        return list(self._checkers)

    @property
    def checkers(self) -> Mapping[str, Checker]:
        return dict(self._checkers)

    def message(
        self, row: Mapping[str, Any] | RowMapping, *, decode: bool = True, final: bool = False
    ) -> CheckMessage:
        """The message a checker gets, from a claimed row (the value decoded; a value the
        deserializer cannot read, it raises ValueError, is passed undecoded, as bytes; any
        other exception of the deserializer propagates). ``decode=False`` leaves the value
        undecoded; ``final`` asks the checker to decide (:attr:`CheckMessage.final`)."""
        names = row["header_names"] or ()
        values = row["header_values"] or ()
        headers = tuple(zip(names, (_bytes(v) for v in values), strict=True))
        raw = _bytes(row["value"])
        value: Any = raw
        if decode:
            try:
                value = self.deserializer.deserialize(raw, row["content_type"])
            except ValueError:
                value = raw
        age = row.get("age_seconds")
        return CheckMessage(
            id=row["id"],
            topic=row["topic"],
            key=_bytes(row["key"]),
            value=value,
            headers=headers,
            group=row["check_group"],
            prepared_at=row["prepared_at"],
            checks=row["check_count"],
            raw_value=raw,
            age_at_claim=None if age is None else timedelta(seconds=float(age)),
            final=final,
        )


def _bytes(value: object) -> bytes | None:
    return None if value is None else bytes(value)  # type: ignore[call-overload]


def load_registry(target: str) -> CheckRegistry:
    """``"package.module:name"`` -> the :class:`CheckRegistry` it names."""
    found = load_target(target, "myapp.checks:registry")
    if not isinstance(found, CheckRegistry):
        raise ConfigError(
            f"{target} is not an outbox.prepared.CheckRegistry (got {type(found).__name__})"
        )
    if not found.groups:
        raise ConfigError(f"{target} has no checkers")
    return found
