"""One chaos run, start to verdict.

1. Start a private stack (PostgreSQL, Kafka with a proxied listener, the fault proxy), create
   the outbox table, a business table and the topics.
2. Start the writers and the relays; play the seeded fault schedule, logging every fault.
3. Heal everything, stop the writers, let the relays drain, stop them with SIGTERM.
4. Audit: the reconciliation job (Spark, read_committed) for missing, phantom and duplicate
   messages; the topics read back for per-key order and rolled-back messages; the tables for
   atomicity. The last output line is the result as one JSON object.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from outbox import migrate
from outbox.chaos import audit
from outbox.chaos.relays import RelayFleet
from outbox.chaos.schedule import (
    BROKER_RESTART,
    NET_DROP,
    NET_LATENCY,
    NET_STALL,
    POSTGRES_RESTART,
    RELAY_KILL,
    RELAY_TERM,
    Fault,
    Profile,
    plan,
)
from outbox.chaos.stack import ChaosStack
from outbox.chaos.verdict import Findings
from outbox.chaos.writers import CREATE_BUSINESS_TABLE, Writer
from outbox.devstack.stack import sweep_stale_runs
from outbox.devstack.topics import create_topics

TOPICS = ("chaos.orders", "chaos.payments")
PARTITIONS = 3
#: The longest wait for the relays to send everything once the faults are over.
DRAIN_TIMEOUT = 300.0


@dataclass(frozen=True)
class ChaosSettings:
    mode: str
    seed: int
    profile: Profile
    output: Path
    duration: float | None = None  # overrides the profile's
    rate: float | None = None  # overrides the profile's
    keep_data: bool = False


@dataclass
class ChaosResult:
    settings: ChaosSettings
    seconds: float
    faults: list[dict[str, Any]]
    committed: int
    rolled_back: int
    uncertain: int
    findings: Findings
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        f = self.findings
        return {
            "mode": self.settings.mode,
            "seed": self.settings.seed,
            "profile": self.settings.profile.name,
            "duration_s": round(self.seconds, 1),
            "faults_injected": len(self.faults),
            "faults_by_kind": dict(Counter(fault["kind"] for fault in self.faults)),
            "messages_committed": self.committed,
            "rolled_back": self.rolled_back,
            "missing": f.missing,
            "phantom": f.phantom,
            "duplicates": f.duplicates,
            "order_violations": f.order_violations,
            "verdict": f.verdict,
            "violations": f.violations(),
            **self.extra,
        }


class FaultLog:
    """Prints each event with its wall-clock time and offset, and keeps it as JSON lines."""

    def __init__(self, path: Path, echo: Callable[[str], None]) -> None:
        self.path = path
        self.echo = echo
        self.started = time.monotonic()
        self.faults: list[dict[str, Any]] = []

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def event(self, what: str, **details: Any) -> dict[str, Any]:
        now = datetime.now(UTC)
        entry = {"at": now.isoformat(timespec="milliseconds"), "t": round(self.elapsed(), 1)}
        entry |= {"event": what, **details}
        with self.path.open("a") as out:
            out.write(json.dumps(entry) + "\n")
        self.echo(f"  {now:%H:%M:%S.%f}"[:-3] + f"  +{entry['t']:6.1f}s  {what}")
        return entry


class ChaosRun:
    def __init__(self, settings: ChaosSettings, echo: Callable[[str], None] = print) -> None:
        self.settings = settings
        self.echo = echo
        self.run_id = f"{settings.mode[:3]}-{settings.seed}-{uuid.uuid4().hex[:6]}"
        settings.output.mkdir(parents=True, exist_ok=True)
        self.stack = ChaosStack(f"chaos-{os.getpid()}-{self.run_id}")
        self.profile = settings.profile
        self.rate = settings.rate or self.profile.rate
        self.schedule = plan(settings.seed, self.profile, settings.duration)
        (settings.output / "faults.jsonl").unlink(missing_ok=True)  # a folder used before
        self.log = FaultLog(settings.output / "faults.jsonl", echo)
        self.fleet: RelayFleet | None = None
        self.writers: list[Writer] = []

    # -- the whole run ---------------------------------------------------------------------

    def execute(self) -> ChaosResult:
        started = time.monotonic()
        try:
            self._set_up()
            window_start = datetime.now(UTC) - timedelta(seconds=1)
            self._play()
            self._drain()
            window_end = datetime.now(UTC) + timedelta(seconds=1)
            findings, extra = self._audit(window_start, window_end)
        finally:
            self._tear_down()
        return ChaosResult(
            self.settings,
            time.monotonic() - started,
            list(self.log.faults),
            committed=extra.pop("committed"),
            rolled_back=sum(len(w.tally.rolled_back) for w in self.writers),
            uncertain=sum(len(w.tally.uncertain) for w in self.writers),
            findings=findings,
            extra=extra,
        )

    # -- steps -----------------------------------------------------------------------------

    def _set_up(self) -> None:
        s = self.settings
        self.echo(
            f"chaos run {self.run_id}: {s.mode}, seed {s.seed}, profile {self.profile.name}, "
            f"{len(self.schedule)} faults planned, {self.rate:.0f} msgs/s, "
            f"{self.profile.relays} relays, output {s.output}"
        )
        for fault in self.schedule:
            self.echo(f"  plan +{fault.at:6.1f}s  {fault.describe()}")
        for name in sweep_stale_runs("chaos-"):
            self.echo(f"  removed the servers of an earlier chaos run that was killed: {name}")
        info = self.stack.up()
        migrate.upgrade(info.database_url)
        engine = sa.create_engine(info.database_url)
        with engine.begin() as conn:
            conn.execute(sa.text(CREATE_BUSINESS_TABLE))
        engine.dispose()
        create_topics(self.stack.direct_bootstrap, list(TOPICS), PARTITIONS)
        self.fleet = RelayFleet(
            self.profile.relays,
            info.database_url,
            self.stack.relay_bootstrap,
            s.mode,
            s.output,
            self.run_id,
        )
        self.log.started = time.monotonic()
        self.log.event("servers up; relays and writers starting")
        self.fleet.start_all()
        per_writer = self.rate / self.profile.writers
        self.writers = [
            Writer(i, info.database_url, list(TOPICS), s.seed, per_writer)
            for i in range(self.profile.writers)
        ]
        for writer in self.writers:
            writer.start()

    def _play(self) -> None:
        for fault in self.schedule:
            self._wait_until(fault.at)
            self._inject(fault)
        end = self.settings.duration or self.profile.duration
        self._wait_until(max(end, self.log.elapsed() + 2.0))
        for writer in self.writers:
            writer.stop()
        for writer in self.writers:
            writer.join(60)
        self.log.event("writers stopped")

    def _wait_until(self, offset: float) -> None:
        """Sleep until ``offset`` seconds into the run, restarting relays that died."""
        assert self.fleet is not None
        while True:
            for index, code in self.fleet.check():
                self.log.event(f"relay-{index} exited by itself (code {code}); restarted")
            left = offset - self.log.elapsed()
            if left <= 0:
                return
            time.sleep(min(left, 0.5))

    def _inject(self, fault: Fault) -> None:
        assert self.fleet is not None
        stack, fleet = self.stack, self.fleet
        entry = self.log.event(f"fault {fault.describe()}", fault=fault.to_json())
        self.log.faults.append({**fault.to_json(), "started": entry["at"], "t": entry["t"]})
        if fault.kind == RELAY_KILL:
            fleet.kill(fault.relay or 0)
        elif fault.kind == RELAY_TERM:
            code = fleet.terminate(fault.relay or 0)
            self.log.event(f"relay-{fault.relay} stopped, exit code {code}")
        elif fault.kind == BROKER_RESTART:
            stack.kafka.kill() if fault.how == "kill" else stack.kafka.stop()
        elif fault.kind == POSTGRES_RESTART:
            stack.postgres.stop(mode=fault.how or "fast")
        elif fault.kind == NET_LATENCY:
            stack.proxy.set_latency(fault.latency_ms or 0)
        elif fault.kind == NET_DROP:
            stack.proxy.drop()
        elif fault.kind == NET_STALL:
            stack.proxy.stall()
        self._wait_until(self.log.elapsed() + fault.hold)
        # Heal.
        if fault.kind in (RELAY_KILL, RELAY_TERM):
            fleet.start(fault.relay or 0)
            what = f"relay-{fault.relay} restarted"
        elif fault.kind == BROKER_RESTART:
            stack.kafka.start()
            what = "broker up again"
        elif fault.kind == POSTGRES_RESTART:
            stack.postgres.start()
            what = "PostgreSQL up again"
        else:
            stack.proxy.heal()
            what = "network healed"
        self.log.event(what)

    def _drain(self) -> None:
        assert self.fleet is not None
        self.fleet.ensure_all_running()
        engine = sa.create_engine(self.stack.database_url)
        try:
            deadline = time.monotonic() + DRAIN_TIMEOUT
            while time.monotonic() < deadline:
                counts = audit.status_counts(engine)
                if not counts.get("pending"):
                    break
                self._wait_until(self.log.elapsed() + 0.5)
            self.log.event(f"drained: {audit.status_counts(engine)}")
        finally:
            engine.dispose()
        self._wait_until(self.log.elapsed())  # a last look for relays that died meanwhile
        codes = self.fleet.stop_all()
        self.log.event(f"relays stopped with SIGTERM, exit codes {codes}")

    def _audit(
        self, window_start: datetime, window_end: datetime
    ) -> tuple[Findings, dict[str, Any]]:
        from outbox.chaos.reconciliation import reconcile_run

        self.echo("auditing: reconciliation job (Spark), topics read back, tables")
        summary = reconcile_run(
            self.stack.database_url,
            self.stack.direct_bootstrap,
            TOPICS,
            window_start,
            window_end,
            self.settings.output / "reconcile",
        )
        engine = sa.create_engine(self.stack.database_url)
        try:
            records = audit.read_topics(self.stack.direct_bootstrap, TOPICS)
            rows = audit.row_facts(engine, TOPICS)
            order = audit.order_violations(records, rows)
            rolled_back = [i for w in self.writers for i in w.tally.rolled_back]
            committed = [i for w in self.writers for i in w.tally.committed]
            uncertain = [i for w in self.writers for i in w.tally.uncertain]
            on_topic = {r.message_id for r in records}
            uncertain_present = audit.present_ids(engine, uncertain)
            findings = Findings(
                mode=self.settings.mode,
                reconciliation=summary.per_class(),
                order_violations=len(order),
                rolled_back_in_table=len(audit.present_ids(engine, rolled_back)),
                rolled_back_on_topic=len(on_topic.intersection(rolled_back)),
                lost_commits=len(set(committed) - set(rows)),
                atomicity_breaks=audit.atomicity_breaks(engine, TOPICS),
                relay_crashes=len(self.fleet.crashes) if self.fleet else 0,
                unclean_stops=sum(1 for c in self.fleet.term_exits if c) if self.fleet else 0,
                writer_failures=[repr(w.failure) for w in self.writers if w.failure],
            )
            statuses = audit.status_counts(engine)
        finally:
            engine.dispose()
        for line in order[:20]:
            self.echo(f"  order: {line}")
        extra = {
            "committed": len(rows),  # the table is the truth: confirmed + uncertain that made it
            "outbox_rows": summary.outbox_rows,
            "topic_records": summary.topic_records,
            "reconciliation": summary.per_class(),
            "statuses": statuses,
            "uncertain_commits": len(uncertain),
            "uncertain_committed": len(uncertain_present),
            "relay_term_exit_codes": self.fleet.term_exits if self.fleet else [],
            "output": str(self.settings.output),
        }
        return findings, extra

    def _tear_down(self) -> None:
        for writer in self.writers:
            writer.stop()
        if self.fleet is not None:
            self.fleet.kill_all()
        self.stack.down(keep_files=self.settings.keep_data)
        self.log.event("servers stopped")
