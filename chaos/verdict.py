"""The verdict: pure logic on the counts the audit collected, so it is tested without servers."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from outbox.relay.config import EXACTLY_ONCE
from outbox.spark_jobs import discrepancies as d

#: Classes that are a violation in both modes (``duplicate`` only in exactly-once mode;
#: ``late`` is expected while faults hold deliveries back).
ALWAYS_ZERO = (d.PHANTOM, d.PAYLOAD_MISMATCH, d.MISROUTED, d.OFFSET_MISMATCH)


@dataclass(frozen=True)
class ConsumingFindings:
    """What the consuming stage's audit found: the service's applications of the messages."""

    consumers: int
    applied: int  # rows of the effect table: one per application
    missing: int = 0  # committed messages never applied
    applied_twice: int = 0  # messages applied more than once
    not_committed: int = 0  # applied, yet no committed outbox row
    order_violations: int = 0  # per topic and key, applied out of the writers' order
    parked: int = 0  # messages the consumers gave up on
    caught_up: bool = True  # the group's offsets reached the topics' ends in time
    consumer_crashes: int = 0  # consumers that exited without being told to
    unclean_stops: int = 0  # consumers that did not exit 0 after SIGTERM

    def violations(self) -> list[str]:
        found = _counted(
            (self.missing, "committed messages never applied by the consumers"),
            (self.applied_twice, "messages applied more than once"),
            (self.not_committed, "applied messages that were never committed"),
            (self.order_violations, "per-key order violations on the applied side"),
            (self.parked, "messages parked by the consumers"),
            (self.consumer_crashes, "consumer exits nobody asked for"),
            (self.unclean_stops, "consumers that did not exit 0 after SIGTERM"),
        )
        if not self.caught_up:
            found.append("the consumers did not reach the end of the topics in time")
        return found


@dataclass(frozen=True)
class Findings:
    """Everything the audit found after a run drained."""

    mode: str
    reconciliation: Mapping[str, int]  # count per discrepancy class
    order_violations: int = 0
    rolled_back_in_table: int = 0
    rolled_back_on_topic: int = 0
    lost_commits: int = 0  # confirmed to a writer, yet no outbox row
    atomicity_breaks: int = 0  # outbox rows and business rows that disagree
    relay_crashes: int = 0  # relays that exited without being told to
    unclean_stops: int = 0  # relays that did not exit 0 after SIGTERM
    writer_failures: list[str] = field(default_factory=list)
    consuming: ConsumingFindings | None = None  # None: the run had no consuming stage

    @property
    def missing(self) -> int:
        """Committed messages not on their topic: marked sent but absent, or never sent."""
        return self.reconciliation.get(d.MISSING, 0) + self.reconciliation.get(d.STUCK, 0)

    @property
    def duplicates(self) -> int:
        return self.reconciliation.get(d.DUPLICATE, 0)

    @property
    def phantom(self) -> int:
        return self.reconciliation.get(d.PHANTOM, 0)

    def violations(self) -> list[str]:
        """One line per broken guarantee; empty means the run passed."""
        found = []
        if self.missing:
            found.append(f"{self.missing} committed messages missing from the topics")
        for name in ALWAYS_ZERO:
            if count := self.reconciliation.get(name, 0):
                found.append(f"{count} {name.replace('_', ' ')}")
        if self.mode == EXACTLY_ONCE and self.duplicates:
            found.append(f"{self.duplicates} duplicates in exactly-once mode")
        found += _counted(
            (self.order_violations, "per-key order violations"),
            (self.rolled_back_in_table, "rolled-back messages in the outbox table"),
            (self.rolled_back_on_topic, "rolled-back messages on a topic"),
            (self.lost_commits, "confirmed commits without an outbox row"),
            (self.atomicity_breaks, "outbox rows and business rows that disagree"),
            (self.relay_crashes, "relay exits nobody asked for"),
            (self.unclean_stops, "relays that did not exit 0 after SIGTERM"),
        )
        found += [f"writer failed: {failure}" for failure in self.writer_failures]
        if self.consuming is not None:
            found += self.consuming.violations()
        return found

    @property
    def verdict(self) -> str:
        return "FAIL" if self.violations() else "PASS"


def _counted(*checks: tuple[int, str]) -> list[str]:
    """``"<count> <what>"`` for each check whose count is not zero."""
    return [f"{count} {what}" for count, what in checks if count]
