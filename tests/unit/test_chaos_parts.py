"""The chaos run's pure parts: the seeded schedule, the per-key order checks, the consuming
side's audit and the verdict."""

from __future__ import annotations

import itertools
import json
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from outbox.chaos.applied import Application, audit_applied
from outbox.chaos.audit import RowFacts, TopicRecord, order_violations, partition_ends
from outbox.chaos.consumers import counters
from outbox.chaos.forgotten import Forgotten, Holdings, compare
from outbox.chaos.handover import Gap, ShardWatch, attribute, by_fault, gap_lines, healed_at
from outbox.chaos.schedule import (
    BROKER_RESTART,
    BROKER_ROLES,
    BROKERS_DOWN,
    CLUSTER_FAULTS,
    CONSUMING_FAULTS,
    DB_FAILOVER,
    FAULT_KINDS,
    HOLDS,
    OVERLAP,
    PROCESS_FAULTS,
    PROFILES,
    PUBLISHING_FAULTS,
    REPLICATION_FAULTS,
    WRITER_KILL,
    Fault,
    plan,
)
from outbox.chaos.verdict import ConsumingFindings, FailoverFindings, Findings
from outbox.chaos.visibility import MadeBy, Snapshot
from outbox.chaos.writers import read_journal
from outbox.relay.config import EXACTLY_ONCE
from outbox.schema import SHARD_COUNT
from outbox.spark_jobs import discrepancies as d

SHORT = PROFILES["short"]


def test_the_same_seed_gives_the_same_schedule_and_another_seed_another() -> None:
    assert plan(42, SHORT) == plan(42, SHORT)
    assert plan(42, SHORT) != plan(43, SHORT)


@pytest.mark.parametrize("seed", range(30))
def test_every_schedule_starts_with_one_fault_of_each_kind_in_sequence(seed: int) -> None:
    faults = plan(seed, SHORT)
    kinds = SHORT.fault_kinds
    assert sorted(f.kind for f in faults[: len(kinds)]) == sorted(kinds)
    # One broker and no standby: all but those.
    assert set(FAULT_KINDS) - set(kinds) == {*CLUSTER_FAULTS, *REPLICATION_FAULTS}
    for before, after in itertools.pairwise(faults):
        assert after.at >= before.heals_at + SHORT.min_gap - 0.1  # one at a time, with a gap
    for fault in faults:
        if fault.kind == OVERLAP:
            continue  # its parts: the test below
        low, high = HOLDS[fault.kind]
        assert low <= fault.hold <= high
        if fault.relay is not None:
            assert 0 <= fault.relay < SHORT.relays
        if fault.consumer is not None:
            assert fault.kind in CONSUMING_FAULTS and 0 <= fault.consumer < SHORT.consumers
        if fault.writer is not None:
            assert fault.kind == WRITER_KILL and 0 <= fault.writer < SHORT.writer_processes
    beyond_first_round = faults[len(kinds) :]
    assert all(f.heals_at <= SHORT.duration for f in beyond_first_round)


def test_without_consumers_no_consumer_fault_is_planned_and_the_seed_plays_as_before() -> None:
    bare = replace(
        SHORT,
        consumers=0,
        writer_processes=0,
        database_path_faults=False,
        overlapping_faults=False,
    )
    faults = plan(7, bare)
    assert {f.kind for f in faults} <= set(PUBLISHING_FAULTS)
    assert sorted(f.kind for f in faults[: len(PUBLISHING_FAULTS)]) == sorted(PUBLISHING_FAULTS)
    # The schedule seed 7 played before the consuming stage existed.
    assert [f.kind for f in faults] == [
        *("net_drop", "net_stall", "net_latency", "relay_kill", "postgres_restart"),
        *("relay_term", "broker_restart", "net_latency", "net_drop", "net_drop", "net_drop"),
        "relay_term",
    ]
    assert {f.kind for f in plan(7, SHORT)} >= set(CONSUMING_FAULTS)


def test_the_long_profile_keeps_faulting_for_its_whole_duration() -> None:
    long = PROFILES["long"]
    faults = plan(1, long)
    assert len(faults) > 40
    assert faults[-1].heals_at > long.duration - 2 * (
        long.max_gap + max(h for _, h in HOLDS.values())
    )


def test_a_fault_describes_itself_for_the_log() -> None:
    fault = Fault(12.5, "net_latency", 4.0, latency_ms=300)
    assert fault.describe() == "net_latency +300ms for 4.0s"
    assert Fault(1.0, "relay_kill", 0.5, relay=2).to_json() == {
        "at": 1.0,
        "kind": "relay_kill",
        "hold": 0.5,
        "relay": 2,
    }
    assert Fault(2.0, "consumer_term", 1.5, consumer=1).describe() == (
        "consumer_term consumer-1 for 1.5s"
    )


def _ids(n: int) -> list[uuid.UUID]:
    return [uuid.UUID(int=i + 1) for i in range(n)]


