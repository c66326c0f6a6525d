"""End-to-end demo on the local stack (what `make demo` runs).

1. Starts a private PostgreSQL and an Apache Kafka broker (KRaft) on 127.0.0.1.
2. Creates the outbox table with the Alembic migrations, a business table and a topic, and
   starts `outbox dashboard` (read-only) on a free loopback port: its address is printed,
   open it to watch the messages go while the demo runs.
3. Runs business transactions that insert an order and publish an `OrderPlaced` message in
   the same transaction; every tenth one fails on purpose and rolls back.
4. Runs the relay (`outbox relay`, at-least-once) until every committed message is sent,
   then stops it with SIGTERM.
5. Runs the reconciliation job (`outbox reconcile`, Spark in local mode): the outbox table,
   read over JDBC, against the topic, read with Spark's Kafka source (read_committed). A clean
   run shows zero discrepancies of every class: nothing missing, duplicated, invented (a
   rolled-back transaction's message would be a phantom), altered, misrouted or late.
6. Runs a consuming service, billing, on a database of its own: `outbox consume
   examples.billing:inbox` turns each OrderPlaced message into a ledger entry through the
   inbox. It then reads the whole topic a second time (its group's offsets deleted, as if
   they were lost), and every message is skipped as already applied: the ledger matches the
   orders, entry for entry and cent for cent.
7. Stops the servers it started; the exit status is the reconciliation's, or 1 if the
   ledger does not match the orders.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import sqlalchemy as sa
from confluent_kafka.admin import AdminClient

from outbox import Outbox, migrate
from outbox.devstack import LocalStack
from outbox.devstack.stack import stack_home
from outbox.devstack.topics import create_topics
from outbox.inbox import install as install_inbox

TOPIC = "orders"
ROOT = Path(__file__).resolve().parents[1]
#: The billing service's table (its handler is examples/billing.py).
LEDGER_DDL = (
    "CREATE TABLE IF NOT EXISTS ledger (order_id bigint NOT NULL, customer text NOT NULL,"
    " amount_cents int NOT NULL, billed_at timestamptz NOT NULL DEFAULT now())"
)


class BusinessFailure(Exception):
    """Stands for a business rule that rejects an order after it was written."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--orders", type=int, default=500)
    parser.add_argument("--keep", action="store_true", help="leave the servers running")
    parser.add_argument(
        "--stack", default="demo", help="the local stack's name, as `outbox dev up --name`"
    )
    args = parser.parse_args(argv)

    started = time.monotonic()
    stack = LocalStack.named(args.stack)
    print("starting PostgreSQL + Kafka on 127.0.0.1 ...", flush=True)
    info = stack.up(database="demo")
    print(f"  database   {sa.make_url(info.database_url).render_as_string(hide_password=True)}")
    print(f"  kafka      {info.bootstrap_servers}   ({time.monotonic() - started:.1f}s)")
    dashboard: subprocess.Popen[str] | None = None
    try:
        stack.postgres.drop_database("billing")
        billing_url = stack.postgres.create_database("billing")
        migrate.upgrade(info.database_url)
        dashboard, address = start_dashboard(info.database_url, billing_url, info.bootstrap_servers)
        print(f"  dashboard  {address}   (read-only, while the demo runs)")
        output = stack_home() / f"{args.stack}-reconciliation"
        code = run(info.database_url, info.bootstrap_servers, args.orders, output)
        matches = consume(info.database_url, billing_url, info.bootstrap_servers)
        return code or (0 if matches else 1)
    finally:
        if dashboard is not None:
            dashboard.send_signal(signal.SIGTERM)
            dashboard.wait(30)
            if dashboard.stdout is not None:
                dashboard.stdout.close()
        if not args.keep:
            stack.down()
            print("servers stopped")


