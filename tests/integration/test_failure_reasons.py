"""`outbox dead list --by-reason` / `dead retry --reason` and `outbox inbox parked list
--by-reason` / `parked retry --reason`: failed rows grouped by cause, one cause retried at a
time, on the real PostgreSQL and Kafka."""

from __future__ import annotations

import uuid

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from outbox import Outbox
from outbox.cli import main
from outbox.inbox import install
from tests.relay_helpers import relay_config, running_relay, wait_for

pytestmark = pytest.mark.integration


def fingerprint_of(output: str, kind: str) -> str:
    """The FINGERPRINT column of the --by-reason line of class ``kind``."""
    lines = [line for line in output.splitlines() if f"  {kind}: " in line]
    assert len(lines) == 1, output
    return lines[0].split()[0]


def dead_statuses(engine: sa.Engine) -> dict[str, tuple[str, str | None]]:
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT topic, status, error_kind FROM outbox")).all()
    return {r.topic: (r.status, r.error_kind) for r in rows}


def test_dead_messages_grouped_by_cause_and_one_cause_retried(  # type: ignore[no-untyped-def]
    outbox_url, engine, bootstrap_servers, make_topic
) -> None:
    live = make_topic("reasons")
    missing = [f"gone-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    ob = Outbox(engine)
    with ob.transaction() as tx:
        for topic in missing:
            tx.publish(topic, {"n": 1}, key="k")
        slow = [tx.publish(live, {"n": n}, key=f"k{n}").message_id for n in range(3)]
    # Three messages of the live topic died of one cause, each with its own numbers in it.
    with engine.begin() as conn:
        for n, message_id in enumerate(slow):
            conn.execute(
                sa.text(
                    "UPDATE outbox SET status = 'dead', error_kind = 'attempts_exhausted', "
                    "last_error = :error WHERE id = :id"
                ),
                {"id": message_id, "error": f"Local: Message timed out after {3000 + n} ms"},
            )
    cli = CliRunner()
    base = ["--database-url", outbox_url]
    with running_relay(relay_config(outbox_url, bootstrap_servers)):

        def both_missing_dead() -> bool:
            with engine.connect() as conn:
                dead = conn.execute(
                    sa.text("SELECT count(*) FROM outbox WHERE error_kind = 'unknown_topic'")
                ).scalar_one()
            return bool(dead == 2)

        wait_for(both_missing_dead, 30, "the relay to mark the missing topics' messages dead")
        listed = cli.invoke(main, ["dead", "list", "--by-reason", *base])
        assert listed.exit_code == 0, listed.output
        assert "5 dead message(s), 2 cause(s)" in listed.output
        timed_out = fingerprint_of(listed.output, "attempts_exhausted")
        unknown = fingerprint_of(listed.output, "unknown_topic")
        assert timed_out != unknown
        assert "Local: Message timed out after <n> ms" in listed.output
        lines = listed.output.splitlines()
        row = next(line for line in lines if line.startswith(timed_out))
        assert row.split()[1] == "3"  # COUNT

        # One cause at a time: the timed-out ones go again, the unknown topic's stay dead.
        assert cli.invoke(main, ["dead", "retry", *base, "--reason", "xyz"]).exit_code == 2
        assert (
            cli.invoke(main, ["dead", "retry", *base, "--reason", unknown, "--all"]).exit_code == 2
        )
        retried = cli.invoke(main, ["dead", "retry", *base, "--reason", timed_out[:8]])
        assert retried.exit_code == 0 and "requeued 3 dead message(s)" in retried.output

        def live_sent() -> bool:
            with engine.connect() as conn:
                sent = conn.execute(
                    sa.text("SELECT count(*) FROM outbox WHERE topic = :t AND status = 'sent'"),
                    {"t": live},
                ).scalar_one()
            return bool(sent == 3)

        wait_for(live_sent, 30, "the retried messages to be sent")
    after = cli.invoke(main, ["dead", "list", "--by-reason", *base])
    assert "2 dead message(s), 1 cause(s)" in after.output
    assert fingerprint_of(after.output, "unknown_topic") == unknown
    again = cli.invoke(main, ["dead", "retry", *base, "--reason", timed_out])
    assert again.exit_code == 0 and "requeued 0 dead message(s)" in again.output
    purged = cli.invoke(main, ["dead", "purge", *base, "--reason", unknown])
    assert "deleted 2 dead message(s)" in purged.output


def test_parked_messages_grouped_by_cause_and_one_cause_retried(database_url) -> None:  # type: ignore[no-untyped-def]
    install(database_url)
    errors = [
        ("g1", "handler", "ValueError: amount -5 for order 'o-1' is negative"),
        ("g1", "handler", "ValueError: amount -17 for order 'o-22' is negative"),
        ("g2", "handler", "ValueError: amount -3 for order 'x' is negative"),
        ("g1", "handler", "KeyError: 'customer'"),
        ("g1", "undecodable", "value is not JSON: unexpected character at 12"),
    ]
    engine = sa.create_engine(database_url)
    try:
        with engine.begin() as conn:
            for offset, (group, reason, error) in enumerate(errors):
                conn.execute(
                    sa.text(
                        "INSERT INTO inbox_parked (consumer_group, topic, kafka_partition, "
                        "kafka_offset, reason, error) VALUES (:g, 'orders', 0, :o, :r, :e)"
                    ),
                    {"g": group, "o": offset, "r": reason, "e": error},
                )
        cli = CliRunner()
        base = ["--database-url", database_url]
        listed = cli.invoke(main, ["inbox", "parked", "list", "--by-reason", *base])
        assert listed.exit_code == 0, listed.output
        assert "5 parked message(s) waiting, 3 cause(s)" in listed.output
        negative = fingerprint_of(listed.output, "handler/ValueError")
        assert "amount -<n> for order '<str>' is negative" in listed.output
        assert fingerprint_of(listed.output, "handler/KeyError") != negative
        only_g1 = cli.invoke(
            main, ["inbox", "parked", "list", "--by-reason", "--group", "g1", *base]
        )
        assert "4 parked message(s) waiting, 3 cause(s)" in only_g1.output

        retried = cli.invoke(
            main, ["inbox", "parked", "retry", "--reason", negative, "--group", "g1", *base]
        )
        assert retried.exit_code == 0 and "requeued 2 parked message(s)" in retried.output
        with engine.connect() as conn:
            statuses = conn.execute(
                sa.text("SELECT consumer_group, error, status FROM inbox_parked ORDER BY id")
            ).all()
        assert [s.status for s in statuses] == ["retry", "retry", "parked", "parked", "parked"]
        # Handed back to the consumer, they are no longer waiting for an operator.
        after = cli.invoke(main, ["inbox", "parked", "list", "--by-reason", *base])
        assert "3 parked message(s) waiting, 3 cause(s)" in after.output
    finally:
        engine.dispose()
