"""Table health under steady load: the plain and the partitioned layout side by side.

Writers commit messages at a steady rate while one at-least-once relay sends them and
retention runs every few seconds: on the plain table ``purge_sent`` deletes sent rows older
than the retention, on the partitioned one (minute partitions, so that retention works within
the run) ``partition_retention.maintain`` drops whole partitions. Every couple of seconds the
run samples the table's size (all partitions), its pending index's size, dead tuples,
autovacuum runs and the time of the relay's read statement; the writers' longest pause
between two commits shows what the retention's locks cost them. A third run, the plain table
with tighter per-table autovacuum settings (``outbox.schema.PENDING_AUTOVACUUM``), is kept
from earlier runs of this benchmark. The last lines give each figure as the ratio of
partitioned to plain.

Run: python -m bench.table_health   (--messages 1000000 --rate 10000 by default)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import psycopg
import sqlalchemy as sa
from confluent_kafka.admin import AdminClient, NewTopic

from bench.relay_throughput import write_steadily
from bench.stack import bench_stack, machine, percentile
from outbox import migrate
from outbox.partition_retention import maintain
from outbox.queries import Queries
from outbox.relay.store import HELD_REACH
from outbox.retention import purge_sent
from outbox.schema import DEFAULT_SPEC, PENDING_AUTOVACUUM, SHARD_COUNT

SAMPLE_EVERY = 2.0
LAYOUTS = ("plain", "plain-tuned", "partitioned")

# The table and its partitions (pg_partition_tree gives nothing for a plain table).
_TREE = "SELECT relid FROM pg_partition_tree('{0}') UNION SELECT '{0}'::regclass"
_SIZES = f"""
SELECT (SELECT coalesce(sum(pg_table_size(relid)), 0) FROM ({_TREE.format("outbox")}) AS t),
       (SELECT coalesce(sum(pg_relation_size(relid)), 0)
          FROM ({_TREE.format("outbox_pending_idx")}) AS i)
"""
_STATS = f"""
SELECT relname, n_dead_tup, autovacuum_count FROM pg_stat_user_tables
 WHERE relid IN ({_TREE.format("outbox")})