def start_dashboard(
    database_url: str, billing_url: str, bootstrap_servers: str
) -> tuple[subprocess.Popen[str], str]:
    """`outbox dashboard` on a free loopback port, read-only (no token), showing the shop's
    outbox and billing's inbox; returns the process and the address it printed."""
    env = {
        **os.environ,
        "OUTBOX_DATABASE_URL": database_url,
        "OUTBOX_INBOX_DATABASE_URL": billing_url,
        "OUTBOX_KAFKA_BOOTSTRAP_SERVERS": bootstrap_servers,
        "OUTBOX_DASHBOARD_REFRESH": "2",
        "OUTBOX_DASHBOARD_SCAN_INTERVAL": "2",
        "OUTBOX_LOG_LEVEL": "WARNING",
    }
    env.pop("OUTBOX_DASHBOARD_TOKEN", None)
    command = [sys.executable, "-m", "outbox.cli", "dashboard", "--port", "0"]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    line = process.stdout.readline()
    found = re.search(r"http://\S+", line)
    if found is None:
        process.kill()
        raise RuntimeError(f"the dashboard did not start: {line!r}")
    return process, found.group(0)


def run_relay(database_url: str, bootstrap_servers: str, engine: sa.Engine, expect: int) -> float:
    """Start `outbox relay`, wait until ``expect`` rows are sent, SIGTERM it."""
    env = {
        **os.environ,
        "OUTBOX_DATABASE_URL": database_url,
        "OUTBOX_KAFKA_BOOTSTRAP_SERVERS": bootstrap_servers,
        "OUTBOX_LOG_LEVEL": "WARNING",
    }
    started = time.monotonic()
    relay = subprocess.Popen([sys.executable, "-m", "outbox.cli", "relay"], env=env)
    try:
        while time.monotonic() - started < 120:
            with engine.connect() as conn:
                query = sa.text("SELECT count(*) FROM outbox WHERE status = 'sent'")
                if conn.execute(query).scalar_one() >= expect:
                    break
            if relay.poll() is not None:
                raise RuntimeError("the relay stopped early")
            time.sleep(0.2)
        seconds = time.monotonic() - started
    finally:
        relay.send_signal(signal.SIGTERM)
        code = relay.wait(60)
    if code != 0:
        raise RuntimeError(f"the relay exited with {code}")
    return seconds


def run(database_url: str, bootstrap_servers: str, orders: int, output: Path) -> int:
    migrate.upgrade(database_url)
    engine = sa.create_engine(database_url)
    with engine.begin() as conn:
        conn.execute(sa.text("DROP TABLE IF EXISTS orders"))
        conn.execute(sa.text("TRUNCATE outbox"))
        conn.execute(
            sa.text("CREATE TABLE orders (id bigint PRIMARY KEY, customer text, total_cents int)")
        )
    create_topics(bootstrap_servers, [TOPIC], partitions=3)  # kept when it exists

    ob = Outbox(engine)
    committed: list[uuid.UUID] = []
    rolled_back: list[uuid.UUID] = []
    write_started = time.monotonic()
    # Messages made from here on are this run's (earlier runs' records stay on the topic).
    window_start = datetime.now(UTC) - timedelta(seconds=1)
    for order_id in range(1, orders + 1):
        message_id = None
        try:
            with ob.transaction() as tx:
                customer = f"customer-{order_id % 37}"
                tx.session.execute(
                    sa.text("INSERT INTO orders VALUES (:id, :customer, :total)"),
                    {"id": order_id, "customer": customer, "total": 1000 + order_id},
                )
                message_id = tx.publish(
                    TOPIC,
                    {
                        "type": "OrderPlaced",
                        "order_id": order_id,
                        "customer": customer,
                        "total_cents": 1000 + order_id,
                    },
                    key=customer,
                ).message_id
                if order_id % 10 == 0:
                    raise BusinessFailure(order_id)
            committed.append(message_id)
        except BusinessFailure:
            rolled_back.append(message_id)  # type: ignore[arg-type]
    write_seconds = time.monotonic() - write_started

    relay_seconds = run_relay(database_url, bootstrap_servers, engine, len(committed))
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT status, count(*) FROM outbox GROUP BY status"))
        status: dict[str, int] = {name: count for name, count in rows}
        order_rows = conn.execute(sa.text("SELECT count(*) FROM orders")).scalar_one()
    engine.dispose()

    print()
    print("written and relayed")
    print(
        f"  business transactions  {orders} ({len(committed)} committed, "
        f"{len(rolled_back)} rolled back on purpose) in {write_seconds:.1f}s"
    )
    print(f"  order rows             {order_rows}")
    print(f"  outbox rows            {status}")
    print(f"  relay                  sent them in {relay_seconds:.1f}s, stopped cleanly")
    print()
    print("reconciliation (Spark: the outbox over JDBC against the topic, read_committed)")
    return reconcile(database_url, bootstrap_servers, window_start, output)


