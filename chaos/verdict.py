"""The verdict: pure logic on the counts the audit collected, so it is tested without servers."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from outbox.relay.config import EXACTLY_ONCE
from outbox.spark_jobs import discrepancies as d

#: The longest a relay may take from a primary's kill to its first message sent from the
#: promoted standby.
RELAY_RESUME_LIMIT = 15.0
ASYNCHRONOUS = "async"

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
class FailoverFindings:
    """What the failovers of a run did, and what their promotions forgot
    (:mod:`outbox.chaos.forgotten`).

    Synchronous replication must forget nothing anyone saw: the usual verdict holds, and no
    forgotten row may be on a topic. Asynchronous replication forgets the lag: its phantoms
    (records whose rows no database has) and its messages sent twice (a forgotten mark) are
    counted, and each must be one a promotion forgot; nothing the last primary holds may be
    lost."""

    replication: str
    failovers: int
    forgotten_rows: int = 0  # committed on a killed primary, on no later one
    forgotten_on_topic: int = 0  # of those, on a topic: the phantoms the promotions made
    forgotten_sends: int = 0  # sent again because a promotion forgot the mark
    forgotten_applications: int = 0  # applied by the service, the application forgotten
    confirmed_forgotten: int = 0  # commits a writer saw confirmed, then forgotten
    phantoms_not_forgotten: int = 0  # records without a row that no killed primary held
    reconciliation_phantoms: int = 0  # the job's phantom count: must be forgotten_on_topic
    duplicates_not_forgotten: int = 0  # exactly-once copies that no forgotten mark explains
    #: Forgotten sends of due scheduled messages that the relay made pending again (a new
    #: seq), and the per-key order violations (topics and applied) that name one of them:
    #: their first copy came from the forgotten history, their seq from the new one.
    made_pending_again: int = 0
    order_excused: int = 0
    #: Per failover, seconds from the kill to the first record a relay sent afterwards.
    relay_resumed_s: tuple[float | None, ...] = ()

    def violations(self, mode: str) -> list[str]:
        found = _counted(
            (self.phantoms_not_forgotten, "records without a row that no promotion forgot"),
        )
        if self.reconciliation_phantoms != self.forgotten_on_topic:
            found.append(
                f"the reconciliation found {self.reconciliation_phantoms} phantoms, the "
                f"promotions made {self.forgotten_on_topic}"
            )
        if self.replication != ASYNCHRONOUS and self.forgotten_on_topic:
            found.append(
                f"{self.forgotten_on_topic} messages on a topic that a synchronous promotion forgot"
            )
        if self.replication != ASYNCHRONOUS and self.confirmed_forgotten:
            found.append(
                f"{self.confirmed_forgotten} confirmed commits a synchronous promotion forgot"
            )
        if mode == EXACTLY_ONCE and self.duplicates_not_forgotten:
            found.append(
                f"{self.duplicates_not_forgotten} duplicates in exactly-once mode that no "
                "forgotten mark explains"
            )
        for number, seconds in enumerate(self.relay_resumed_s, 1):
            if seconds is None:
                found.append(f"failover {number}: no relay sent from the new primary")
            elif seconds > RELAY_RESUME_LIMIT:
                found.append(
                    f"failover {number}: the relays sent from the new primary {seconds:.1f} s "
                    f"after the kill (limit {RELAY_RESUME_LIMIT:.0f} s)"
                )
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
    failover: FailoverFindings | None = None  # None: the run had no standby

    @property
    def _asynchronous_failover(self) -> bool:
        """Phantoms and exactly-once duplicates are then the failover findings' to judge."""
        return self.failover is not None and self.failover.replication == ASYNCHRONOUS

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
            if name == d.PHANTOM and self._asynchronous_failover:
                continue
            if count := self.reconciliation.get(name, 0):
                found.append(f"{count} {name.replace('_', ' ')}")
        if self.mode == EXACTLY_ONCE and self.duplicates and not self._asynchronous_failover:
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
        if self.failover is not None:
            found += self.failover.violations(self.mode)
        return found

    @property
    def verdict(self) -> str:
        return "FAIL" if self.violations() else "PASS"


def _counted(*checks: tuple[int, str]) -> list[str]:
    """``"<count> <what>"`` for each check whose count is not zero."""
    return [f"{count} {what}" for count, what in checks if count]
