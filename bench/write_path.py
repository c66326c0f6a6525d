"""Write-path benchmark: what one outbox message adds to a business transaction.

Four kinds of transaction, interleaved in rounds so that drift on a noisy machine hits all
of them alike, each on its own SQLAlchemy Core connection in one transaction:

  a  bare      insert one order row
  b  plain     a + one row of the outbox row's size into a table with only a primary key
  c  outbox    a + one message through Outbox.publish
  d  bulk10    a + ten messages through Outbox.publish_many

Then concurrent writers (durable PostgreSQL), side by side in one run:

  pgbench   1, 16 and 64 clients: an order row plus one message row into a table of the
            outbox's shape without any wake-up, into the outbox table (wake trigger), and
            into a copy with the former NOTIFY-on-every-insert rule. What the relay's
            wake-up costs the database, without Python in the way.
  Python    the same four kinds as above through the API, from threads in a few processes,
            and e: a + the message's own row (same columns, values and indexes, in the
            pgbench copy of the outbox table without its trigger) written with plain SQL.
            c / e is what the outbox adds to writing that row yourself: building the
            message (serializing, ids, checks) and the wake trigger.

Then writers beside running relays (bench.write_relays): 1, 2, 5 and 17 `outbox relay`
processes relaying to Kafka while 16 pgbench writers insert, the same transaction into the
table of the outbox's shape as the reference, and the writers' NOTIFYs counted per commit
(floor: at most 1%).

Prints p50/p99 per transaction and the ratios; the last line is one JSON object.
Run: make bench-write   (or python -m bench.write_path --n 10000 --writers 1,16,64)
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import orjson
import sqlalchemy as sa

from bench import plots, write_pgbench, write_relays
from bench.stack import bench_stack, machine, percentile
from bench.write_concurrency import measure_concurrent
from outbox import Message, Outbox, migrate
from outbox.ids import uuid7
from outbox.schema import DEFAULT_SPEC, SHARD_COUNT

KINDS = ("bare", "plain", "outbox", "bulk10")
#: The concurrent cases add one: the outbox row itself written as a plain row (see runners).
CONCURRENT_KINDS = (*KINDS, "shape")


def event(order_id: int) -> dict[str, object]:
    return {
        "type": "OrderPlaced",
        "order_id": order_id,
        "customer_id": f"cust-{order_id % 9973:05d}",
        "total_cents": 1999 + order_id % 500,
        "currency": "EUR",
        "lines": [{"sku": f"sku-{order_id % 97}", "qty": 1 + order_id % 3}],
    }


def prepare(engine: sa.Engine) -> int:
    """Create the business tables; return the payload size that matches an outbox row."""
    with engine.begin() as conn:
        conn.execute(
            sa.text("CREATE TABLE orders (id bigint PRIMARY KEY, customer text, total int)")
        )
        conn.execute(sa.text("CREATE TABLE plain_rows (id uuid PRIMARY KEY, payload bytea)"))
    ob = Outbox(engine)
    with ob.transaction() as tx:
        tx.publish_many([Message("orders", event(i), key=i) for i in range(100)])
    with engine.begin() as conn:
        row_size = conn.execute(
            sa.text("SELECT avg(pg_column_size(o.*))::int FROM outbox o")
        ).scalar_one()
        conn.execute(sa.text("TRUNCATE outbox"))
    return max(16, row_size - 40)  # minus the plain row's uuid and tuple overhead


def runners(
    engine: sa.Engine, payload_size: int
) -> dict[str, Callable[[sa.Connection, int], None]]:
    ob = Outbox(engine)
    insert_order = sa.text("INSERT INTO orders VALUES (:id, :customer, :total)")
    insert_plain = sa.text("INSERT INTO plain_rows VALUES (gen_random_uuid(), :payload)")
    insert_shape = sa.text(
        "INSERT INTO outbox_shape (id, shard, topic, key, value, content_type) "
        "VALUES (:id, :shard, 'orders', :key, :value, 'application/json')"
    )
    payload = os.urandom(payload_size)

    def bare(conn: sa.Connection, n: int) -> None:
        conn.execute(insert_order, {"id": n, "customer": f"cust-{n}", "total": n % 1000})

    def plain(conn: sa.Connection, n: int) -> None:
        bare(conn, n)
        conn.execute(insert_plain, {"payload": payload})

    def outbox(conn: sa.Connection, n: int) -> None:
        bare(conn, n)
        ob.publish(conn, "orders", event(n), key=n)

    def bulk10(conn: sa.Connection, n: int) -> None:
        bare(conn, n)
        ob.publish_many(conn, [Message("orders", event(n * 10 + i), key=n) for i in range(10)])

    def shape(conn: sa.Connection, n: int) -> None:
        # The message's row as the application could write it itself: the same columns,
        # values, id kind and indexes (write_pgbench's copy of the outbox table), no trigger.
        bare(conn, n)
        conn.execute(
            insert_shape,
            {
                "id": uuid7(),
                "shard": n % SHARD_COUNT,
                "key": str(n).encode(),
                "value": orjson.dumps(event(n)),
            },
        )

    return {"bare": bare, "plain": plain, "outbox": outbox, "bulk10": bulk10, "shape": shape}


def measure(
    engine: sa.Engine, n: int, payload_size: int, round_size: int = 250
) -> dict[str, list[float]]:
    run = runners(engine, payload_size)
    timings: dict[str, list[float]] = {kind: [] for kind in KINDS}
    order_id = 0
    with engine.connect() as conn:
        for _ in range(200):  # warm caches, plans and the pool
            for kind in KINDS:
                order_id += 1
                with conn.begin():
                    run[kind](conn, order_id)
        done = 0
        rounds = 0
        while done < n:
            batch = min(round_size, n - done)
            order = KINDS[rounds % 4 :] + KINDS[: rounds % 4]  # rotate who goes first
            for kind in order:
                for _ in range(batch):
                    order_id += 1
                    start = time.perf_counter_ns()
                    with conn.begin():
                        run[kind](conn, order_id)
                    timings[kind].append((time.perf_counter_ns() - start) / 1000)
            done += batch
            rounds += 1
    return timings


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=10_000, help="transactions of each kind")
    parser.add_argument(
        "--writers", default="1,16,64", help="concurrent writer counts, comma-separated"
    )
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds per case per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per writer count")
    parser.add_argument(
        "--relays", default="1,2,5,17", help="relay counts of the case with relays running"
    )
    parser.add_argument(
        "--relay-seconds", type=int, default=10, help="seconds per pgbench run beside relays"
    )
    parser.add_argument(
        "--plot", type=Path, metavar="DIR", help="draw the figures as PNG files in DIR (matplotlib)"
    )
    args = parser.parse_args(argv)
    writer_counts = [int(w) for w in args.writers.split(",") if w.strip()]
    relay_counts = [int(r) for r in args.relays.split(",") if r.strip()]

    with bench_stack("bench-write") as (_stack, info):
        migrate.upgrade(info.database_url)
        engine = sa.create_engine(info.database_url)
        payload_size = prepare(engine)
        with engine.connect() as conn:
            settings = {
                name: conn.execute(sa.text(f"SHOW {name}")).scalar_one()
                for name in ("server_version", "fsync", "synchronous_commit", "shared_buffers")
            }
        started = time.monotonic()
        timings = measure(engine, args.n, payload_size)
        elapsed = time.monotonic() - started
        write_pgbench.prepare(engine, DEFAULT_SPEC)
        engine.dispose()
        database_side = write_pgbench.measure(
            info.database_url, writer_counts, seconds=args.seconds, rounds=args.rounds
        )
        python_side = {
            writers: measure_concurrent(
                info.database_url,
                writers,
                CONCURRENT_KINDS,
                payload_size,
                runners,
                seconds=args.seconds,
                rounds=args.rounds,
                first_id=10**12 * (number + 1),
            )
            for number, writers in enumerate(writer_counts)
        }
        beside_relays = write_relays.measure(
            info.database_url,
            info.bootstrap_servers,
            relay_counts,
            clients=write_relays.CLIENTS,
            seconds=args.relay_seconds,
        )

    stats = {}
    for kind in KINDS:
        values = sorted(timings[kind])
        stats[kind] = {"p50": percentile(values, 0.5), "p99": percentile(values, 0.99)}
    p50 = {kind: stats[kind]["p50"] for kind in KINDS}
    figures = {
        "n": args.n,
        "p50_us": {k: round(v, 1) for k, v in p50.items()},
        "p99_us": {k: round(stats[k]["p99"], 1) for k in KINDS},
        "p50_ratio_vs_plain_row": round(p50["outbox"] / p50["plain"], 3),
        "p50_ratio_vs_bare": round(p50["outbox"] / p50["bare"], 3),
        "p50_ratio_ten_bulk": round(p50["bulk10"] / p50["bare"], 3),
        "p50_ratio_ten_bulk_vs_one": round(p50["bulk10"] / p50["outbox"], 3),
        "pgbench_tps": {
            str(w): {table: round(f["tps"]) for table, f in by_table.items()}
            for w, by_table in database_side.items()
        },
        **{
            f"tps_ratio_vs_plain_row_{w}": round(
                by_table["outbox"]["tps"] / by_table["shape"]["tps"], 3
            )
            for w, by_table in database_side.items()
        },
        **{
            f"rule_tps_ratio_vs_plain_row_{w}": round(
                by_table["rule"]["tps"] / by_table["shape"]["tps"], 3
            )
            for w, by_table in database_side.items()
        },
        "python_tps": {
            str(w): {kind: round(tps) for kind, (tps, _) in by_kind.items()}
            for w, by_kind in python_side.items()
        },
        **{
            f"python_tps_ratio_vs_plain_row_{w}": round(
                by_kind["outbox"][0] / by_kind["plain"][0], 3
            )
            for w, by_kind in python_side.items()
        },
        **{
            f"python_tps_ratio_vs_shape_row_{w}": round(
                by_kind["outbox"][0] / by_kind["shape"][0], 3
            )
            for w, by_kind in python_side.items()
        },
        "beside_relays": {str(count): figures for count, figures in beside_relays.items()},
        "plain_row_payload_bytes": payload_size,
        "seconds": round(elapsed, 1),
    }
    print(f"write-path benchmark: {args.n} transactions of each kind, interleaved in rounds")
    print(
        f"machine: {machine()}; PostgreSQL {settings['server_version']} on 127.0.0.1, "
        f"fsync={settings['fsync']}, synchronous_commit={settings['synchronous_commit']}, "
        f"shared_buffers={settings['shared_buffers']}"
    )
    print(f"{'transaction':<34}{'p50 µs':>10}{'p99 µs':>10}{'p50 / bare':>12}")
    labels = {
        "bare": "a  insert order",
        "plain": "b  + one plain row (PK only)",
        "outbox": "c  + one outbox message",
        "bulk10": "d  + ten messages (publish_many)",
        "shape": "e  + the message's row, plain SQL",
    }
    for kind in KINDS:
        print(
            f"{labels[kind]:<34}{stats[kind]['p50']:>10.1f}{stats[kind]['p99']:>10.1f}"
            f"{p50[kind] / p50['bare']:>12.2f}"
        )
    print(
        f"outbox vs plain row (c/b, p50): {figures['p50_ratio_vs_plain_row']:.3f}   floor <= 1.15"
    )
    print_concurrent(database_side, python_side, labels)
    if beside_relays:
        write_relays.print_figures(beside_relays, write_relays.CLIENTS, args.relay_seconds)
    print(json.dumps(figures))
    if args.plot:
        for path in plots.write_plots(figures, args.plot):
            print(f"plot: {path}")
    return figures


def print_concurrent(
    database_side: dict[int, dict[str, dict[str, float]]],
    python_side: dict[int, dict[str, tuple[float, list[float]]]],
    labels: dict[str, str],
) -> None:
    print()
    print("pgbench: order row + one message row, transactions per second (latency avg ms)")
    print(f"{'writers':>8}{'no wake-up':>20}{'wake trigger':>20}{'NOTIFY rule':>20}")
    for writers, by_table in database_side.items():
        cells = "".join(
            f"{by_table[t]['tps']:>11.0f} ({by_table[t]['latency_ms']:>5.1f})"
            for t in write_pgbench.TABLES
        )
        print(f"{writers:>8}{cells}")
    for writers, by_table in database_side.items():
        trigger = by_table["outbox"]["tps"] / by_table["shape"]["tps"]
        rule = by_table["rule"]["tps"] / by_table["shape"]["tps"]
        floor = "   floor >= 0.9" if writers >= 16 else ""
        print(
            f"outbox / plain row tps, {writers} writers: {trigger:.3f}{floor}"
            f"   (former NOTIFY rule: {rule:.3f})"
        )
    print()
    print("Python API, concurrent writers: transactions per second, latency in µs")
    print(f"{'writers':>8}  {'transaction':<34}{'tps':>9}{'p50 µs':>10}{'p99 µs':>10}")
    for writers, by_kind in python_side.items():
        for kind in CONCURRENT_KINDS:
            tps, latencies = by_kind[kind]
            print(
                f"{writers:>8}  {labels[kind]:<34}{tps:>9.0f}"
                f"{percentile(latencies, 0.5):>10.0f}{percentile(latencies, 0.99):>10.0f}"
            )
    for writers, by_kind in python_side.items():
        ratio = by_kind["outbox"][0] / by_kind["plain"][0]
        same_shape = by_kind["outbox"][0] / by_kind["shape"][0]
        floor = "   floor >= 0.9" if writers >= 16 else ""
        print(
            f"Python outbox / plain row tps, {writers} writers: {ratio:.3f} (PK-only row), "
            f"{same_shape:.3f} (row of the same shape){floor}"
        )


if __name__ == "__main__":
    main()