def test_first_copies_in_seq_order_pass_even_with_redelivered_copies() -> None:
    a, b, c = _ids(3)
    rows = {a: RowFacts(1, "t", b"k"), b: RowFacts(2, "t", b"k"), c: RowFacts(3, "t", b"k")}
    records = [
        TopicRecord(a, "t", 0, 10, b"k"),
        TopicRecord(b, "t", 0, 11, b"k"),
        TopicRecord(a, "t", 0, 12, b"k"),  # at-least-once: a batch sent again
        TopicRecord(b, "t", 0, 13, b"k"),
        TopicRecord(c, "t", 0, 14, b"k"),
    ]
    assert order_violations(records, rows) == []


def test_a_message_overtaking_an_earlier_one_of_its_key_is_a_violation() -> None:
    a, b, c = _ids(3)
    rows = {a: RowFacts(1, "t", b"k"), b: RowFacts(2, "t", b"k"), c: RowFacts(3, "t", b"x")}
    records = [
        TopicRecord(b, "t", 0, 10, b"k"),
        TopicRecord(c, "t", 0, 11, b"x"),  # another key: not compared with k
        TopicRecord(a, "t", 0, 12, b"k"),
    ]
    found = order_violations(records, rows)
    assert len(found) == 1
    assert str(a) in found[0] and "seq 1" in found[0]


def test_a_key_split_across_partitions_is_a_violation_and_phantoms_are_not_ordered() -> None:
    a, b, phantom = _ids(3)
    rows = {a: RowFacts(1, "t", b"k"), b: RowFacts(2, "t", b"k")}
    records = [
        TopicRecord(phantom, "t", 0, 1, b"k"),
        TopicRecord(a, "t", 0, 2, b"k"),
        TopicRecord(b, "t", 1, 0, b"k"),
    ]
    found = order_violations(records, rows)
    assert len(found) == 1 and "partition" in found[0]


def test_a_snapshot_tells_which_transactions_had_ended() -> None:
    seen = Snapshot.parse("100:105:100,103")
    assert [x for x in range(98, 107) if seen.ended(x)] == [98, 99, 101, 102, 104]
    assert Snapshot.parse("7:7:") == Snapshot(7, 7, frozenset())


# A writer's transaction 10 writes w (seq 1) and is still open when the relay's promotion,
# transaction 11, gives a due scheduled message p seq 2 (10 is in its snapshot's running
# list); and a writer's transaction 21 writes w2 (seq 4) while promotion 20 of p2 (seq 3) is
# still open. Neither pair took turns.
OPEN_WRITER = MadeBy(10, Snapshot(10, 11, frozenset({10})))
PROMOTION_PAST_IT = MadeBy(11, Snapshot(10, 12, frozenset({10})))
OPEN_PROMOTION = MadeBy(20, Snapshot(20, 21, frozenset({20})))
WRITER_PAST_IT = MadeBy(21, Snapshot(20, 22, frozenset({20})))
# Promotion 11 again, had writer 10 committed before it wrote.
PROMOTION_AFTER = MadeBy(11, Snapshot(11, 12, frozenset()))


def _overlapping() -> tuple[list[uuid.UUID], dict[uuid.UUID, RowFacts]]:
    w, p, p2, w2 = _ids(4)
    return [w, p, p2, w2], {
        w: RowFacts(1, "t", b"k", OPEN_WRITER),
        p: RowFacts(2, "t", b"k", PROMOTION_PAST_IT),
        p2: RowFacts(3, "t", b"k", OPEN_PROMOTION),
        w2: RowFacts(4, "t", b"k", WRITER_PAST_IT),
    }


def test_messages_of_overlapping_transactions_may_come_either_way() -> None:
    (w, p, p2, w2), rows = _overlapping()
    # p went before w: w's transaction had not committed when the relay sent p; w2 before p2:
    # p2's promotion had not committed when w2 was sent.
    records = [TopicRecord(m, "t", 0, n, b"k") for n, m in enumerate([p, w, w2, p2])]
    unordered: list[str] = []
    assert order_violations(records, rows, unordered) == []
    assert len(unordered) == 2 and "overlapped" in unordered[0]
    # Taken by seq alone (no transactions known), as the audit did before: two violations.
    bare = {m: RowFacts(f.seq, f.topic, f.key) for m, f in rows.items()}
    assert len(order_violations(records, bare)) == 2
    applied = audit_applied(
        [Application(m, "t", "k", n) for n, m in enumerate([p, w, w2, p2], start=1)], rows
    )
    assert applied.order == []


def test_a_message_overtaken_after_it_had_committed_is_a_violation() -> None:
    (w, p, p2, _), rows = _overlapping()
    rows[p] = RowFacts(2, "t", b"k", PROMOTION_AFTER)  # w had committed: p must follow it
    records = [TopicRecord(m, "t", 0, n, b"k") for n, m in enumerate([p, w, p2])]
    found = order_violations(records, rows)
    assert len(found) == 1 and str(w) in found[0] and f"after {p} (seq 2)" in found[0]
    applied = audit_applied(
        [Application(m, "t", "k", n) for n, m in enumerate([p, w, p2], start=1)], rows
    )
    assert len(applied.order) == 1


def test_messages_of_one_transaction_come_in_seq_order() -> None:
    a, b = _ids(2)
    rows = {a: RowFacts(1, "t", b"k", OPEN_WRITER), b: RowFacts(2, "t", b"k", OPEN_WRITER)}
    records = [TopicRecord(b, "t", 0, 0, b"k"), TopicRecord(a, "t", 0, 1, b"k")]
    assert len(order_violations(records, rows)) == 1