def run_consumer(billing_url: str, bootstrap_servers: str, until: Callable[[str], bool]) -> str:
    """`outbox consume examples.billing:inbox` until ``until(its metrics)``; SIGTERM it."""
    from outbox.devstack.procs import free_port

    port = free_port()
    env = {
        **os.environ,
        "OUTBOX_DATABASE_URL": billing_url,
        "OUTBOX_KAFKA_BOOTSTRAP_SERVERS": bootstrap_servers,
        "OUTBOX_LOG_LEVEL": "WARNING",
    }
    command = [sys.executable, "-m", "outbox.cli", "consume", "examples.billing:inbox"]
    consumer = subprocess.Popen([*command, "--metrics-port", str(port)], env=env, cwd=ROOT)
    metrics = ""
    try:
        deadline = time.monotonic() + 120
        while not until(metrics):
            if consumer.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the consumer stopped early or did not finish")
            time.sleep(0.2)
            try:
                url = f"http://127.0.0.1:{port}/metrics"
                metrics = urllib.request.urlopen(url, timeout=5).read().decode()
            except OSError:
                pass  # not listening yet
    finally:
        consumer.send_signal(signal.SIGTERM)
        code = consumer.wait(60)
    if code != 0:
        raise RuntimeError(f"the consumer exited with {code}")
    return metrics


def counter(metrics: str, name: str) -> int:
    return int(
        sum(
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith(name + "{")
        )
    )


def consume(database_url: str, billing_url: str, bootstrap_servers: str) -> bool:
    """Billing applies every order once, twice over; True when the ledger matches."""
    install_inbox(billing_url)
    billing = sa.create_engine(billing_url)
    with billing.begin() as conn:
        conn.execute(sa.text(LEDGER_DDL))
    shop = sa.create_engine(database_url)
    with shop.connect() as conn:
        orders, cents = conn.execute(sa.text("SELECT count(*), sum(total_cents) FROM orders")).one()
    shop.dispose()

    print()
    print("consuming (billing: `outbox consume examples.billing:inbox`, its own database)")
    first = run_consumer(
        billing_url,
        bootstrap_servers,
        lambda m: counter(m, "outbox_inbox_processed_total") >= orders,
    )
    # As if the group's offsets were lost: the next consumer reads the topic from the start.
    admin = AdminClient({"bootstrap.servers": bootstrap_servers})
    for future in admin.delete_consumer_groups(["billing"], request_timeout=30).values():
        future.result(30)
    second = run_consumer(
        billing_url,
        bootstrap_servers,
        lambda m: counter(m, "outbox_inbox_duplicates_total") >= orders,
    )
    with billing.connect() as conn:
        entries, billed_cents, distinct = conn.execute(
            sa.text("SELECT count(*), sum(amount_cents), count(DISTINCT order_id) FROM ledger")
        ).one()
    billing.dispose()
    matches: bool = entries == distinct == orders and billed_cents == cents
    print(
        f"  first run              applied {counter(first, 'outbox_inbox_processed_total')}, "
        f"skipped {counter(first, 'outbox_inbox_duplicates_total')} duplicates"
    )
    print(
        f"  topic read again       applied {counter(second, 'outbox_inbox_processed_total')}, "
        f"skipped {counter(second, 'outbox_inbox_duplicates_total')} duplicates"
    )
    print(f"  orders                 {orders} rows, {cents} cents")
    print(f"  ledger                 {entries} entries for {distinct} orders, {billed_cents} cents")
    print(f"  ledger matches orders  {'yes' if matches else 'NO'}")
    return matches


def reconcile(database_url: str, bootstrap_servers: str, start: datetime, output: Path) -> int:
    """`outbox reconcile` over the messages this run made; its report ends the demo."""
    end = datetime.now(UTC) + timedelta(minutes=1)
    command = [
        sys.executable, "-m", "outbox.cli", "reconcile",
        "--database-url", database_url, "--bootstrap-servers", bootstrap_servers,
        "--start", start.isoformat(), "--end", end.isoformat(), "--grace", "1m",
        "--output", str(output),
        "--master", "local[2]", "--driver-memory", "1g", "--jdbc-slices", "2",
    ]  # fmt: skip
    return subprocess.run(command, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