"""


@dataclass
class Samples:
    table_mb: list[float] = field(default_factory=list)
    pending_index_mb: list[float] = field(default_factory=list)
    dead_tuples: list[int] = field(default_factory=list)
    read_ms: list[float] = field(default_factory=list)
    #: per table (partitions come and go): the most autovacuum runs seen
    autovacuums: dict[str, int] = field(default_factory=dict)
    retention_runs: int = 0
    retention_s_max: float = 0.0
    removed: int = 0  # rows purged (plain), or partitions dropped (partitioned)


def sample(conninfo: str, read_sql: str, samples: Samples) -> None:
    with psycopg.connect(conninfo, autocommit=True) as conn:
        table, pending = conn.execute(_SIZES).fetchone() or (0, 0)
        stats = conn.execute(_STATS).fetchall()
        conn.execute("SET plan_cache_mode = force_custom_plan")
        conn.execute("SET jit = off")
        started = time.perf_counter()
        conn.execute(read_sql, read_params()).fetchall()
        samples.read_ms.append((time.perf_counter() - started) * 1000)
    samples.table_mb.append(float(table) / 2**20)
    samples.pending_index_mb.append(float(pending) / 2**20)
    samples.dead_tuples.append(sum(int(dead) for _, dead, _ in stats))
    for name, _, vacuums in stats:
        samples.autovacuums[name] = max(samples.autovacuums.get(name, 0), int(vacuums))


def read_params() -> dict[str, object]:
    return {
        "shards": list(range(SHARD_COUNT)),
        "window": 125,
        "held_reach": HELD_REACH,
        "batch_size": 1000,
        "owner_key": None,
        **DEFAULT_SPEC.owner_session_keys,
    }


def read_statement() -> str:
    """The relay's read, as driver SQL with psycopg's named parameters."""
    read_sql = str(Queries(DEFAULT_SPEC)["read_batch"])
    for name in ("shards", "window", "batch_size", "owner_key", "session_space", "held_reach"):
        read_sql = read_sql.replace(f":{name}", f"%({name})s")
    return read_sql


def retain(
    database_url: str,
    layout: str,
    keep: timedelta,
    every: float,
    stop: threading.Event,
    samples: Samples,
) -> None:
    """Retention every ``every`` seconds, as a scheduler would run it."""
    engine = sa.create_engine(database_url)
    try:
        while not stop.wait(every):
            started = time.monotonic()
            if layout == "partitioned":
                report = maintain(engine, keep, carry=True, ahead=3)
                samples.removed += len(report.dropped)
            else:
                samples.removed += purge_sent(engine, keep, batch_size=5000)
            samples.retention_runs += 1
            samples.retention_s_max = max(samples.retention_s_max, time.monotonic() - started)
    finally:
        engine.dispose()


def one_run(
    url: str,
    conninfo: str,
    bootstrap: str,
    layout: str,
    args: argparse.Namespace,
) -> dict[str, object]:
    with psycopg.connect(conninfo, autocommit=True) as conn:
        if layout == "plain-tuned":
            settings = ", ".join(f"{k} = {v}" for k, v in PENDING_AUTOVACUUM.items())
            conn.execute(f"ALTER TABLE outbox SET ({settings})")
        conn.execute("VACUUM ANALYZE outbox")
        conn.execute("SELECT pg_stat_reset()")
    env = {
        **os.environ,
        "OUTBOX_DATABASE_URL": url,
        "OUTBOX_KAFKA_BOOTSTRAP_SERVERS": bootstrap,
        "OUTBOX_LOG_LEVEL": "WARNING",
    }
    relay = subprocess.Popen(
        [sys.executable, "-m", "outbox.cli", "relay"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    samples = Samples()
    stop = threading.Event()
    read_sql = read_statement()

    def sampler() -> None:
        while not stop.wait(SAMPLE_EVERY):
            sample(conninfo, read_sql, samples)

    threads = [
        threading.Thread(target=sampler),
        threading.Thread(
            target=retain,
            args=(url, layout, timedelta(seconds=args.retain), args.every, stop, samples),
        ),
    ]
    for thread in threads:
        thread.start()
    started = time.monotonic()
    stamps = Path(".stack") / "bench-table-health.json"
    try:
        write_steadily(url, "bench-health", args.rate, args.messages / args.rate, str(stamps))
        written = time.monotonic() - started
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with psycopg.connect(conninfo) as conn:
                row = conn.execute("SELECT count(*) FROM outbox WHERE status <> 'sent'").fetchone()
            if row and row[0] == 0:
                break
            time.sleep(1)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        relay.send_signal(signal.SIGTERM)
        relay.wait(60)
    sample(conninfo, read_sql, samples)
    commits = sorted(json.loads(stamps.read_text()).values())
    stall = max((b - a for a, b in itertools.pairwise(commits)), default=0.0)
    reads = sorted(samples.read_ms)
    return {
        "layout": layout,
        "writer_tps": round(args.messages / written),
        "writer_stall_ms": round(stall * 1000, 1),
        "table_mb_max": round(max(samples.table_mb), 1),
        "table_mb_end": round(samples.table_mb[-1], 1),
        "pending_idx_mb_max": round(max(samples.pending_index_mb), 2),
        "dead_tuples_max": max(samples.dead_tuples),
        "autovacuums": sum(samples.autovacuums.values()),
        "read_ms_p50": round(percentile(reads, 0.5), 2),
        "read_ms_max": round(reads[-1], 2),
        "retention_runs": samples.retention_runs,
        "retention_s_max": round(samples.retention_s_max, 2),
        "removed": samples.removed,
    }


def main(argv: list[str] | None = None) -> list[dict[str, object]]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--rate", type=int, default=10_000, help="messages per second")
    parser.add_argument(
        "--retain", type=float, default=60.0, help="seconds a sent row is kept (retention)"
    )
    parser.add_argument("--every", type=float, default=10.0, help="seconds between retentions")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated runs")
    args = parser.parse_args(argv)
    layouts = [layout for layout in args.layouts.split(",") if layout]
    results = []
    with bench_stack("bench-health") as (stack, info):
        admin = AdminClient({"bootstrap.servers": info.bootstrap_servers})
        admin.create_topics([NewTopic("bench-health", 6, 1)])["bench-health"].result(30)
        print(
            f"table health: {args.messages:,} messages at {args.rate:,}/s, rows kept "
            f"{args.retain:g}s, retention every {args.every:g}s; {machine()}"
        )
        for layout in layouts:
            database = f"bench_{layout.replace('-', '_')}"
            url = stack.postgres.create_database(database)
            partitioned = "minutely" if layout == "partitioned" else None
            migrate.upgrade(url, partitioned=partitioned)
            conninfo = stack.postgres.conninfo(database)
            results.append(one_run(url, conninfo, info.bootstrap_servers, layout, args))
            print("  " + json.dumps(results[-1]), flush=True)
    print()
    columns = list(results[0])
    print("".join(f"{c:>20}" for c in columns))
    for result in results:
        print("".join(f"{result[c]!s:>20}" for c in columns))
    by_layout = {str(r["layout"]): r for r in results}
    if {"plain", "partitioned"} <= set(by_layout):
        plain, parted = by_layout["plain"], by_layout["partitioned"]
        ratios = {
            c: round(float(str(parted[c])) / float(str(plain[c])), 2)
            if float(str(plain[c]))
            else None
            for c in columns[1:]
            if c not in ("retention_runs", "removed")
        }
        print("partitioned / plain: " + json.dumps(ratios))
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
