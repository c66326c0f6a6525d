"""Table health under steady load: what per-message updates leave behind.

Writers commit messages at a steady rate while one at-least-once relay sends them; every few
seconds the run samples the outbox table's size, its pending index's size, dead tuples,
autovacuum runs and the time of the relay's read statement. Two tables side by side:
PostgreSQL's default autovacuum settings, and tighter per-table settings
(``outbox.schema.PENDING_AUTOVACUUM``), to see whether a migration should apply them.

Run: python -m bench.table_health   (--messages 1000000 --rate 10000 by default)
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
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
from confluent_kafka.admin import AdminClient, NewTopic

from bench.relay_throughput import write_steadily
from bench.stack import bench_stack, machine, percentile
from outbox import migrate
from outbox.queries import Queries
from outbox.relay.store import HELD_REACH
from outbox.schema import DEFAULT_SPEC, PENDING_AUTOVACUUM, SHARD_COUNT

SAMPLE_EVERY = 5.0


@dataclass
class Samples:
    table_mb: list[float] = field(default_factory=list)
    pending_index_mb: list[float] = field(default_factory=list)
    dead_tuples: list[int] = field(default_factory=list)
    read_ms: list[float] = field(default_factory=list)
    autovacuums: int = 0


def sample(conninfo: str, read_sql: str, samples: Samples) -> None:
    with psycopg.connect(conninfo, autocommit=True) as conn:
        table, pending = conn.execute(
            "SELECT pg_table_size('outbox'), pg_relation_size('outbox_pending_idx')"
        ).fetchone() or (0, 0)
        dead, vacuums = conn.execute(
            "SELECT n_dead_tup, autovacuum_count FROM pg_stat_user_tables WHERE relname = 'outbox'"
        ).fetchone() or (0, 0)
        conn.execute("SET plan_cache_mode = force_custom_plan")
        conn.execute("SET jit = off")
        started = time.perf_counter()
        conn.execute(
            read_sql,
            {
                "shards": list(range(SHARD_COUNT)),
                "window": 125,
                "held_reach": HELD_REACH,
                "batch_size": 1000,
                "owner_key": None,
                **DEFAULT_SPEC.owner_session_keys,
            },
        ).fetchall()
        samples.read_ms.append((time.perf_counter() - started) * 1000)
    samples.table_mb.append(table / 2**20)
    samples.pending_index_mb.append(pending / 2**20)
    samples.dead_tuples.append(int(dead))
    samples.autovacuums = int(vacuums)


def one_run(
    database_url: str, conninfo: str, bootstrap: str, messages: int, rate: int, tuned: bool
) -> dict[str, object]:
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("TRUNCATE outbox")
        settings = ", ".join(f"{k} = {v}" for k, v in PENDING_AUTOVACUUM.items())
        if tuned:
            conn.execute(f"ALTER TABLE outbox SET ({settings})")
        else:
            conn.execute(f"ALTER TABLE outbox RESET ({', '.join(PENDING_AUTOVACUUM)})")
        conn.execute("VACUUM ANALYZE outbox")
        conn.execute("SELECT pg_stat_reset()")
    read_sql = str(Queries(DEFAULT_SPEC)["read_batch"]).replace(":shards", "%(shards)s")
    read_sql = read_sql.replace(":window", "%(window)s").replace(":batch_size", "%(batch_size)s")
    for name in ("owner_key", "session_space", "held_reach"):
        read_sql = read_sql.replace(f":{name}", f"%({name})s")
    env = {
        **os.environ,
        "OUTBOX_DATABASE_URL": database_url,
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

    def sampler() -> None:
        while not stop.wait(SAMPLE_EVERY):
            sample(conninfo, read_sql, samples)

    thread = threading.Thread(target=sampler)
    thread.start()
    started = time.monotonic()
    stamps = Path(".stack") / "bench-table-health.json"
    try:
        write_steadily(database_url, "bench-health", rate, messages / rate, str(stamps))
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
        thread.join()
        relay.send_signal(signal.SIGTERM)
        relay.wait(60)
    sample(conninfo, read_sql, samples)
    with psycopg.connect(conninfo) as conn:
        sent = conn.execute("SELECT count(*) FROM outbox WHERE status = 'sent'").fetchone()
    reads = sorted(samples.read_ms)
    return {
        "table": "tuned" if tuned else "default",
        "messages_sent": int(sent[0]) if sent else 0,
        "write_rate": round(messages / written),
        "table_mb_end": round(samples.table_mb[-1], 1),
        "pending_index_mb_max": round(max(samples.pending_index_mb), 2),
        "pending_index_mb_end": round(samples.pending_index_mb[-1], 2),
        "dead_tuples_max": max(samples.dead_tuples),
        "autovacuums": samples.autovacuums,
        "read_ms_p50": round(percentile(reads, 0.5), 2),
        "read_ms_max": round(reads[-1], 2),
    }


def main(argv: list[str] | None = None) -> list[dict[str, object]]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--rate", type=int, default=10_000, help="messages per second")
    args = parser.parse_args(argv)
    results = []
    with bench_stack("bench-health") as (stack, info):
        migrate.upgrade(info.database_url)
        conninfo = stack.postgres.conninfo("bench")
        admin = AdminClient({"bootstrap.servers": info.bootstrap_servers})
        admin.create_topics([NewTopic("bench-health", 6, 1)])["bench-health"].result(30)
        print(f"table health: {args.messages:,} messages at {args.rate:,}/s; {machine()}")
        for tuned in (False, True):
            results.append(
                one_run(
                    info.database_url,
                    conninfo,
                    info.bootstrap_servers,
                    args.messages,
                    args.rate,
                    tuned,
                )
            )
            print("  " + json.dumps(results[-1]), flush=True)
    print()
    columns = list(results[0])
    print("".join(f"{c:>22}" for c in columns))
    for result in results:
        print("".join(f"{result[c]!s:>22}" for c in columns))
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
