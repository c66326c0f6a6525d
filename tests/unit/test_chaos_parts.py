"""The chaos run's pure parts: the seeded schedule, the per-key order check and the verdict."""

from __future__ import annotations

import itertools
import uuid

import pytest

from outbox.chaos.audit import RowFacts, TopicRecord, order_violations
from outbox.chaos.schedule import FAULT_KINDS, HOLDS, PROFILES, Fault, plan
from outbox.chaos.verdict import Findings
from outbox.spark_jobs import discrepancies as d

SHORT = PROFILES["short"]


def test_the_same_seed_gives_the_same_schedule_and_another_seed_another() -> None:
    assert plan(42, SHORT) == plan(42, SHORT)
    assert plan(42, SHORT) != plan(43, SHORT)


@pytest.mark.parametrize("seed", range(30))
def test_every_schedule_starts_with_one_fault_of_each_kind_in_sequence(seed: int) -> None:
    faults = plan(seed, SHORT)
    assert sorted(f.kind for f in faults[: len(FAULT_KINDS)]) == sorted(FAULT_KINDS)
    for before, after in itertools.pairwise(faults):
        assert after.at >= before.heals_at + SHORT.min_gap - 0.1  # one at a time, with a gap
    for fault in faults:
        low, high = HOLDS[fault.kind]
        assert low <= fault.hold <= high
        if fault.relay is not None:
            assert 0 <= fault.relay < SHORT.relays
    beyond_first_round = faults[len(FAULT_KINDS) :]
    assert all(f.heals_at <= SHORT.duration for f in beyond_first_round)


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


CLEAN = dict.fromkeys(d.CLASSES, 0)


def test_a_clean_run_passes_and_at_least_once_duplicates_and_late_messages_are_allowed() -> None:
    assert Findings("exactly-once", CLEAN).verdict == "PASS"
    counted = Findings("at-least-once", {**CLEAN, d.DUPLICATE: 12, d.LATE: 3})
    assert counted.verdict == "PASS" and counted.duplicates == 12


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


def _invoke_with_outcome(monkeypatch: pytest.MonkeyPatch, tmp_path, outcome):  # type: ignore[no-untyped-def]
    """Run the CLI with the run's orchestration replaced by ``outcome`` (a result or error)."""
    from click.testing import CliRunner

    from outbox.chaos import run as chaos_run
    from outbox.chaos.cli import chaos

    def execute(self: chaos_run.ChaosRun) -> chaos_run.ChaosResult:
        if isinstance(outcome, Exception):
            raise outcome
        return chaos_run.ChaosResult(
            self.settings, 12.0, [{"kind": "net_drop"}], 100, 10, 0, outcome, _EXTRA
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