def test_partition_ends_are_one_past_the_last_record_read() -> None:
    a, b = _ids(2)
    records = [
        TopicRecord(a, "t", 0, 4, b"k"),
        TopicRecord(b, "t", 0, 9, b"k"),  # offsets 5-8: transaction markers, aborted records
        TopicRecord(a, "t", 1, 0, b"x"),
    ]
    assert partition_ends(records) == {("t", 0): 10, ("t", 1): 1}


# -- the consuming side --------------------------------------------------------------------


def _committed(*seqs: int, topic: str = "t", key: bytes = b"k") -> dict[uuid.UUID, RowFacts]:
    return {uuid.UUID(int=seq): RowFacts(seq, topic, key) for seq in seqs}


def _applied(*seqs: int, topic: str = "t", key: str = "k") -> list[Application]:
    """Applications of the messages of ``seqs``, committed in the order given."""
    return [
        Application(uuid.UUID(int=seq), topic, key, number)
        for number, seq in enumerate(seqs, start=1)
    ]


def test_every_committed_message_applied_once_in_order_passes() -> None:
    rows = {**_committed(1, 4, 9), **_committed(2, 3, key=b"x")}
    made = _applied(1, 4, 9) + _applied(2, 3, key="x")
    found = audit_applied(made, rows)
    assert found.applied == 5
    assert found.missing == found.applied_twice == found.not_committed == found.order == []


def test_a_message_applied_twice_is_found_even_in_order() -> None:
    found = audit_applied(_applied(1, 2, 2, 3), _committed(1, 2, 3))
    assert found.applied_twice == [uuid.UUID(int=2)]
    assert found.order == [] and found.missing == []  # the second application is not reordered


def test_a_message_applied_twice_out_of_order_counts_as_twice_only() -> None:
    found = audit_applied(_applied(1, 2, 3, 1), _committed(1, 2, 3))
    assert found.applied_twice == [uuid.UUID(int=1)] and found.order == []


def test_a_committed_message_never_applied_and_an_uncommitted_one_applied_are_found() -> None:
    found = audit_applied(_applied(1, 3, 7), _committed(1, 2, 3))
    assert found.missing == [uuid.UUID(int=2)]
    assert found.not_committed == [uuid.UUID(int=7)]
    assert found.order == []


def test_a_key_applied_out_of_the_writers_order_is_a_violation() -> None:
    rows = {**_committed(1, 2, 3), **_committed(4, 5, topic="u")}
    made = _applied(2, 1, 3) + _applied(5, 4, topic="u")
    found = audit_applied(made, rows)
    assert len(found.order) == 2
    assert "seq 1" in found.order[0] and "after" in found.order[0]
    assert found.missing == found.applied_twice == []


def test_the_applied_order_is_the_commit_order_not_the_row_order() -> None:
    a, b = uuid.UUID(int=1), uuid.UUID(int=2)
    # Rows listed b first, but numbered as committed: a (1), then b (2).
    made = [Application(b, "t", "k", 2), Application(a, "t", "k", 1)]
    assert audit_applied(made, _committed(1, 2)).order == []
    swapped = [Application(b, "t", "k", 1), Application(a, "t", "k", 2)]
    assert len(audit_applied(swapped, _committed(1, 2)).order) == 1


def test_the_inbox_counters_are_read_from_a_consumers_metrics() -> None:
    exposition = (
        "# HELP outbox_inbox_duplicates_total Messages skipped\n"
        "# TYPE outbox_inbox_duplicates_total counter\n"
        'outbox_inbox_duplicates_total{topic="a"} 3.0\n'
        'outbox_inbox_duplicates_total{topic="b"} 4.0\n'
        'outbox_inbox_duplicates_created{topic="a"} 1.7e9\n'
        "# HELP outbox_inbox_processed_total Messages applied\n"
        "# TYPE outbox_inbox_processed_total counter\n"
        'outbox_inbox_processed_total{topic="a"} 10.0\n'
    )
    assert counters(exposition) == {"duplicates_skipped": 7, "processed": 10}


CLEAN = dict.fromkeys(d.CLASSES, 0)


def test_a_clean_run_passes_and_at_least_once_duplicates_and_late_messages_are_allowed() -> None:
    assert Findings("exactly-once", CLEAN).verdict == "PASS"
    counted = Findings("at-least-once", {**CLEAN, d.DUPLICATE: 12, d.LATE: 3})
    assert counted.verdict == "PASS" and counted.duplicates == 12


def _consuming(**broken: Any) -> Findings:
    return Findings("exactly-once", CLEAN, consuming=ConsumingFindings(3, 100, **broken))


def test_a_clean_consuming_side_passes() -> None:
    assert _consuming().verdict == "PASS"


