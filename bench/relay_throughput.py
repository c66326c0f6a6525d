"""Relay benchmark: throughput next to its two baselines, latency, memory.

Side by side in one run, on one stack:

  producer    a bare confluent-kafka producer (idempotent, acks=all, the relay's settings)
              pushing N records of 256 bytes to the topic
  pg-cycle    the relay's own lease + mark-sent cycle on N pending rows, with no Kafka
  relay       `outbox relay` processes sending N pending rows: 1 and 3 relays,
              at-least-once and exactly-once

then the commit-to-ack latency at a steady 1,000 messages/s (one at-least-once relay;
the topic stamps records with the broker's append time), and each relay's memory.

Run: make bench-relay   (BENCH_ARGS="--n 100000" for a quick run)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psycopg
import sqlalchemy as sa
from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient, NewTopic

from bench.stack import bench_stack, machine, percentile
from outbox import Message, Outbox, migrate
from outbox.engines import sender_engine
from outbox.ids import uuid7
from outbox.records import producer_config
from outbox.schema import SHARD_COUNT, OutboxTableSpec, shard_of
from outbox.sending import Ack
from relay.store import RelayStore

VALUE_BYTES = 256
PARTITIONS = 6
KEYS = 10_000
BATCH_SIZE = 2000


@dataclass
class Run:
    name: str
    seconds: float
    rate: float
    peak_rss_mb: float = 0.0
    rss_growth: float = 1.0


def load_pending(conninfo: str, topic: str, n: int) -> None:
    """COPY ``n`` pending rows (256-byte values, 10,000 keys) into an empty outbox table."""
    value = os.urandom(VALUE_BYTES)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("TRUNCATE outbox")
        statement = "COPY outbox (id, shard, topic, key, value) FROM STDIN"
        with conn.cursor() as cur, cur.copy(statement) as copy:
            for i in range(n):
                key = f"key-{i % KEYS}".encode()
                message_id = uuid7()
                copy.write_row((message_id, shard_of(key, message_id), topic, key, value))
        conn.execute("VACUUM ANALYZE outbox")


def sent_span(conninfo: str) -> tuple[int, float]:
    with psycopg.connect(conninfo) as conn:
        row = conn.execute(
            "SELECT count(*), extract(epoch FROM max(sent_at) - min(sent_at)) "
            "FROM outbox WHERE status = 'sent'"
        ).fetchone()
    assert row is not None
    return int(row[0]), float(row[1] or 0.0)


def count_pending(conninfo: str) -> int:
    with psycopg.connect(conninfo) as conn:
        row = conn.execute("SELECT count(*) FROM outbox WHERE status <> 'sent'").fetchone()
    return int(row[0]) if row else 0


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def run_relays(
    name: str,
    database_url: str,
    conninfo: str,
    bootstrap: str,
    count: int,
    mode: str,
    n: int,
    log: Path,
) -> Run:
    env = {
        **os.environ,
        "OUTBOX_DATABASE_URL": database_url,
        "OUTBOX_KAFKA_BOOTSTRAP_SERVERS": bootstrap,
        "OUTBOX_LOG_LEVEL": "WARNING",
    }
    prefix = f"bench-{uuid.uuid4().hex[:6]}"
    args = [
        sys.executable,
        "-m",
        "outbox.cli",
        "relay",
        "--mode",
        mode,
        "--batch-size",
        str(BATCH_SIZE),
        "--transactional-id-prefix",
        prefix,
        "--progress-topic",
        f"progress-{prefix}",
    ]
    started = time.monotonic()
    with log.open("ab") as out:
        relays = [
            subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT)
            for _ in range(count)
        ]
    samples: dict[int, list[float]] = {p.pid: [] for p in relays}
    last_left, last_progress = n + 1, time.monotonic()
    try:
        while (left := count_pending(conninfo)) > 0:
            if left < last_left:
                last_left, last_progress = left, time.monotonic()
            elif time.monotonic() - last_progress > 120:
                raise RuntimeError(f"{name}: no progress for 2 minutes; see {log}")
            if any(p.poll() is not None for p in relays):
                raise RuntimeError(f"a relay exited early; see {log}")
            if time.monotonic() - started > 3600:
                raise TimeoutError(f"{name} did not finish within an hour")
            for p in relays:
                samples[p.pid].append(rss_mb(p.pid))
            time.sleep(0.5)
        wall = time.monotonic() - started
        peaks = [rss_mb(p.pid, "VmHWM") for p in relays]
    finally:
        for p in relays:
            p.send_signal(signal.SIGTERM)
        for p in relays:
            p.wait(120)
    sent, span = sent_span(conninfo)
    assert sent == n, f"{name}: {sent} of {n} sent"
    growth = max(
        (s[-1] / s[len(s) // 4]) if len(s) >= 8 and s[len(s) // 4] else 1.0
        for s in samples.values()
    )
    return Run(name, wall, n / span if span else n / wall, max(peaks), growth)


def bare_producer(bootstrap: str, topic: str, n: int) -> Run:
    producer = Producer(producer_config({"bootstrap.servers": bootstrap}))
    value = os.urandom(VALUE_BYTES)
    failures = 0

    def report(err, _msg) -> None:  # type: ignore[no-untyped-def]
        nonlocal failures
        if err is not None:
            failures += 1

    started = time.monotonic()
    for i in range(n):
        while True:
            try:
                producer.produce(
                    topic,
                    value=value,
                    key=f"key-{i % KEYS}".encode(),
                    headers=[("outbox-id", str(uuid7()).encode())],
                    on_delivery=report,
                )
                break
            except BufferError:
                producer.poll(0.05)
        if i % 10_000 == 0:
            producer.poll(0)
    producer.flush(300)
    seconds = time.monotonic() - started
    assert failures == 0
    return Run("bare producer", seconds, n / seconds)


def bare_pg_cycle(engine: sa.Engine, n: int) -> Run:
    store = RelayStore(engine, OutboxTableSpec(), f"relay-{uuid.uuid4()}")
    shards = list(range(SHARD_COUNT))
    done = 0
    started = time.monotonic()
    while True:
        batch = store.lease_batch(shards, BATCH_SIZE, 600)
        if not batch:
            break
        store.record_outcome([Ack(b.id, 0, i) for i, b in enumerate(batch)], [])
        done += len(batch)
    seconds = time.monotonic() - started
    store.close()
    assert done == n, f"pg cycle handled {done} of {n}"
    return Run("bare PG lease+mark", seconds, n / seconds)


def latency(
    database_url: str, bootstrap: str, topic: str, seconds: float, log: Path
) -> tuple[float, float, int]:
    """Commit-to-ack p50/p99 (ms) at 1,000 messages/s: 200 transactions/s of 5 messages."""
    engine = sa.create_engine(database_url)
    with engine.begin() as conn:
        conn.execute(sa.text("TRUNCATE outbox"))
    env = {
        **os.environ,
        "OUTBOX_DATABASE_URL": database_url,
        "OUTBOX_KAFKA_BOOTSTRAP_SERVERS": bootstrap,
        "OUTBOX_LOG_LEVEL": "WARNING",
    }
    with log.open("ab") as out:
        relay = subprocess.Popen(
            [sys.executable, "-m", "outbox.cli", "relay"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    committed: dict[str, float] = {}
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"lat-{uuid.uuid4()}",
            "auto.offset.reset": "latest",
            "isolation.level": "read_committed",
        }
    )
    consumer.subscribe([topic])
    appended: dict[str, float] = {}
    stop = threading.Event()

    def consume() -> None:
        while not stop.is_set():
            message = consumer.poll(0.2)
            if message is None or message.error():
                continue
            _, stamp = message.timestamp()
            appended[dict(message.headers() or [])["outbox-id"].decode()] = stamp / 1000

    reader = threading.Thread(target=consume)
    reader.start()
    time.sleep(5)  # relay up, consumer assigned
    ob = Outbox(engine)
    total = int(seconds * 200)
    start = time.monotonic()
    for i in range(total):
        with ob.transaction() as tx:
            results = tx.publish_many(
                [Message(topic, {"i": i, "j": j}, key=f"k{(i * 5 + j) % 97}") for j in range(5)]
            )
        now = time.time()
        for r in results:
            committed[str(r.message_id)] = now
        pause = start + (i + 1) / 200 - time.monotonic()
        if pause > 0:
            time.sleep(pause)
    deadline = time.monotonic() + 30
    while len(appended) < len(committed) and time.monotonic() < deadline:
        time.sleep(0.2)
    stop.set()
    reader.join()
    consumer.close()
    relay.send_signal(signal.SIGTERM)
    relay.wait(60)
    engine.dispose()
    values = sorted((appended[k] - committed[k]) * 1000 for k in committed if k in appended)
    return percentile(values, 0.5), percentile(values, 0.99), len(values)


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=1_000_000, help="messages per throughput run")
    parser.add_argument("--latency-seconds", type=float, default=30.0)
    args = parser.parse_args(argv)
    n = args.n
    log = Path(".stack") / "bench-relay.log"
    log.parent.mkdir(exist_ok=True)

    with bench_stack("bench-relay") as (stack, info):
        migrate.upgrade(info.database_url)
        conninfo = stack.postgres.conninfo("bench")
        engine = sender_engine(info.database_url)
        admin = AdminClient({"bootstrap.servers": info.bootstrap_servers})
        topics = {"relay": "bench-relay", "latency": "bench-latency", "bare": "bench-bare"}
        futures = admin.create_topics(
            [
                NewTopic(topics["relay"], PARTITIONS, 1),
                NewTopic(topics["bare"], PARTITIONS, 1),
                NewTopic(
                    topics["latency"],
                    PARTITIONS,
                    1,
                    config={"message.timestamp.type": "LogAppendTime"},
                ),
            ]
        )
        for future in futures.values():
            future.result(30)

        runs: list[Run] = []
        print(
            f"relay benchmark: {n:,} messages of {VALUE_BYTES} bytes, {KEYS:,} keys, "
            f"{PARTITIONS} partitions, batch {BATCH_SIZE}",
            flush=True,
        )
        print(f"machine: {machine()}", flush=True)
        runs.append(bare_producer(info.bootstrap_servers, topics["bare"], n))
        print(f"  {runs[-1].name}: {runs[-1].rate:,.0f} msgs/s", flush=True)
        load_pending(conninfo, topics["relay"], n)
        runs.append(bare_pg_cycle(engine, n))
        print(f"  {runs[-1].name}: {runs[-1].rate:,.0f} msgs/s", flush=True)
        for mode in ("at-least-once", "exactly-once"):
            for count in (1, 3):
                load_pending(conninfo, topics["relay"], n)
                name = f"relay {mode} x{count}"
                runs.append(
                    run_relays(
                        name,
                        info.database_url,
                        conninfo,
                        info.bootstrap_servers,
                        count,
                        mode,
                        n,
                        log,
                    )
                )
                run = runs[-1]
                print(f"  {name}: {run.rate:,.0f} msgs/s, peak RSS {run.peak_rss_mb:.0f} MB")
        p50, p99, measured = latency(
            info.database_url, info.bootstrap_servers, topics["latency"], args.latency_seconds, log
        )
        engine.dispose()

    rates = {run.name: run.rate for run in runs}
    floor = min(rates["bare producer"], rates["bare PG lease+mark"])
    alo1 = rates["relay at-least-once x1"]
    figures = {
        "n": n,
        "msgs_per_s": {k: round(v) for k, v in rates.items()},
        "ratio_relay_vs_min_baseline": round(alo1 / floor, 3),
        "ratio_relay_x3_vs_min_baseline": round(rates["relay at-least-once x3"] / floor, 3),
        "ratio_exactly_once_vs_at_least_once": round(rates["relay exactly-once x1"] / alo1, 3),
        "ratio_exactly_once_x3_vs_at_least_once_x3": round(
            rates["relay exactly-once x3"] / rates["relay at-least-once x3"], 3
        ),
        "latency_ms_at_1000_per_s": {
            "p50": round(p50, 1),
            "p99": round(p99, 1),
            "messages": measured,
        },
        "peak_rss_mb": {run.name: round(run.peak_rss_mb) for run in runs if run.peak_rss_mb},
        "rss_growth_last_vs_first_quarter": {
            run.name: round(run.rss_growth, 2) for run in runs if run.peak_rss_mb
        },
    }
    print()
    print(f"{'configuration':<28}{'msgs/s':>12}{'vs min(baselines)':>20}{'peak RSS MB':>14}")
    for run in runs:
        rss = f"{run.peak_rss_mb:.0f}" if run.peak_rss_mb else "-"
        print(f"{run.name:<28}{run.rate:>12,.0f}{run.rate / floor:>20.2f}{rss:>14}")
    print(
        f"exactly-once / at-least-once: x1 {figures['ratio_exactly_once_vs_at_least_once']}, "
        f"x3 {figures['ratio_exactly_once_x3_vs_at_least_once_x3']}   (floor >= 0.7)"
    )
    print(f"relay / min(baselines): {figures['ratio_relay_vs_min_baseline']}   (floor >= 0.5)")
    print(
        f"commit-to-ack at 1,000 msgs/s: p50 {p50:.1f} ms, p99 {p99:.1f} ms over {measured} "
        "messages   (floor p99 <= 50 ms)"
    )
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
