"""`outbox status` on the real stack: counts per topic and status, the oldest pending age,
the relays and their shards, prepared messages and parked inbox rows; and its plan on a
table of a million sent rows (pending and prepared rows read through their partial indexes,
no scan of the sent rows)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from outbox import Outbox
from outbox.cli import main
from outbox.inbox import install
from outbox.inbox.migrate import uninstall
from outbox.prepared import PreparedMessages
from outbox.queries import Queries
from outbox.schema import OutboxTableSpec
from tests.relay_helpers import relay_config, running_relay, wait_for

pytestmark = pytest.mark.integration


def status(url: str, *args: str) -> dict[str, Any]:
    result = CliRunner().invoke(main, ["status", "--json", "--database-url", url, *args])
    assert result.exit_code == 0, result.output
    return dict(json.loads(result.output))


def by_topic(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {t["topic"]: t for t in report["topics"]}


def test_status_counts_relays_shards_prepared_and_parked(  # type: ignore[no-untyped-def]
    outbox_url, engine, bootstrap_servers, make_topic
) -> None:
    orders, audit = make_topic("st-orders"), make_topic("st-audit")
    ob = Outbox(engine)
    with ob.transaction() as tx:
        for n in range(5):
            tx.publish(orders, {"n": n}, key=f"k{n}")
        for n in range(2):
            tx.publish(audit, {"n": n})
    prepared = PreparedMessages(ob, group="payments")
    prepared.prepare(orders, {"n": "p1"}, key="p")
    prepared.prepare(orders, {"n": "p2"}, key="p")
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE outbox SET created_at = now() - interval '90 seconds' "
                "WHERE topic = :t AND status = 'pending'"
            ),
            {"t": audit},
        )
    install(outbox_url)
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO inbox_parked (consumer_group, topic, kafka_partition, kafka_offset,"
                " reason, error) VALUES ('billing', :t, 0, 7, 'handler', 'ValueError: no')"
            ),
            {"t": orders},
        )

    before = status(outbox_url)
    topics = by_topic(before)
    assert topics[orders]["pending"] == 5 and topics[audit]["pending"] == 2
    assert topics[orders]["prepared"] == 2
    assert topics[audit]["oldest_pending_seconds"] >= 90 > topics[orders]["oldest_pending_seconds"]
    assert before["oldest_pending_seconds"] >= 90
    assert before["statuses"]["pending"] == {"count": 7, "estimate": False}
    assert before["statuses"]["dead"]["estimate"] is True
    assert before["prepared_groups"] == [
        {"check_group": "payments", "count": 2, "oldest_seconds": pytest.approx(0, abs=60)}
    ]
    assert before["relays"] == [] and before["unowned_shards"] == list(range(16))
    assert [(p["consumer_group"], p["count"]) for p in before["parked"]] == [("billing", 1)]
    assert before["inbox_table"] == "public.inbox_parked"
    assert before["lag"] is None  # Kafka is not asked unless named
    with_lag = status(outbox_url, "--bootstrap-servers", bootstrap_servers)
    assert [(g["group"], g["error"]) for g in with_lag["lag"]] == [("billing", None)]

    config = relay_config(outbox_url, bootstrap_servers)
    with running_relay(config), running_relay(config):

        def shared_out() -> bool:
            report = status(outbox_url)
            return (
                len(report["relays"]) == 2
                and not report["unowned_shards"]
                and all(r["shards"] for r in report["relays"])
                and report["statuses"]["pending"]["count"] == 0
            )

        wait_for(shared_out, 60, "two relays to share the shards and send everything")
        during = status(outbox_url)
        shards = [s for relay in during["relays"] for s in relay["shards"]]
        assert sorted(shards) == list(range(16))  # each shard owned once
        assert all(r["name"].startswith("relay-") and r["member"] for r in during["relays"])
        text = CliRunner().invoke(main, ["status", "--database-url", outbox_url])
        assert "relays: 2 connected" in text.output and "unowned shards: none" in text.output
        assert "prepared messages waiting for a verdict:" in text.output
        assert "parked inbox messages (public.inbox_parked):" in text.output
    after = status(outbox_url, "--exact")
    assert after["relays"] == [] and after["unowned_shards"] == list(range(16))
    topics = by_topic(after)
    assert (topics[orders]["sent"], topics[audit]["sent"]) == (5, 2)
    assert topics[orders]["pending"] == 0 and topics[orders]["dead"] == 0
    assert after["statuses"]["sent"] == {"count": 7, "estimate": False}


def explain(conn: sa.Connection, statement: sa.TextClause) -> str:
    rows = conn.execute(sa.text(f"EXPLAIN (ANALYZE, BUFFERS) {statement.text}")).all()
    return "\n".join(row[0] for row in rows)


def test_status_reads_a_million_sent_rows_through_the_partial_indexes(engine, outbox_url) -> None:  # type: ignore[no-untyped-def]
    with engine.begin() as conn:
        # A million sent rows over three topics and 3,000 pending rows of one of them, and
        # 20 prepared ones: what a busy table holds after a day.
        conn.execute(
            sa.text(
                "INSERT INTO outbox (id, shard, topic, key, value, status, sent_at, created_at)"
                " SELECT gen_random_uuid(), n % 16, 'topic-' || (n % 3), "
                "        convert_to('key-' || n, 'UTF8'), convert_to(repeat('x', 100), 'UTF8'),"
                "        CASE WHEN n <= 1000000 THEN 'sent' ELSE 'pending' END,"
                "        CASE WHEN n <= 1000000 THEN now() END,"
                "        now() - make_interval(secs => 1003000 - n)"
                "   FROM generate_series(1, 1003000) AS n"
            )
        )
        conn.execute(
            sa.text(
                "INSERT INTO outbox (id, shard, topic, status, prepared_at, check_group,"
                " next_check_at) SELECT gen_random_uuid(), n % 16, 'topic-0', 'prepared',"
                " now(), 'payments', now() FROM generate_series(1, 20) AS n"
            )
        )
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text("VACUUM ANALYZE outbox"))
    queries = Queries(OutboxTableSpec())
    with engine.begin() as conn:
        conn.execute(sa.text("SET LOCAL enable_seqscan = off"))  # as outbox.status does
        plans = {
            name: explain(conn, queries[name]) for name in ("status_pending", "status_prepared")
        }
    for name, plan in plans.items():
        print(f"-- {name}\n{plan}")
        assert "Seq Scan on outbox" not in plan
    assert "outbox_pending_idx" in plans["status_pending"]
    assert "outbox_prepared_idx" in plans["status_prepared"]

    started = time.monotonic()
    report = status(outbox_url)
    elapsed = time.monotonic() - started
    print(f"outbox status on 1,003,020 rows: {elapsed * 1000:.0f} ms (whole command)")
    assert report["statuses"]["pending"] == {"count": 3000, "estimate": False}
    assert report["statuses"]["prepared"] == {"count": 20, "estimate": False}
    sent = report["statuses"]["sent"]
    assert sent["estimate"] is True and 900_000 < sent["count"] < 1_100_000
    assert by_topic(report)["topic-0"]["prepared"] == 20
    # Far below a scan of the table's ~150 MB (the exact count of the same rows).
    started = time.monotonic()
    exact = status(outbox_url, "--exact")
    exact_elapsed = time.monotonic() - started
    print(f"outbox status --exact on the same rows: {exact_elapsed * 1000:.0f} ms")
    assert exact["statuses"]["sent"] == {"count": 1_000_000, "estimate": False}


def test_status_of_a_consumers_own_database_shows_the_inbox(  # type: ignore[no-untyped-def]
    database_url, bootstrap_servers, make_topic
) -> None:
    from tests import inbox_app
    from tests.inbox_helpers import (
        consumer_config,
        ledger_count,
        prepare_database,
        produce,
        running_consumer,
    )

    engine = prepare_database(database_url)  # the inbox tables and a ledger, no outbox table
    try:
        topic = make_topic("st-inbox")
        group = f"st-{uuid.uuid4().hex[:8]}"
        produce(bootstrap_servers, topic, range(3))
        config = consumer_config(database_url, bootstrap_servers)
        with running_consumer(inbox_app.make_inbox([topic], group), config):
            wait_for(lambda: ledger_count(engine) == 3, 60, "the three applied")
        # Stopped: their offsets committed as it left the group.
        produce(bootstrap_servers, topic, range(3, 5))  # two the group has not read
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    "INSERT INTO inbox_parked (consumer_group, topic, kafka_partition,"
                    " kafka_offset, reason, error) VALUES (:g, :t, 0, 9, 'handler', 'KeyError: x')"
                ),
                {"g": group, "t": topic},
            )
    finally:
        engine.dispose()
    text = CliRunner().invoke(main, ["status", "--database-url", database_url])
    assert text.exit_code == 0, text.output
    print(text.output)  # shown with -s: what an operator reads
    assert text.output.startswith("inbox public.inbox at ")
    assert "(no outbox table public.outbox in this database)" in text.output
    assert f"consumer groups: {group}\n" in text.output
    assert "parked inbox messages (public.inbox_parked):" in text.output
    assert "dead letters: none" in text.output and "consumer lag: not asked for" in text.output
    report = status(database_url, "--bootstrap-servers", bootstrap_servers)
    assert report["groups"] == [group] and report["dead_letters"] is None
    assert [(p["consumer_group"], p["count"]) for p in report["parked"]] == [(group, 1)]
    (lag,) = report["lag"]
    assert lag["group"] == group and lag["error"] is None
    assert sum(p["end"] - p["committed"] for p in lag["partitions"]) == 2
    # Neither the outbox table nor the inbox tables: the outbox table is what is missing.
    uninstall(database_url)
    missing = CliRunner().invoke(main, ["status", "--database-url", database_url])
    assert missing.exit_code == 2 and "public.outbox" in missing.output, missing.output
