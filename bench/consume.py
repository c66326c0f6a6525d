"""Inbox consumer benchmark: throughput next to its two baselines.

Side by side in one run, on one stack, the same N records (JSON values of about 100 bytes
with an ``outbox-id`` header, 10,000 keys, 6 partitions) and the same batch size:

  kafka       a bare confluent-kafka consumer (read_committed, manual commits) reading the
              topic, one synchronous offset commit per batch
  pg-cycle    a bare PostgreSQL cycle: one transaction per batch, one INSERT of a ledger row
              per message (psycopg, no SQLAlchemy)
  sa-cycle    for reference, not a baseline: the pg-cycle's inserts made through a SQLAlchemy
              Session (what the inbox's per-message handler does), to show what the ORM
              layer costs
  inbox       `outbox consume` processes whose handler inserts that same ledger row through
              the session it is given, one statement per message (`@inbox.handler`): 1 and 3
              consumers, each run a new consumer group
  inbox batch the same with a batch handler (`@inbox.batch_handler`): the batch's ledger rows
              in one statement (executemany): 1 and 3 consumers

The inbox's rate is N over the span of its ledger rows' commit times (from the first row
written to the last), so process start-up and the group join are not counted. The last line
is one JSON object: the rates, and each inbox configuration's ratio to min(baselines).

Run: make bench-consume   (BENCH_ARGS="--n 20000" for a quick run)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import orjson
import psycopg
import sqlalchemy as sa
from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient, NewTopic
from sqlalchemy.orm import Session

from bench.stack import bench_stack, machine
from outbox.inbox import Inbox, InboxMessage
from outbox.inbox import install as install_inbox

PARTITIONS = 6
KEYS = 10_000
TOPIC = "bench-consume"
BATCH_TARGET = "bench.consume:batch_inbox"
INBOX_RUNS = ("inbox x1", "inbox x3", "inbox batch x1", "inbox batch x3")
#: Issue 13's floor: an inbox configuration's rate over min(baselines), at batch size 500.
FLOOR = 0.5

LEDGER_DDL = """
CREATE TABLE IF NOT EXISTS {name} (
    message_id text NOT NULL,
    n bigint NOT NULL,
    amount bigint NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT clock_timestamp()
)
"""
_INSERT = sa.text("INSERT INTO ledger (message_id, n, amount) VALUES (:id, :n, :amount)")

# The applications `outbox consume bench.consume:inbox` (one statement per message) and
# `bench.consume:batch_inbox` (one statement per batch) run.
inbox = Inbox(group=os.environ.get("BENCH_GROUP", "bench"))
batch_inbox = Inbox(group=os.environ.get("BENCH_GROUP", "bench"))


def _row(message: InboxMessage) -> dict[str, object]:
    return {"id": message.id, "n": message.value["n"], "amount": message.value["amount"]}


@inbox.handler(TOPIC)
def on_record(message: InboxMessage, session: Session) -> None:
    session.execute(_INSERT, _row(message))


@batch_inbox.batch_handler(TOPIC)
def on_records(messages: list[InboxMessage], session: Session) -> None:
    session.execute(_INSERT, [_row(message) for message in messages])


@dataclass
class Run:
    name: str
    seconds: float
    rate: float


def produce(bootstrap: str, n: int) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "acks": "all"})
    pad = "x" * 60
    for i in range(n):
        producer.produce(
            TOPIC,
            orjson.dumps({"n": i, "amount": i, "pad": pad}),
            key=f"key-{i % KEYS}".encode(),
            headers=[("outbox-id", str(uuid.uuid4())), ("content-type", "application/json")],
        )
        if i % 10_000 == 0:
            producer.poll(0)
    assert producer.flush(120) == 0


def bare_consumer(bootstrap: str, n: int, batch_size: int) -> Run:
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"bench-bare-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
            "auto.offset.reset": "earliest",
        }
    )
    consumer.subscribe([TOPIC])
    seen = 0
    started = None
    while seen < n:
        records = consumer.consume(batch_size, 1.0)
        good = [r for r in records if r.error() is None]
        if not good:
            continue
        if started is None:
            started = time.perf_counter()
        for record in good:
            orjson.loads(record.value())  # what any consumer does with a value
        seen += len(good)
        consumer.commit(asynchronous=False)
    assert started is not None
    seconds = time.perf_counter() - started
    consumer.close()
    return Run("bare kafka consumer", seconds, n / seconds)


def bare_pg_cycle(conninfo: str, n: int, batch_size: int) -> Run:
    with psycopg.connect(conninfo) as conn:
        conn.execute(LEDGER_DDL.format(name="ledger_bare"))
        conn.commit()
        started = time.perf_counter()
        for first in range(0, n, batch_size):
            with conn.transaction(), conn.cursor() as cur:
                for i in range(first, min(first + batch_size, n)):
                    cur.execute(
                        "INSERT INTO ledger_bare (message_id, n, amount) VALUES (%s, %s, %s)",
                        (str(uuid.uuid4()), i, i),
                    )
        seconds = time.perf_counter() - started
    return Run("bare PG insert cycle", seconds, n / seconds)


def session_cycle(url: str, n: int, batch_size: int) -> Run:
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql("TRUNCATE ledger")
    started = time.perf_counter()
    for first in range(0, n, batch_size):
        with Session(engine) as session, session.begin():
            for i in range(first, min(first + batch_size, n)):
                session.execute(_INSERT, {"id": str(uuid.uuid4()), "n": i, "amount": i})
    seconds = time.perf_counter() - started
    engine.dispose()
    return Run("SQLAlchemy session cycle", seconds, n / seconds)


def run_inbox(
    name: str,
    target: str,
    info_url: str,
    bootstrap: str,
    count: int,
    n: int,
    batch_size: int,
    log: Path,
) -> Run:
    engine = sa.create_engine(info_url)
    with engine.begin() as conn:
        conn.exec_driver_sql("TRUNCATE ledger")
    env = {
        **os.environ,
        "OUTBOX_DATABASE_URL": info_url,
        "OUTBOX_KAFKA_BOOTSTRAP_SERVERS": bootstrap,
        "BENCH_GROUP": f"bench-inbox-{uuid.uuid4().hex[:8]}",
        "OUTBOX_LOG_LEVEL": "WARNING",
    }
    with log.open("ab") as output:
        processes = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "outbox.cli",
                    "consume",
                    target,
                    "--batch-size",
                    str(batch_size),
                ],
                env=env,
                stdout=output,
                stderr=subprocess.STDOUT,
            )
            for _ in range(count)
        ]
    try:
        deadline = time.monotonic() + max(600, n / 200)
        while time.monotonic() < deadline:
            with engine.connect() as conn:
                done = conn.execute(sa.text("SELECT count(*) FROM ledger")).scalar_one()
            if done >= n:
                break
            if any(p.poll() is not None for p in processes):
                raise RuntimeError(f"a consumer exited early; see {log}")
            time.sleep(0.5)
        else:
            raise RuntimeError(f"{name}: only {done} of {n} applied; see {log}")
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(60)
    with engine.connect() as conn:
        count_, span, distinct = conn.execute(
            sa.text(
                "SELECT count(*), extract(epoch FROM max(applied_at) - min(applied_at)),"
                " count(DISTINCT message_id) FROM ledger"
            )
        ).one()
    engine.dispose()
    assert count_ == distinct == n, f"{name}: {count_} rows for {distinct} of {n} messages"
    seconds = float(span)
    return Run(name, seconds, n / seconds)


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=100_000, help="records per run")
    parser.add_argument("--batch-size", type=int, default=500)
    args = parser.parse_args(argv)
    n, batch = args.n, args.batch_size
    with bench_stack("bench-consume") as (stack, info):
        log = stack.run_dir / "consumers.log"
        conninfo = stack.postgres.conninfo("bench")
        install_inbox(info.database_url)
        with psycopg.connect(conninfo, autocommit=True) as conn:
            conn.execute(LEDGER_DDL.format(name="ledger"))
        admin = AdminClient({"bootstrap.servers": info.bootstrap_servers})
        for future in admin.create_topics([NewTopic(TOPIC, PARTITIONS, 1)]).values():
            future.result(30)
        print(
            f"inbox consumer benchmark: {n:,} records, {KEYS:,} keys, {PARTITIONS} partitions, "
            f"batch {batch}",
            flush=True,
        )
        print(f"machine: {machine()}", flush=True)
        produce(info.bootstrap_servers, n)
        runs = [bare_consumer(info.bootstrap_servers, n, batch)]
        print(f"  {runs[-1].name}: {runs[-1].rate:,.0f} msgs/s", flush=True)
        runs.append(bare_pg_cycle(conninfo, n, batch))
        print(f"  {runs[-1].name}: {runs[-1].rate:,.0f} msgs/s", flush=True)
        runs.append(session_cycle(info.database_url, n, batch))
        print(f"  {runs[-1].name}: {runs[-1].rate:,.0f} msgs/s (reference)", flush=True)
        for label, target in (("inbox", "bench.consume:inbox"), ("inbox batch", BATCH_TARGET)):
            for count in (1, 3):
                name = f"{label} x{count}"
                url, bootstrap = info.database_url, info.bootstrap_servers
                runs.append(run_inbox(name, target, url, bootstrap, count, n, batch, log))
                print(f"  {name}: {runs[-1].rate:,.0f} msgs/s", flush=True)

    rates = {run.name: run.rate for run in runs}
    floor = min(rates["bare kafka consumer"], rates["bare PG insert cycle"])
    session = "SQLAlchemy session cycle"
    ratios = {name: round(rates[name] / floor, 3) for name in INBOX_RUNS}
    meets = {name: ratio >= FLOOR for name, ratio in ratios.items()}
    figures = {
        "n": n,
        "batch_size": batch,
        "msgs_per_s": {k: round(v) for k, v in rates.items()},
        "ratio_inbox_vs_min_baseline": ratios["inbox x1"],
        "ratio_inbox_x3_vs_min_baseline": ratios["inbox x3"],
        "ratio_inbox_vs_session_cycle": round(rates["inbox x1"] / rates[session], 3),
        "ratio_session_cycle_vs_min_baseline": round(rates[session] / floor, 3),
        "ratio_inbox_batch_vs_min_baseline": ratios["inbox batch x1"],
        "ratio_inbox_batch_x3_vs_min_baseline": ratios["inbox batch x3"],
        "meets_floor": meets,
    }
    print()
    print(f"{'configuration':<28}{'msgs/s':>12}{'vs min(baselines)':>20}")
    for run in runs:
        print(f"{run.name:<28}{run.rate:>12,.0f}{run.rate / floor:>20.2f}")
    for name in INBOX_RUNS:
        verdict = "meets" if meets[name] else "below"
        print(f"{name} / min(baselines): {ratios[name]}  ({verdict} the floor of {FLOOR})")
    print(f"inbox x1 / SQLAlchemy session cycle: {figures['ratio_inbox_vs_session_cycle']}")
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
