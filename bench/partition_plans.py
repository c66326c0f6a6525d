"""The relay's read on the plain and the partitioned layout, with many partitions.

Loads the same rows into two outbox tables of one database (schema ``plain``, and schema
``parted`` partitioned by hour, or by day with ``--interval daily``): ``--sent`` sent rows
spread evenly over ``--hours`` hours (a partition each hour or day, plus the ones made ahead
and the default), and ``--pending`` pending rows in the last hour, ``--backing-off`` of them
backing off before a retry. Then runs the relay's read (all 16 shards, as one relay owning
them all) with EXPLAIN (ANALYZE, BUFFERS) on each, a few times, and prints
the last plan of each and the best execution times.

Run: python -m bench.partition_plans   (a stack of its own: PostgreSQL only)
"""

from __future__ import annotations

import argparse
import re
import secrets
import shutil
import tempfile
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
import sqlalchemy as sa

from bench.table_health import read_params
from outbox import migrate
from outbox.devstack.postgres import PostgresServer
from outbox.devstack.procs import free_port
from outbox.partition_layout import INTERVALS, create_range, period_start
from outbox.queries import Queries
from outbox.schema import OutboxTableSpec

_LOAD = """
INSERT INTO {table} (id, shard, topic, key, value, status, created_at, sent_at,
                     next_attempt_at, attempts)
SELECT (lpad(to_hex((extract(epoch FROM t) * 1000)::bigint), 12, '0') || '7000'
        || '8' || lpad(to_hex(i), 15, '0'))::uuid,
       i %% 16, 'orders', ('k' || i %% 997)::bytea, 'x', %(status)s, t,
       CASE WHEN %(status)s = 'sent' THEN t END,
       CASE WHEN %(status)s = 'pending' AND i %% %(every)s = 0 THEN now() + interval '1 hour' END,
       CASE WHEN %(status)s = 'pending' AND i %% %(every)s = 0 THEN 1 ELSE 0 END
  FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS i,
       LATERAL (SELECT %(start)s::timestamptz
                       + (i - %(first)s) * %(span)s::interval / (%(last)s - %(first)s + 1)) AS s (t)
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sent", type=int, default=2_000_000)
    parser.add_argument("--hours", type=int, default=24 * 7)
    parser.add_argument("--pending", type=int, default=20_000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument(
        "--backing-off", type=float, default=0.0, help="fraction of pending rows backing off"
    )
    parser.add_argument("--interval", choices=["hourly", "daily"], default="hourly")
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="bench-plans-"))
    root.chmod(0o777)  # the server may run as the postgres user
    postgres = PostgresServer(root, free_port(), secrets.token_urlsafe(12), durable=False)
    try:
        postgres.start()
        url = postgres.create_database("plans")
        now = datetime.now(UTC)
        # Every n-th pending row backs off (n beyond the rows: none does).
        every = round(1 / args.backing_off) if args.backing_off > 0 else 2**62
        step = INTERVALS[args.interval]
        start = now - timedelta(hours=args.hours)
        for schema in ("plain", "parted"):
            spec = OutboxTableSpec(schema=schema)
            migrate.upgrade(url, spec, partitioned=args.interval if schema == "parted" else None)
        with psycopg.connect(postgres.conninfo("plans"), autocommit=True) as conn:
            if args.hours > 0:
                # Partitions for the loaded hours (the migration made them from now on).
                engine = sa.create_engine(url)
                with engine.begin() as sconn:
                    period = period_start(start, args.interval)
                    while period < period_start(now, args.interval):
                        create_range(sconn, OutboxTableSpec(schema="parted"), period, args.interval)
                        period += step
                engine.dispose()
            for schema in ("plain", "parted"):
                table = f'"{schema}"."outbox"'
                conn.execute(
                    _LOAD.format(table=table),
                    {
                        "every": 1,
                        "status": "sent",
                        "first": 1,
                        "last": args.sent,
                        "start": start,
                        "span": f"{args.hours} hours",
                    },
                )
                conn.execute(
                    _LOAD.format(table=table),
                    {
                        "every": every,
                        "status": "pending",
                        "first": args.sent + 1,
                        "last": args.sent + args.pending,
                        "start": now - timedelta(minutes=30),
                        "span": "20 minutes",
                    },
                )
                conn.execute(f"VACUUM ANALYZE {table}")
            partitions = conn.execute(
                "SELECT count(*) FROM pg_inherits WHERE inhparent = 'parted.outbox'::regclass"
            ).fetchone()
            print(
                f"relay read: {args.sent:,} sent rows over {args.hours} hours, "
                f"{args.pending:,} pending ({args.backing_off:.0%} backing off); "
                f"partitioned: {partitions[0] if partitions else 0} partitions"
            )
            conn.execute("SET plan_cache_mode = force_custom_plan")
            conn.execute("SET jit = off")
            for schema in ("plain", "parted"):
                sql = str(Queries(OutboxTableSpec(schema=schema))["read_batch"])
                for name in read_params():
                    sql = sql.replace(f":{name}", f"%({name})s")
                times = []
                plan = ""
                for _ in range(args.runs):
                    rows = conn.execute(
                        "EXPLAIN (ANALYZE, BUFFERS) " + sql, read_params()
                    ).fetchall()
                    plan = "\n".join(str(row[0]) for row in rows)
                    found = re.search(r"Execution Time: ([\d.]+) ms", plan)
                    times.append(float(found.group(1)) if found else float("nan"))
                buffers = re.search(r"Buffers: (.*)", plan)
                print(
                    f"\n== {schema}: execution ms best {min(times):.2f}, "
                    f"median {sorted(times)[len(times) // 2]:.2f}; first line buffers: "
                    f"{buffers.group(1) if buffers else '?'}"
                )
                print(plan)
    finally:
        postgres.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