@pytest.mark.parametrize(
    ("findings", "expected"),
    [
        (Findings("at-least-once", {**CLEAN, d.MISSING: 1}), "1 committed messages missing"),
        (Findings("at-least-once", {**CLEAN, d.STUCK: 2}), "2 committed messages missing"),
        (Findings("at-least-once", {**CLEAN, d.PHANTOM: 1}), "1 phantom"),
        (Findings("at-least-once", {**CLEAN, d.OFFSET_MISMATCH: 1}), "1 offset mismatch"),
        (Findings("exactly-once", {**CLEAN, d.DUPLICATE: 1}), "1 duplicates in exactly-once"),
        (Findings("at-least-once", CLEAN, order_violations=3), "3 per-key order violations"),
        (Findings("at-least-once", CLEAN, rolled_back_on_topic=1), "rolled-back messages on"),
        (Findings("at-least-once", CLEAN, rolled_back_in_table=1), "rolled-back messages in"),
        (Findings("at-least-once", CLEAN, lost_commits=1), "confirmed commits without"),
        (Findings("at-least-once", CLEAN, atomicity_breaks=1), "business rows that disagree"),
        (Findings("at-least-once", CLEAN, relay_crashes=1), "relay exits nobody asked for"),
        (Findings("at-least-once", CLEAN, unclean_stops=1), "did not exit 0 after SIGTERM"),
        (Findings("at-least-once", CLEAN, writer_failures=["boom"]), "writer failed: boom"),
        (_consuming(missing=2), "2 committed messages never applied"),
        (_consuming(applied_twice=1), "1 messages applied more than once"),
        (_consuming(not_committed=1), "applied messages that were never committed"),
        (_consuming(order_violations=4), "4 per-key order violations on the applied side"),
        (_consuming(parked=1), "messages parked by the consumers"),
        (_consuming(caught_up=False), "did not reach the end of the topics"),
        (_consuming(consumer_crashes=1), "consumer exits nobody asked for"),
        (_consuming(unclean_stops=1), "consumers that did not exit 0 after SIGTERM"),
    ],
)
def test_each_broken_guarantee_fails_the_run(findings: Findings, expected: str) -> None:
    assert findings.verdict == "FAIL"
    assert any(expected in line for line in findings.violations()), findings.violations()


def test_plan_only_prints_the_seeds_schedule_without_starting_anything() -> None:
    import json

    from click.testing import CliRunner

    from outbox.chaos.cli import chaos

    result = CliRunner().invoke(chaos, ["--seed", "5", "--plan-only"])
    assert result.exit_code == 0
    printed = [json.loads(line) for line in result.output.splitlines()]
    assert printed == [fault.to_json() for fault in plan(5, SHORT)]
    bare = CliRunner().invoke(chaos, ["--seed", "5", "--consumers", "0", "--plan-only"])
    printed = [json.loads(line) for line in bare.output.splitlines()]
    assert printed == [fault.to_json() for fault in plan(5, replace(SHORT, consumers=0))]
    assert not any("consumer" in fault for fault in printed)


def _invoke_with_outcome(monkeypatch: pytest.MonkeyPatch, tmp_path, outcome, extra=None):  # type: ignore[no-untyped-def]
    """Run the CLI with the run's orchestration replaced by ``outcome`` (a result or error)."""
    from click.testing import CliRunner

    from outbox.chaos import run as chaos_run
    from outbox.chaos.cli import chaos

    def execute(self: chaos_run.ChaosRun) -> chaos_run.ChaosResult:
        if isinstance(outcome, Exception):
            raise outcome
        return chaos_run.ChaosResult(
            self.settings, 12.0, [{"kind": "net_drop"}], 100, 10, 0, outcome, extra or _EXTRA
        )

    monkeypatch.setattr(chaos_run.ChaosRun, "execute", execute)
    args = ["--seed", "3", "--output", str(tmp_path), "--mode", "exactly-once"]
    return CliRunner().invoke(chaos, args)


_EXTRA = {
    "outbox_rows": 100,
    "topic_records": 101,
    "reconciliation": {},
    "uncertain_commits": 0,
    "uncertain_committed": 0,
}


