"""How the audited table's messages were relayed, and the limits that fit it.

An at-least-once relay that is killed resends the batch it had not marked sent: duplicates on
the topics are its normal price, not a fault. An exactly-once relay never resends, so one
duplicate is a fault. The job tells the two apart by the exactly-once relay's **progress
topic** (``outbox-progress.<schema>.<table>``, or the relay's ``--progress-topic``): an
exactly-once relay creates it before it sends anything, and an at-least-once relay never does.
So while the topic is absent no message of the table was relayed exactly-once. Where the
topics cannot be listed, the mode is unknown and the strict limits apply.

Plain Python (no PySpark), so it is tested without Spark.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from outbox.schema import OutboxTableSpec
from outbox.spark_jobs.classes import CLASSES, DUPLICATE

AT_LEAST_ONCE, EXACTLY_ONCE, UNKNOWN = "at-least-once", "exactly-once", "unknown"
#: What ``--delivery`` takes: ``auto`` looks for the progress topic.
CHOICES = ("auto", AT_LEAST_ONCE, EXACTLY_ONCE)


@dataclass(frozen=True)
class Delivery:
    """The delivery mode the run assumed, and how it knows."""

    mode: str
    reason: str

    def to_json(self) -> dict[str, str]:
        return {"mode": self.mode, "reason": self.reason}


def progress_topic_of(spec: OutboxTableSpec) -> str:
    """The progress topic an exactly-once relay of ``spec`` uses unless told another."""
    return f"outbox-progress.{spec.qualified_name}"


def decide(choice: str, progress_topic: str, existing_topics: Collection[str] | None) -> Delivery:
    """The mode for ``--delivery choice``; ``existing_topics`` is None when not listed."""
    if choice in (AT_LEAST_ONCE, EXACTLY_ONCE):
        return Delivery(choice, "given with --delivery")
    if choice != "auto":
        raise ValueError(f"--delivery: {choice!r} is not one of {', '.join(CHOICES)}")
    if existing_topics is None:
        return Delivery(
            UNKNOWN,
            "the topics could not be listed to look for the progress topic "
            f"{progress_topic}; give --delivery",
        )
    if progress_topic in existing_topics:
        return Delivery(
            EXACTLY_ONCE, f"the exactly-once relay's progress topic {progress_topic} exists"
        )
    return Delivery(
        AT_LEAST_ONCE,
        f"no progress topic {progress_topic}: no exactly-once relay has sent from this table",
    )


def default_limits(delivery: Delivery) -> dict[str, int | None]:
    """Every class may reach 0, except duplicates after at-least-once relaying: no limit
    (None), since a relay restart resends its last batch. They are still counted."""
    limits: dict[str, int | None] = dict.fromkeys(CLASSES, 0)
    if delivery.mode == AT_LEAST_ONCE:
        limits[DUPLICATE] = None
    return limits
