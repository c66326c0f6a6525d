"""Which Kafka errors are worth retrying, and how long to wait before the next attempt."""

from __future__ import annotations

import random
from dataclasses import dataclass

from confluent_kafka import KafkaError

from outbox.rows import UNDECODABLE

__all__ = [
    "ATTEMPTS_EXHAUSTED",
    "REFUSED_WITH_OTHERS",
    "RETRIABLE",
    "UNDECODABLE",
    "RetryPolicy",
    "classify",
]

# Errors no retry can cure: the row goes straight to the dead state with the reason.
PERMANENT_ERRORS: dict[int, str] = {
    KafkaError.MSG_SIZE_TOO_LARGE: "message_too_large",
    KafkaError.INVALID_MSG_SIZE: "message_too_large",
    KafkaError.RECORD_LIST_TOO_LARGE: "message_too_large",
    KafkaError.UNKNOWN_TOPIC_OR_PART: "unknown_topic",
    KafkaError._UNKNOWN_TOPIC: "unknown_topic",
    KafkaError._UNKNOWN_PARTITION: "unknown_topic",
    KafkaError.TOPIC_AUTHORIZATION_FAILED: "topic_unauthorized",
    KafkaError.CLUSTER_AUTHORIZATION_FAILED: "unauthorized",
    KafkaError.TOPIC_EXCEPTION: "invalid_topic",
    KafkaError.INVALID_RECORD: "invalid_record",
    KafkaError.INVALID_MSG: "invalid_record",
    KafkaError._BAD_MSG: "invalid_record",
    KafkaError.INVALID_REQUIRED_ACKS: "invalid_record",
    KafkaError._INVALID_ARG: "invalid_record",
}

#: Refusals of a whole produce request for one record's size or content: the broker answers
#: every record of the request with the same error, so it names the record only when the
#: request held nothing else.
REFUSED_WITH_OTHERS = frozenset({"message_too_large", "invalid_record"})

RETRIABLE = "retriable"
ATTEMPTS_EXHAUSTED = "attempts_exhausted"


def classify(error: KafkaError) -> str:
    """``"retriable"`` or the permanent reason (``"message_too_large"``, ...)."""
    return PERMANENT_ERRORS.get(error.code(), RETRIABLE)


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with full jitter, per message, up to ``max_attempts``.

    The n-th failed attempt waits a random time in ``[0, min(cap, base * 2**(n-1))]``; the
    attempt that reaches ``max_attempts`` makes the row dead.
    """

    max_attempts: int = 12
    base_seconds: float = 0.5
    cap_seconds: float = 300.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or self.base_seconds <= 0 or self.cap_seconds < self.base_seconds:
            raise ValueError("retry policy needs max_attempts >= 1 and 0 < base <= cap")

    def gives_up(self, attempts_so_far: int) -> bool:
        """True when the attempt that just failed was the last one allowed."""
        return attempts_so_far + 1 >= self.max_attempts

    def delay(self, attempts_so_far: int, rng: random.Random | None = None) -> float:
        ceiling = min(self.cap_seconds, self.base_seconds * 2 ** min(attempts_so_far, 30))
        return (rng or random).uniform(0, ceiling)
