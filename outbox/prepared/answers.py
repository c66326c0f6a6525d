"""The three answers about a prepared message, as RocketMQ's ``LocalTransactionState``."""

from __future__ import annotations

from enum import StrEnum

from outbox.errors import InvalidAnswer


class Answer(StrEnum):
    """What a local transaction or a checker says of a prepared message."""

    #: The business step happened: publish the message.
    COMMIT = "commit"
    #: The business step did not happen and never will: drop the message, for good.
    ROLLBACK = "rollback"
    #: Not known yet: ask again later (check-back, with backoff, up to ``max_checks``).
    UNKNOWN = "unknown"


COMMIT, ROLLBACK, UNKNOWN = Answer.COMMIT, Answer.ROLLBACK, Answer.UNKNOWN


def parse_answer(value: object, who: str) -> Answer:
    """``value`` as an :class:`Answer` (the strings ``"commit"`` & co. too); anything else
    raises :class:`~outbox.errors.InvalidAnswer` naming ``who`` answered it."""
    if isinstance(value, Answer):
        return value
    if isinstance(value, str):
        try:
            return Answer(value.lower())
        except ValueError:
            pass
    raise InvalidAnswer(f"{who} must answer COMMIT, ROLLBACK or UNKNOWN, not {value!r}")
