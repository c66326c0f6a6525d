"""One chaos run, start to verdict.

1. Start a private stack (PostgreSQL, Kafka (one broker or a cluster) with a proxied listener
   per node, the fault proxies), create
   the outbox table, a business table and the topics, and the consuming service's database
   with the inbox tables and the service's effect table.
2. Start the writers, the relays and the consumers; play the seeded fault schedule, logging
   every fault.
3. Heal everything, stop the writers, let the relays drain, stop them with SIGTERM.
4. Audit: the reconciliation job (Spark, read_committed) for missing, phantom and duplicate
   messages; the topics read back for per-key order and rolled-back messages; the tables for
   atomicity. Then let the consumers reach the topics' ends, stop them with SIGTERM, and check
   that the service applied every committed message once, per key in order. The last output
   line is the result as one JSON object.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from outbox import migrate
from outbox.chaos import applied, audit, forgotten
from outbox.chaos.brokers import broker_target, stop_nodes
from outbox.chaos.consumers import ConsumerFleet, wait_caught_up
from outbox.chaos.fleet import ProcessFleet
from outbox.chaos.handover import ShardWatch, by_fault, gap_lines
from outbox.chaos.relays import RelayFleet
from outbox.chaos.schedule import (
    BROKER_RESTART,
    BROKERS_DOWN,
    CONSUMER_KILL,
    CONSUMER_TERM,
    DB_DROP,
    DB_FAILOVER,
    DB_LATENCY,
    DB_STALL,
    NET_DROP,
    NET_LATENCY,
    NET_STALL,
    POSTGRES_RESTART,
    PROCESS_FAULTS,
    RELAY_KILL,
    RELAY_TERM,
    WRITER_KILL,
    Fault,
    Profile,
    plan,
)
from outbox.chaos.service import prepare_database
from outbox.chaos.stack import DATABASE, SERVICE_DATABASE, ChaosStack
from outbox.chaos.verdict import ASYNCHRONOUS, ConsumingFindings, FailoverFindings, Findings
from outbox.chaos.visibility import RECORD_MADE_PENDING
from outbox.chaos.writer_fleet import WriterFleet
from outbox.chaos.writers import CREATE_BUSINESS_TABLE, PARTITIONS, TOPICS, Tally, Writer
from outbox.devstack.stack import sweep_stale_runs
from outbox.devstack.topics import create_topics
from outbox.relay.config import AT_LEAST_ONCE

#: The longest wait for the relays to send everything once the faults are over.
DRAIN_TIMEOUT = 300.0
#: How long after the drain a hand-over still under way may take to give every shard an owner.
HANDOVER_SETTLE_TIMEOUT = 30.0
#: The longest wait, after the reconciliation, for the consumers to reach the topics' ends.
CATCH_UP_TIMEOUT = 180.0


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
        body = {
            "mode": self.settings.mode,
            "seed": self.settings.seed,
            "profile": self.settings.profile.name,
            "brokers": self.settings.profile.brokers,
            "replication": self.settings.profile.replication,
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
        if f.consuming is not None:
            body["consuming"] = {**asdict(f.consuming), **self.extra.get("consuming", {})}
        if f.failover is not None:
            body["failover"] = asdict(f.failover)
        return body


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


#: What a run writes in its folder that it appends to (processes that restart reopen them):
#: left by an earlier run in the same folder, they would count with this one's (its writers'
#: journals, read back as commits this run's database must hold).
EARLIER_RUN_FILES = (
    "faults.jsonl",
    "handover.jsonl",
    "writer-*.jsonl",
    "writer-*.sent",
    "relay-*.log",
    "writer-*.log",
    "consumer-*.log",
)


def clear_earlier_run(output: Path) -> None:
    """Remove what an earlier run left in ``output`` (only the files a run writes)."""
    for pattern in EARLIER_RUN_FILES:
        for path in output.glob(pattern):
            path.unlink()


class ChaosRun:
    def __init__(self, settings: ChaosSettings, echo: Callable[[str], None] = print) -> None:
        self.settings = settings
        self.echo = echo
        self.run_id = f"{settings.mode[:3]}-{settings.seed}-{uuid.uuid4().hex[:6]}"
        settings.output.mkdir(parents=True, exist_ok=True)
        self.profile = settings.profile
        self.stack = ChaosStack(
            f"chaos-{os.getpid()}-{self.run_id}",
            brokers=self.profile.brokers,
            replication=self.profile.replication,
        )
        #: Each failover's times: the kill, the promotion, the new standby (wall clock).
        self.failovers: list[dict[str, float]] = []
        self.rate = settings.rate or self.profile.rate
        self.schedule = plan(settings.seed, self.profile, settings.duration)
        clear_earlier_run(settings.output)
        self.log = FaultLog(settings.output / "faults.jsonl", echo)
        self.fleet: RelayFleet | None = None
        self.consumers: ConsumerFleet | None = None
        self.service_url = ""
        self.writers: list[Writer] = []
        self.writer_fleet: WriterFleet | None = None
        self.writer_fleet_stopped = False
        self.shard_watch: ShardWatch | None = None
        #: What the promotions forgot (None until the audit, or without failovers).
        self.forgotten: forgotten.Forgotten | None = None
        self.old_holdings: list[forgotten.Holdings] = []
        self.forgotten_applications: frozenset[uuid.UUID] = frozenset()
        #: Order violations excused as made pending again after a promotion (topics, applied).
        self.reordered = 0

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
            rolled_back=sum(len(t.rolled_back) for t in self._tallies()),
            uncertain=sum(len(t.uncertain) for t in self._tallies()),
            findings=findings,
            extra=extra,
        )

    # -- steps -----------------------------------------------------------------------------

    def _set_up(self) -> None:
        s = self.settings
        replication = self.profile.replication
        standby = f"a standby ({replication}), " if replication else ""
        self.echo(
            f"chaos run {self.run_id}: {s.mode}, seed {s.seed}, profile {self.profile.name}, "
            f"{len(self.schedule)} faults planned, {self.rate:.0f} msgs/s, "
            f"{self.profile.brokers} Kafka node(s), "
            f"{standby}"
            f"{self.profile.relays} relays, "
            f"{self.profile.consumers} consumers, "
            f"{self.profile.writers} writer threads and {self.profile.writer_processes} "
            "writer processes, "
            f"output {s.output}"
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
            for statement in RECORD_MADE_PENDING:
                conn.execute(sa.text(statement))
        engine.dispose()
        create_topics(self.stack.direct_bootstrap, list(TOPICS), PARTITIONS)
        self.fleet = RelayFleet(
            self.profile.relays,
            self.stack.relay_database_url,
            self.stack.proxied_bootstrap,
            s.mode,
            s.output,
            self.run_id,
        )
        if self.profile.consumers:
            self.service_url = self.stack.service_database_url()
            prepare_database(self.service_url)
            self.consumers = ConsumerFleet(
                self.profile.consumers, self.service_url, self.stack.proxied_bootstrap, s.output
            )
        self.log.started = time.monotonic()
        self.log.event("servers up; relays, consumers and writers starting")
        for fleet in self._fleets():
            fleet.start_all()
        self.shard_watch = ShardWatch(self.stack.conninfo(DATABASE), self.log.elapsed)
        self.shard_watch.start()
        per_writer = self.rate / (self.profile.writers + self.profile.writer_processes)
        self.writers = [
            Writer(i, info.database_url, list(TOPICS), s.seed, per_writer)
            for i in range(self.profile.writers)
        ]
        for writer in self.writers:
            writer.start()
        if self.profile.writer_processes:
            # Immediate send is at-least-once whatever the relays do (docs/immediate-send.md):
            # an exactly-once run leaves sending to its relays.
            self.writer_fleet = WriterFleet(
                self.profile.writer_processes,
                info.database_url,
                self.stack.proxied_bootstrap,
                s.output,
                rate=per_writer,
                seed=s.seed,
                immediate=s.mode == AT_LEAST_ONCE,
            )
            self.writer_fleet.start_all()

    def _play(self) -> None:
        for fault in self.schedule:
            self._wait_until(fault.at)
            self._wait_serving()
            self._inject(fault)
        end = self.settings.duration or self.profile.duration
        self._wait_until(max(end, self.log.elapsed() + 2.0))
        for writer in self.writers:
            writer.stop()
        writer_exits = self.writer_fleet.stop_all() if self.writer_fleet else []
        for writer in self.writers:
            writer.join(60)
        self.log.event(f"writers stopped (processes' exit codes {writer_exits})")
        self.writer_fleet_stopped = True

    def _fleets(self) -> list[ProcessFleet]:
        """The fleets to keep running: relays, consumers, and the writers until they stop."""
        writers = None if self.writer_fleet_stopped else self.writer_fleet
        return [fleet for fleet in (self.fleet, self.consumers, writers) if fleet is not None]

    def _tallies(self) -> list[Tally]:
        """What every writer did: the threads', and the processes' from their journals."""
        processes = self.writer_fleet.tallies() if self.writer_fleet else []
        return [w.tally for w in self.writers] + processes

    def _wait_until(self, offset: float) -> None:
        """Sleep until ``offset`` seconds into the run, restarting relays and consumers that
        died."""
        while True:
            for fleet in self._fleets():
                for index, code in fleet.check():
                    self.log.event(
                        f"{fleet.name}-{index} exited by itself (code {code}); restarted"
                    )
            left = offset - self.log.elapsed()
            if left <= 0:
                return
            time.sleep(min(left, 0.5))

    def _wait_serving(self) -> None:
        """Before a fault, let every relay and consumer finish starting, as a broker or a
        database is up before the next fault: a SIGTERM landing while a process still imports
        would end it before its handler exists, and a relay exits when its first look at the
        database fails (it serves only after that look)."""
        for fleet in self._fleets():
            for index in range(fleet.count):
                fleet.wait_serving(index)

    def _target(self, fault: Fault) -> tuple[ProcessFleet, int] | None:
        """The fleet and index of the process a fault stops, if it stops one."""
        if fault.kind in (RELAY_KILL, RELAY_TERM) and self.fleet is not None:
            return self.fleet, fault.relay or 0
        if fault.kind in (CONSUMER_KILL, CONSUMER_TERM) and self.consumers is not None:
            return self.consumers, fault.consumer or 0
        if fault.kind == WRITER_KILL and self.writer_fleet is not None:
            return self.writer_fleet, fault.writer or 0
        return None

    def _inject(self, fault: Fault) -> None:
        entry = self.log.event(f"fault {fault.describe()}", fault=fault.to_json())
        self.log.faults.append({**fault.to_json(), "started": entry["at"], "t": entry["t"]})
        logged = self.log.faults[-1]
        if not fault.parts:
            self._break(fault)
            self._wait_until(self.log.elapsed() + fault.hold)
            logged["healed"] = self.log.event(self._heal(fault))["t"]
            return
        # An overlap: the second fault lands while the first holds. Each part's hold counts
        # from when it is in place (a broker's controlled shutdown can take longer than the
        # hold), and a stopped process still comes back only after the first part healed.
        first, second = fault.parts
        self._break(first)
        first_down = self.log.elapsed()
        self._wait_until(first_down + second.at - first.at)
        self._break(second)
        second_down = self.log.elapsed()
        self.log.event(f"and now {second.describe()}")
        heals = [(first_down + first.hold, first), (second_down + second.hold, second)]
        if second.kind in PROCESS_FAULTS:
            heals[1] = (max(heals[1][0], heals[0][0] + 0.1), second)
        for heal_at, part in sorted(heals, key=lambda heal: heal[0]):
            self._wait_until(heal_at)
            logged["healed"] = self.log.event(self._heal(part))["t"]

    def _break(self, fault: Fault) -> None:
        stack, target = self.stack, self._target(fault)
        if fault.parts:
            raise ValueError("an overlap is broken part by part")
        if target is not None:
            fleet, index = target
            if fault.kind in (RELAY_KILL, CONSUMER_KILL, WRITER_KILL):
                fleet.kill(index)
            else:
                code = fleet.terminate(index)
                self.log.event(f"{fleet.name}-{index} stopped, exit code {code}")
        elif fault.kind in (BROKER_RESTART, BROKERS_DOWN):
            hit = broker_target(stack, fault, self.settings.mode, self.run_id)
            self.log.event(f"stopping {hit.why}")
            stop_nodes(hit.nodes, fault.how or "term")
        elif fault.kind == POSTGRES_RESTART:
            stack.postgres.stop(mode=fault.how or "fast")
        elif fault.kind == DB_FAILOVER:
            self.failovers.append({"killed": stack.kill_primary()})
            self.log.event(f"primary on port {stack.postgres.port} killed (-9)")
        elif fault.kind == NET_LATENCY:
            stack.proxy.set_latency(fault.latency_ms or 0)
        elif fault.kind == NET_DROP:
            stack.proxy.drop()
        elif fault.kind == NET_STALL:
            stack.proxy.stall()
        elif fault.kind in (DB_LATENCY, DB_DROP, DB_STALL):
            database = stack.database_proxy
            assert database is not None
            if fault.kind == DB_LATENCY:
                database.set_latency(fault.latency_ms or 0)
            elif fault.kind == DB_DROP:
                database.drop()
            else:
                database.stall()

    def _heal(self, fault: Fault) -> str:
        """Undo ``fault``; says what was done."""
        stack, target = self.stack, self._target(fault)
        if target is not None:
            fleet, index = target
            fleet.start(index)
            return f"{fleet.name}-{index} restarted"
        if fault.kind in (BROKER_RESTART, BROKERS_DOWN):
            stack.start_kafka()
            return "Kafka up again" if stack.cluster else "broker up again"
        if fault.kind == POSTGRES_RESTART:
            stack.postgres.start()
            return "PostgreSQL up again"
        if fault.kind == DB_FAILOVER:
            stack.promote_standby()
            self.failovers[-1]["promoted"] = time.time()
            self.log.event(
                f"standby on port {stack.postgres.port} promoted; the relays' address moved to it"
            )
            took = stack.rebuild_standby()
            self.failovers[-1]["rebuilt"] = time.time()
            return f"a new {stack.replication} standby caught up, {took:.1f} s to build"
        if fault.kind in (DB_LATENCY, DB_DROP, DB_STALL):
            assert stack.database_proxy is not None
            stack.database_proxy.heal()
            return "relays' database path healed"
        stack.proxy.heal()
        return "network healed"

    def _drain(self) -> None:
        assert self.fleet is not None
        for fleet in self._fleets():
            fleet.ensure_all_running()
        engine = sa.create_engine(self.stack.database_url)
        try:
            deadline = time.monotonic() + DRAIN_TIMEOUT
            while time.monotonic() < deadline:
                counts = audit.status_counts(engine)
                if not counts.get("pending") and not counts.get("scheduled"):
                    break
                self._wait_until(self.log.elapsed() + 0.5)
            self.log.event(f"drained: {audit.status_counts(engine)}")
        finally:
            engine.dispose()
        self._wait_until(self.log.elapsed())  # a last look for relays that died meanwhile
        if self.shard_watch is not None:
            # A hand-over the last fault began may still be under way once all is sent: it is
            # timed to its end; shards still ownerless after that wait never closed.
            if not self.shard_watch.settle(HANDOVER_SETTLE_TIMEOUT):
                self.log.event(
                    f"shards still ownerless {HANDOVER_SETTLE_TIMEOUT:.0f} s after the drain"
                )
            self.shard_watch.stop()  # before the relays let their shards go on purpose
        codes = self.fleet.stop_all()
        self.log.event(f"relays stopped with SIGTERM, exit codes {codes}")

    def _audit(
        self, window_start: datetime, window_end: datetime
    ) -> tuple[Findings, dict[str, Any]]:
        from outbox.chaos.reconciliation import reconcile_run

        self.echo("auditing: reconciliation job (Spark), topics read back, tables, consumers")
        self._read_old_primaries()
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
            unordered: list[str] = []  # inversions of overlapping transactions (allowed)
            order = audit.order_violations(records, rows, unordered)
            order, self.reordered = self._excuse_made_pending_again(order)
            tallies = self._tallies()
            rolled_back = [i for t in tallies for i in t.rolled_back]
            committed = [i for t in tallies for i in t.committed]
            uncertain = [i for t in tallies for i in t.uncertain]
            on_topic = {r.message_id for r in records}
            uncertain_present = audit.present_ids(engine, uncertain)
            lost = self._lost(committed, rows)
            # A row a promotion forgot did commit (on the old primary): not a rollback.
            forgotten_rows = self.forgotten.rows if self.forgotten else frozenset()
            # An uncertain commit that did not happen (a writer killed before or during its
            # COMMIT) must be as absent from the topics as a rollback.
            never_committed = set(rolled_back) | (set(uncertain) - set(uncertain_present))
            never_committed -= forgotten_rows
            findings = Findings(
                mode=self.settings.mode,
                reconciliation=summary.per_class(),
                order_violations=len(order),
                rolled_back_in_table=len(audit.present_ids(engine, rolled_back)),
                rolled_back_on_topic=len(on_topic & never_committed),
                lost_commits=len(lost - forgotten_rows),
                atomicity_breaks=audit.atomicity_breaks(engine, TOPICS),
                relay_crashes=len(self.fleet.crashes) if self.fleet else 0,
                unclean_stops=sum(1 for c in self.fleet.term_exits if c) if self.fleet else 0,
                writer_failures=[repr(w.failure) for w in self.writers if w.failure]
                + [
                    f"writer process {index} exited by itself with code {code}"
                    for index, code in (self.writer_fleet.crashes if self.writer_fleet else [])
                ],
                failover=self._failover_findings(summary.per_class(), records, rows, lost),
            )
            statuses = audit.status_counts(engine)
        finally:
            engine.dispose()
        for line in order[:20]:
            self.echo(f"  order: {line}")
        consuming, consuming_extra = self._audit_consuming(records, rows)
        findings = replace(findings, consuming=consuming)
        if findings.failover is not None:  # the applied side's excused violations too
            findings = replace(
                findings, failover=replace(findings.failover, order_excused=self.reordered)
            )
        extra = {
            "committed": len(rows),  # the table is the truth: confirmed + uncertain that made it
            "outbox_rows": summary.outbox_rows,
            "topic_records": summary.topic_records,
            "reconciliation": summary.per_class(),
            "statuses": statuses,
            "unordered_overlaps": len(unordered),
            "uncertain_commits": len(uncertain),
            "uncertain_committed": len(uncertain_present),
            "relay_term_exit_codes": self.fleet.term_exits if self.fleet else [],
            "writer_processes": self.writer_fleet.figures() if self.writer_fleet else {},
            # Seconds until every shard had an owner again, by the fault that opened the gap;
            # and until each shard had one.
            "handover": by_fault(self.shard_watch.gaps, self.log.faults)
            if self.shard_watch
            else {},
            "handover_per_shard": by_fault(self.shard_watch.shard_gaps, self.log.faults)
            if self.shard_watch
            else {},
            "output": str(self.settings.output),
        }
        if consuming_extra:
            extra["consuming"] = consuming_extra
        if self.failovers:
            extra["failovers"] = self._failover_figures(records)
        if self.shard_watch is not None:
            with (self.settings.output / "handover.jsonl").open("w") as out:
                for gap in gap_lines(self.shard_watch, self.log.faults):
                    out.write(json.dumps(gap) + "\n")
        return findings, extra

    def _audit_consuming(
        self, records: list[audit.TopicRecord], rows: dict[uuid.UUID, audit.RowFacts]
    ) -> tuple[ConsumingFindings | None, dict[str, Any]]:
        """Wait for the consumers to reach the end of every partition (the relays are stopped,
        so the topics are final), stop them, and check what the service applied."""
        if self.consumers is None:
            return None, {}
        started = time.monotonic()
        behind = wait_caught_up(
            self.stack.direct_bootstrap,
            audit.partition_ends(records),
            CATCH_UP_TIMEOUT,
            pause=lambda: self._wait_until(self.log.elapsed() + 1.0),
        )
        waited = time.monotonic() - started
        if behind:
            self.log.event(f"consumers still behind after {waited:.0f}s: {behind}")
        else:
            self.log.event(f"consumers at the end of every partition after {waited:.1f}s")
        codes = self.consumers.stop_all()
        self.log.event(f"consumers stopped with SIGTERM, exit codes {codes}")
        found, inbox = applied.audit_service(self.service_url, rows)
        missing, not_committed = list(found.missing), list(found.not_committed)
        if self.forgotten is not None:
            self.forgotten_applications = self._forgotten_applications()
        if self.forgotten is not None and self.stack.replication == ASYNCHRONOUS:
            # Counted as what the promotions forgot (the failover findings), not lost here:
            # applications of messages whose application the promotion forgot, and of
            # messages whose row it forgot (phantoms).
            missing = [i for i in missing if i not in self.forgotten_applications]
            not_committed = [i for i in not_committed if i not in self.forgotten.rows]
        for what, ids in (("never applied", missing), ("applied twice", found.applied_twice)):
            if ids:
                self.echo(f"  {what}: {len(ids)}, e.g. {', '.join(map(str, ids[:5]))}")
        applied_order, reordered = self._excuse_made_pending_again(found.order)
        if self.stack.replication == ASYNCHRONOUS:
            # A message whose application the promotion forgot is applied again when it comes
            # again (its mark forgotten too), after the key's later ones: counted as forgotten.
            named = [str(message_id) for message_id in self.forgotten_applications]
            kept = [line for line in applied_order if not any(text in line for text in named)]
            reordered += len(applied_order) - len(kept)
            applied_order = kept
        self.reordered += reordered
        for line in applied_order[:20]:
            self.echo(f"  applied order: {line}")
        fleet = self.consumers
        findings = ConsumingFindings(
            consumers=fleet.count,
            applied=found.applied,
            missing=len(missing),
            applied_twice=len(found.applied_twice),
            not_committed=len(not_committed),
            order_violations=len(applied_order),
            parked=inbox["parked"],
            caught_up=not behind,
            consumer_crashes=len(fleet.crashes),
            unclean_stops=sum(1 for code in fleet.term_exits if code),
        )
        figures = {
            "inbox_rows": inbox["inbox_rows"],
            "duplicates_skipped": fleet.counted["duplicates_skipped"],
            "processed": fleet.counted["processed"],
            "catch_up_s": round(waited, 1),
            "term_exit_codes": fleet.term_exits,
        }
        return findings, figures

    # -- what the failovers forgot -------------------------------------------------------

    def _read_old_primaries(self) -> None:
        """Read every killed primary back (its folder was kept), and the last primary's
        rows and sends, before anything else looks at them."""
        self.forgotten = None
        self.old_holdings = []
        if not self.stack.old_primaries:
            return
        service = SERVICE_DATABASE if self.consumers is not None else None
        for folder in self.stack.old_primaries:
            self.old_holdings.append(
                forgotten.read_old_primary(folder, self.stack.postgres.password, DATABASE, service)
            )
        last = forgotten.read(self.stack.conninfo(), DATABASE, None)
        self.forgotten = forgotten.compare(self.old_holdings, last)

    def _excuse_made_pending_again(self, lines: list[str]) -> tuple[list[str], int]:
        """Order violations that name a message a promotion made the relay make pending
        again (:mod:`outbox.chaos.forgotten`): its first copy came from the forgotten history,
        its seq from the new one. Returns the other violations, and how many were excused."""
        again = self.forgotten.made_pending_again if self.forgotten else frozenset()
        if not again:
            return lines, 0
        named = [str(message_id) for message_id in again]
        kept = [line for line in lines if not any(text in line for text in named)]
        return kept, len(lines) - len(kept)

    def _forgotten_applications(self) -> frozenset[uuid.UUID]:
        """Applications a killed primary held that the last one does not (the consumers
        have stopped)."""
        last = forgotten.read(self.stack.conninfo(), DATABASE, SERVICE_DATABASE)
        return forgotten.compare(self.old_holdings, last).applications

    def _lost(self, committed: list[uuid.UUID], rows: Mapping[uuid.UUID, object]) -> set[uuid.UUID]:
        """Commits a writer saw confirmed that the table does not hold."""
        return set(committed) - set(rows)

    def _failover_findings(
        self,
        per_class: Mapping[str, int],
        records: list[audit.TopicRecord],
        rows: Mapping[uuid.UUID, audit.RowFacts],
        lost: set[uuid.UUID],
    ) -> FailoverFindings | None:
        replication = self.stack.replication
        if replication is None:
            return None
        gone = self.forgotten or forgotten.Forgotten()
        on_topic = {r.message_id for r in records if r.message_id is not None}
        phantoms = on_topic - set(rows)
        copies = Counter(r.message_id for r in records if r.message_id in rows)
        twice = {message_id for message_id, count in copies.items() if count > 1}
        return FailoverFindings(
            replication=replication,
            failovers=len(self.failovers),
            forgotten_rows=len(gone.rows),
            forgotten_on_topic=len(gone.rows & on_topic),
            forgotten_sends=len(gone.sends),
            forgotten_applications=len(self.forgotten_applications),
            confirmed_forgotten=len(lost & gone.rows),
            phantoms_not_forgotten=len(phantoms - gone.rows),
            reconciliation_phantoms=per_class.get("phantom", 0),
            duplicates_not_forgotten=len(twice - gone.sends),
            made_pending_again=len(gone.made_pending_again),
            order_excused=self.reordered,
            relay_resumed_s=tuple(
                figures["relay_first_send_s"] for figures in self._failover_figures(records)
            ),
        )

    def _failover_figures(self, records: list[audit.TopicRecord]) -> list[dict[str, Any]]:
        """Per failover: seconds from the kill to the promotion, to the new standby, to the
        first record a relay sent from the new primary; and what the writer threads saw."""
        immediate = self.writer_fleet.sent_immediately() if self.writer_fleet else set()
        by_relays = sorted(r.timestamp_ms for r in records if r.message_id not in immediate)
        outages = [outage for writer in self.writers for outage in writer.tally.outages]
        figures = []
        kills = [failover["killed"] for failover in self.failovers]
        for failover, next_kill in zip(self.failovers, [*kills[1:], float("inf")], strict=True):
            killed = failover["killed"]
            promoted_ms = failover.get("promoted", killed) * 1000
            first = next((ms for ms in by_relays if ms >= promoted_ms), None)
            # Stretches of errors that began at this kill (a writer may have been in one
            # second before it), and before the next.
            seen = [o for o in outages if killed - 1.0 <= o[0] < next_kill - 1.0]
            back = [o[1] - killed for o in seen if o[1] is not None]
            figures.append(
                {
                    "promoted_s": round(failover.get("promoted", killed) - killed, 2),
                    "standby_rebuilt_s": round(failover.get("rebuilt", killed) - killed, 1),
                    "relay_first_send_s": None
                    if first is None
                    else round(first / 1000 - killed, 2),
                    "writer_errors": sum(o[2] for o in seen),
                    "writers_failing": len(seen),
                    "writers_committing_again_s": round(max(back), 2) if back else None,
                }
            )
        return figures

    def _tear_down(self) -> None:
        if self.shard_watch is not None:
            self.shard_watch.stop()
        for writer in self.writers:
            writer.stop()
        if self.writer_fleet is not None:
            self.writer_fleet.kill_all()
        for fleet in self._fleets():
            fleet.kill_all()
        self.stack.down(keep_files=self.settings.keep_data)
        self.log.event("servers stopped")