def test_a_violation_is_reported_and_exits_1_with_the_json_last(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    import json

    findings = Findings("exactly-once", {**CLEAN, d.DUPLICATE: 1})
    result = _invoke_with_outcome(monkeypatch, tmp_path, findings)
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    body = json.loads(lines[-1])
    assert body["verdict"] == "FAIL" and body["duplicates"] == 1 and body["seed"] == 3
    assert "VIOLATION: 1 duplicates in exactly-once mode" in result.output


def test_a_run_that_cannot_be_carried_out_exits_2_in_one_line_without_the_password(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    import json

    from outbox.devstack.procs import StackError

    error = StackError("PostgreSQL did not start: postgresql://app:hunter2@127.0.0.1:5/x\nmore")
    result = _invoke_with_outcome(monkeypatch, tmp_path, error)
    assert result.exit_code == 2
    assert "hunter2" not in result.output
    body = json.loads(result.output.strip().splitlines()[-1])
    assert body["verdict"] == "ERROR" and "PostgreSQL did not start" in body["error"]


def test_the_consuming_side_is_reported_and_a_double_application_fails_the_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    import json

    findings = Findings("exactly-once", CLEAN, consuming=ConsumingFindings(3, 101, applied_twice=1))
    figures = {"inbox_rows": 100, "duplicates_skipped": 4, "processed": 101, "catch_up_s": 0.5}
    extra = {**_EXTRA, "consuming": {**figures, "term_exit_codes": [0, 0, 0]}}
    result = _invoke_with_outcome(monkeypatch, tmp_path, findings, extra)
    assert result.exit_code == 1
    body = json.loads(result.output.strip().splitlines()[-1])
    assert body["consuming"]["applied_twice"] == 1 and body["consuming"]["inbox_rows"] == 100
    assert body["consuming"]["duplicates_skipped"] == 4 and body["consuming"]["consumers"] == 3
    assert "applied            101 (inbox rows 100); duplicates skipped by the inbox 4" in (
        result.output
    )
    assert "VIOLATION: 1 messages applied more than once" in result.output


def test_seed_random_is_drawn_printed_and_replayable() -> None:
    import json
    import re

    from click.testing import CliRunner

    from outbox.chaos.cli import chaos

    drawn = CliRunner().invoke(chaos, ["--plan-only", "--seed", "random"])
    assert drawn.exit_code == 0, drawn.output
    seed = int(re.findall(r"replay this run with --seed (\d+)", drawn.output)[0])
    replayed = CliRunner().invoke(chaos, ["--plan-only", "--seed", str(seed)])
    schedule = [line for line in drawn.output.splitlines() if line.startswith("{")]
    assert [json.loads(line) for line in schedule] == [
        json.loads(line) for line in replayed.output.splitlines()
    ]
    refused = CliRunner().invoke(chaos, ["--plan-only", "--seed", "-3"])
    assert refused.exit_code == 2 and "neither a non-negative number" in refused.output


@pytest.mark.parametrize("seed", range(20))
def test_a_cluster_schedule_stops_each_role_and_two_nodes_at_once_early_on(seed: int) -> None:
    cluster = replace(SHORT, brokers=3)
    faults = plan(seed, cluster)
    first_round = faults[: len(cluster.fault_kinds) + len(BROKER_ROLES) - 1]
    restarts = [f for f in first_round if f.kind == BROKER_RESTART]
    assert sorted(f.broker or "" for f in restarts) == sorted(BROKER_ROLES)
    assert all(f.how in ("term", "kill") for f in restarts)
    (both,) = [f for f in first_round if f.kind == BROKERS_DOWN]
    assert len(set(both.nodes)) == 2 and set(both.nodes) <= {1, 2, 3}
    assert both.to_json()["nodes"] == list(both.nodes)  # JSON as the fault log keeps it
    assert json.loads(json.dumps(both.to_json())) == both.to_json()
    for fault in faults:  # every broker restart on a cluster names its role, the parts too
        for part in fault.parts or (fault,):
            assert (part.broker is not None) == (part.kind == BROKER_RESTART)
    assert all(f.broker is None and not f.nodes for f in plan(seed, SHORT))


@pytest.mark.parametrize(
    ("seed", "profile", "digest"),
    [
        (7, "short", "213f1e261b3d394625ec1064dc76410757ef9f987b29da05d7c232dadac3dac8"),
        (2026, "long", "32e22e4fd0d19aaa7010ab4d756aa09297f07c75f56a017378b8cfb0a05d81f4"),
    ],
)
def test_the_seeds_of_the_recorded_runs_still_play_their_schedules(
    seed: int, profile: str, digest: str
) -> None:
    """Seed 7 (CI) and seed 2026 (the long runs in docs/chaos.md) on one broker: their
    schedules, as JSON lines, are what they were when those runs were recorded."""
    import hashlib

    # The long profile has a standby since: `--replication none` plays what it played.
    chosen = replace(PROFILES[profile], replication=None)
    text = "\n".join(json.dumps(f.to_json()) for f in plan(seed, chosen))
    assert hashlib.sha256(text.encode()).hexdigest() == digest


def test_a_broker_fault_describes_its_target() -> None:
    restart = Fault(3.0, BROKER_RESTART, 2.0, how="kill", broker="coordinator")
    assert restart.describe() == "broker_restart the coordinator kill for 2.0s"
    down = Fault(3.0, BROKERS_DOWN, 2.0, how="term", nodes=(1, 3))
    assert down.describe() == "brokers_down nodes 1 and 3 term for 2.0s"


def test_writer_kills_are_planned_only_for_profiles_with_writer_processes() -> None:
    assert WRITER_KILL in {f.kind for f in plan(3, SHORT)}
    assert WRITER_KILL not in {f.kind for f in plan(3, replace(SHORT, writer_processes=0))}
    assert Fault(2.0, WRITER_KILL, 1.5, writer=1).describe() == "writer_kill writer-1 for 1.5s"


def _journal_line(what: str, *ids: uuid.UUID) -> str:
    return json.dumps({what: [str(i) for i in ids]})


def test_a_writer_journal_tells_committed_rolled_back_and_uncertain_transactions() -> None:
    a, b, c, d, e, f = (uuid.uuid4() for _ in range(6))
    lines = [
        _journal_line("commit", a, b),
        _journal_line("committed", a, b),
        _journal_line("rollback", c),
        _journal_line("commit", d),  # killed before its outcome: the next life starts
        _journal_line("commit", e),
        _journal_line("uncertain", e),  # the COMMIT was interrupted
        '{"commit": ["' + str(f),  # torn by a kill while written: dropped
    ]
    tally = read_journal(lines)
    assert tally.committed == [a, b] and tally.transactions == 1
    assert tally.rolled_back == [c]
    assert sorted(tally.uncertain) == sorted([d, e])


def test_a_writer_killed_after_writing_its_last_transaction_down_leaves_it_uncertain() -> None:
    a = uuid.uuid4()
    assert read_journal([_journal_line("commit", a)]).uncertain == [a]
    assert read_journal([_journal_line("rollback", a)]).uncertain == []


def test_ownership_gaps_are_timed_and_put_down_to_the_last_fault_before_them() -> None:
    clock = iter([1.0, 1.1, 2.5, 2.6, 10.0, 10.4, 11.0, 20.0, 30.0])
    watch = ShardWatch("", lambda: next(clock))
    every = frozenset(range(SHARD_COUNT))
    for owned in (every, every - set(range(11)), every, every):  # 1.0 .. 2.6
        watch._saw(owned)
    for owned in (frozenset(), frozenset(range(5)), every, every - {3}):  # a restart, 10 .. 20
        watch._saw(owned)
    gaps = watch.stop()
    assert [(g.opened, g.closed) for g in gaps] == [(1.1, 2.5), (10.0, 11.0), (20.0, None)]
    faults = [
        {"t": 0.9, "kind": "relay_kill", "hold": 0.1},
        {"t": 9.5, "kind": "postgres_restart", "hold": 1.0},
    ]
    assert by_fault(gaps, faults) == {
        "relay_kill": {"gaps": 1, "p50_s": 1.4, "max_s": 1.4, "never_closed": 0},
        "postgres_restart": {"gaps": 1, "p50_s": 1.0, "max_s": 1.0, "never_closed": 0},
        "postgres_restart, after the heal": {
            "gaps": 1,
            "p50_s": None,
            "max_s": None,
            "never_closed": 1,
        },
    }
    assert by_fault([Gap(0.5, 0.7)], faults)["start"]["gaps"] == 1


def test_a_gap_goes_by_the_logged_heal_and_a_fault_close_behind_another_says_so() -> None:
    """A broker restart heals when the broker serves again, long past its hold; a relay kill
    landing just after that heal shares its gaps with the broker's aftermath."""
    faults = [
        {"t": 10.0, "kind": "broker_restart", "hold": 2.0, "healed": 40.0},
        {"t": 42.0, "kind": "relay_kill", "hold": 1.0, "healed": 43.0},
        {"t": 60.0, "kind": "relay_kill", "hold": 1.0},  # no heal logged: t + hold
    ]
    assert attribute(Gap(30.0, 31.0), faults) == "broker_restart"  # down yet, past its hold
    assert attribute(Gap(40.5, 41.0), faults) == "broker_restart, after the heal"
    assert attribute(Gap(42.1, 50.0), faults) == "relay_kill, under 5 s after broker_restart"
    assert attribute(Gap(43.5, 44.0), faults) == (
        "relay_kill, under 5 s after broker_restart, after the heal"
    )
    assert attribute(Gap(60.1, 60.5), faults) == "relay_kill"  # 17 s after the one before
    assert attribute(Gap(61.5, 62.0), faults) == "relay_kill, after the heal"
    assert healed_at(faults[2]) == 61.0
    # Only Kafka coming back has such an aftermath; an overlap counts when a part restarted it.
    after_a_drop = [{"t": 1.0, "kind": "db_drop", "hold": 1.0}, {"t": 3.0, "kind": "relay_kill"}]
    assert attribute(Gap(3.1, 4.0), after_a_drop) == "relay_kill"
    overlap = {"t": 1.0, "kind": "overlap", "hold": 5.0, "healed": 30.0}
    overlap["parts"] = [{"kind": "net_stall"}, {"kind": "broker_restart"}]
    after_an_overlap = [overlap, {"t": 31.0, "kind": "relay_term", "hold": 1.0}]
    assert attribute(Gap(31.5, 32.0), after_an_overlap) == "relay_term, under 5 s after overlap"
    figures = by_fault([Gap(42.1, 50.0), Gap(60.1, 60.5)], faults)
    assert figures["relay_kill"]["max_s"] == 0.4
    assert figures["relay_kill, under 5 s after broker_restart"]["max_s"] == 7.9

    watch = ShardWatch("", lambda: 0.0)
    watch.gaps = [Gap(42.1, 50.0)]
    watch.shard_gaps = [Gap(60.1, 60.5), Gap(42.2, None)]
    assert gap_lines(watch, faults) == [
        {
            "gap": "all shards",
            "opened_t": 42.1,
            "closed_t": 50.0,
            "seconds": 7.9,
            "after": "relay_kill, under 5 s after broker_restart",
        },
        {
            "gap": "a shard",
            "opened_t": 42.2,
            "closed_t": None,
            "seconds": None,
            "after": "relay_kill, under 5 s after broker_restart",
        },
        {
            "gap": "a shard",
            "opened_t": 60.1,
            "closed_t": 60.5,
            "seconds": 0.4,
            "after": "relay_kill",
        },
    ]


def test_each_shard_is_timed_without_an_owner_apart_from_the_others() -> None:
    """Shards lost one after the other make one long gap of the whole, and short ones each."""
    clock = iter([0.0, 1.0, 2.0, 3.0, 4.0, 5.0])
    watch = ShardWatch("", lambda: next(clock))
    every = frozenset(range(SHARD_COUNT))
    for owned in (every, every - {0}, every - {1}, every - {2}, every - {2}, every - {4}):
        watch._saw(owned)
    watch.stop()
    assert [(g.opened, g.closed) for g in watch.gaps] == [(1.0, None)]
    assert sorted((g.opened, g.closed) for g in watch.shard_gaps) == [
        (1.0, 2.0),
        (2.0, 3.0),
        (3.0, 5.0),
        (5.0, None),
    ]


@pytest.mark.parametrize("seed", range(40))
def test_an_overlap_lands_its_second_fault_while_the_first_holds(seed: int) -> None:
    overlaps = [f for f in plan(seed, PROFILES["long"]) if f.kind == OVERLAP]
    assert overlaps
    for overlap in overlaps:
        first, second = overlap.parts
        assert first.at == overlap.at and first.kind != second.kind
        assert first.at < second.at < first.heals_at  # inside the first
        assert overlap.heals_at == pytest.approx(max(first.heals_at, second.heals_at), abs=0.11)
        if second.kind in PROCESS_FAULTS:  # no process restarted into a fault still on
            assert second.heals_at >= first.heals_at
        for part in overlap.parts:
            assert not part.parts
            low, high = HOLDS[part.kind]
            assert low <= part.hold
            assert part.hold <= high or (part is second and second.kind in PROCESS_FAULTS)
    replayed = json.loads(json.dumps(overlaps[0].to_json()))
    assert [part["kind"] for part in replayed["parts"]] == [p.kind for p in overlaps[0].parts]
    assert "and" in overlaps[0].describe()


def test_an_overlaps_holds_count_from_when_each_part_is_in_place(tmp_path: Path) -> None:
    """A broker's controlled shutdown outlasting its hold must not cut its time down: each
    part heals its own hold after its break returned, a stopped relay only after the other."""
    from outbox.chaos.run import ChaosRun, FaultLog

    now = [100.0]
    run = ChaosRun.__new__(ChaosRun)
    run.log = FaultLog(tmp_path / "faults.jsonl", echo=lambda line: None)
    run.log.elapsed = lambda: now[0]  # type: ignore[method-assign]
    done: list[tuple[str, float]] = []

    def break_(fault: Fault) -> None:
        done.append((f"break {fault.kind}", now[0]))
        now[0] += 20.0 if fault.kind == "broker_restart" else 0.1  # a slow controlled stop

    def heal(fault: Fault) -> str:
        done.append((f"heal {fault.kind}", now[0]))
        return f"{fault.kind} healed"

    def wait_until(offset: float) -> None:
        now[0] = max(now[0], offset)

    run._break = break_  # type: ignore[method-assign]
    run._heal = heal  # type: ignore[method-assign]
    run._wait_until = wait_until  # type: ignore[method-assign]
    first = Fault(10.0, "broker_restart", 4.0, how="term", broker="leader")
    second = Fault(11.0, "relay_kill", 1.0, relay=0)
    run._inject(Fault(10.0, OVERLAP, 5.0, parts=(first, second)))
    assert done == [
        ("break broker_restart", 100.0),
        ("break relay_kill", 121.0),  # 1 s into the broker's time down
        ("heal broker_restart", 124.0),  # down 4 s, its hold
        ("heal relay_kill", 124.1),  # a stopped relay comes back after the broker
    ]
    assert run.log.faults[-1]["healed"] == 124.1


def test_a_run_in_a_folder_used_before_starts_from_nothing_of_the_earlier_run(
    tmp_path: Path,
) -> None:
    """Writers' journals are appended to (a writer process that restarts goes on with its
    own): an earlier run's, left in the folder, would be read back as this run's commits."""
    from outbox.chaos.run import clear_earlier_run

    earlier = [
        "faults.jsonl",
        "handover.jsonl",
        "writer-0.jsonl",
        "writer-1.sent",
        "relay-2.log",
        "writer-0.log",
        "consumer-1.log",
    ]
    for name in earlier:
        (tmp_path / name).write_text("from an earlier run\n")
    (tmp_path / "notes.txt").write_text("the user's own\n")
    (tmp_path / "reconcile").mkdir()

    clear_earlier_run(tmp_path)

    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "reconcile"]


# -- failovers -------------------------------------------------------------------------------


def test_failovers_are_planned_only_with_a_standby_and_the_failover_profile_plays_only_them() -> (
    None
):
    assert DB_FAILOVER not in PROFILES["short"].fault_kinds
    assert DB_FAILOVER in PROFILES["long"].fault_kinds  # a synchronous standby
    assert DB_FAILOVER in {f.kind for f in plan(2026, PROFILES["long"])[:20]}
    only = PROFILES["failover"]
    faults = plan(7, only)
    assert len(faults) >= 3 and {f.kind for f in faults} == {DB_FAILOVER}
    assert all(0.0 <= f.hold <= 3.0 for f in faults)
    assert plan(7, replace(only, replication=None)) == []  # no standby, nothing to fail over


def _held(
    rows: list[uuid.UUID], sends: dict[uuid.UUID, tuple[int, int]], applied: list[uuid.UUID]
) -> Holdings:
    return Holdings(set(rows), dict(sends), set(applied))


def test_what_a_promotion_forgot_is_what_a_killed_primary_held_and_the_last_does_not() -> None:
    kept, lost, resent, recovered, applied = (uuid.uuid4() for _ in range(5))
    old = _held(
        [kept, lost, resent, recovered],
        {kept: (0, 1), lost: (0, 2), resent: (1, 5), recovered: (2, 7)},
        [kept, applied],
    )
    last = _held(
        [kept, resent, recovered], {kept: (0, 1), resent: (1, 9), recovered: (2, 7)}, [kept]
    )
    found = compare([old], last)
    assert found.rows == {lost}  # committed there, on no later primary
    assert found.sends == {resent}  # marked at offset 5, forgotten, sent again (offset 9)
    assert found.applications == {applied}
    assert compare([old], old) == Forgotten()


def _failover(**counts: Any) -> Findings:
    return Findings(mode=EXACTLY_ONCE, reconciliation={}, failover=FailoverFindings(**counts))


def test_an_asynchronous_promotions_phantoms_pass_when_each_is_one_it_forgot() -> None:
    forgot = _failover(
        replication="async",
        failovers=2,
        forgotten_rows=5,
        forgotten_on_topic=3,
        reconciliation_phantoms=3,
        forgotten_sends=2,
        relay_resumed_s=(4.2, 6.0),
    )
    forgot = replace(forgot, reconciliation={d.PHANTOM: 3, d.DUPLICATE: 2})
    assert forgot.violations() == [] and forgot.verdict == "PASS"


@pytest.mark.parametrize(
    ("counts", "expected"),
    [
        ({"phantoms_not_forgotten": 1, "reconciliation_phantoms": 1}, "no promotion forgot"),
        (
            {"forgotten_on_topic": 2, "reconciliation_phantoms": 1},
            "found 1 phantoms, the promotions made 2",
        ),
        ({"duplicates_not_forgotten": 1}, "no forgotten mark explains"),
        (
            {"relay_resumed_s": (3.0, 15.5)},
            "failover 2: the relays sent from the new primary 15.5 s",
        ),
        ({"relay_resumed_s": (None,)}, "failover 1: no relay sent from the new primary"),
    ],
)
def test_what_no_promotion_explains_fails_an_asynchronous_run(
    counts: dict[str, Any], expected: str
) -> None:
    found = _failover(replication="async", failovers=2, **counts)
    assert any(expected in line for line in found.violations()), found.violations()


def test_a_synchronous_promotion_may_forget_nothing_anyone_saw() -> None:
    clean = _failover(replication="sync", failovers=1, forgotten_rows=2, relay_resumed_s=(5.0,))
    assert clean.violations() == []  # commits nobody saw confirmed, on no topic
    seen = _failover(
        replication="sync", failovers=1, forgotten_on_topic=1, reconciliation_phantoms=1
    )
    seen = replace(seen, reconciliation={d.PHANTOM: 1})
    assert "1 phantom" in seen.violations()
    assert any("a synchronous promotion forgot" in line for line in seen.violations())
    duplicated = replace(clean, reconciliation={d.DUPLICATE: 1})
    assert "1 duplicates in exactly-once mode" in duplicated.violations()


def test_a_send_forgotten_with_its_making_pending_is_told_apart_by_its_new_seq() -> None:
    marked_again, made_pending_again = uuid.uuid4(), uuid.uuid4()
    old = Holdings(
        {marked_again, made_pending_again},
        {marked_again: (0, 1), made_pending_again: (0, 2)},
        set(),
        {marked_again: 10, made_pending_again: 11},
    )
    last = Holdings(
        {marked_again, made_pending_again},
        {marked_again: (0, 5), made_pending_again: (0, 6)},
        set(),
        {marked_again: 10, made_pending_again: 40},  # made pending again: a new seq
    )
    found = compare([old], last)
    assert found.sends == {marked_again, made_pending_again}
    assert found.made_pending_again == {made_pending_again}


def test_a_hand_over_under_way_when_the_run_ends_is_timed_to_its_end() -> None:
    """The drain may end while the last fault's hand-over is still going on: the watch waits
    for it (a gap that closes then is timed), and says so when shards stay ownerless."""
    ticks = itertools.count()
    watch = ShardWatch("", lambda: float(next(ticks)), interval=0.01)
    watch._thread = threading.Thread(target=time.sleep, args=(5,), daemon=True)  # as if looking
    watch._thread.start()
    every = frozenset(range(SHARD_COUNT))
    assert not watch.settle(0.05)  # no look at the locks yet
    watch._saw(every - {3})
    assert not watch.settle(0.05)
    later = threading.Timer(0.1, watch._saw, args=(every,))
    later.start()
    assert watch.settle(5.0)
    later.join()
    assert [(g.opened, g.closed) for g in watch.stop()] == [(0.0, 1.0)]
