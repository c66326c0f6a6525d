"""Writers beside running relays: what the relays' shape costs a commit.

With 1, 2, 5 and 17 ``outbox relay`` processes running and relaying to Kafka (16 shards: 5
relays leave one without a shard, 17 leave one), pgbench writers insert an order row and one
message row, in turns with the same transaction into a table of the outbox's shape with no
trigger and no relay (the reference). A listener on the outbox channel counts the NOTIFYs
writers send (payload empty; the relays' own carry one) per commit. The floor: at most 1% of
commits notify while relays are busy, in every case.

Run: python -m bench.write_relays --relays 1,2,5,17 --seconds 10   (make bench-write runs it)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psycopg
import sqlalchemy as sa

from bench import write_pgbench
from bench.stack import bench_stack, machine
from outbox import migrate
from outbox.devstack.topics import create_topics
from outbox.schema import DEFAULT_SPEC, SHARD_COUNT

#: Most writer NOTIFYs per commit with relays busy.
NOTIFY_FLOOR = 0.01
#: pgbench writers.
CLIENTS = 16
TOPIC = "orders"  # the pgbench script's topic


class NotifyCounter:
    """Counts the NOTIFYs on the outbox channel, writers' and relays' apart, while on."""

    def __init__(self, conninfo: str) -> None:
        self.conn = psycopg.connect(conninfo, autocommit=True)
        self.conn.execute(f'LISTEN "{DEFAULT_SPEC.notify_channel}"')
        self.counting = threading.Event()
        self.stopped = threading.Event()
        self.writers = 0
        self.relays = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.is_set():
            for notice in self.conn.notifies(timeout=0.2):
                if not self.counting.is_set():
                    continue
                if notice.payload == "":
                    self.writers += 1
                else:
                    self.relays += 1

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(5)
        self.conn.close()


def holders(conninfo: str) -> tuple[int, ...]:
    with psycopg.connect(conninfo) as conn:
        rows = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted "
            "AND objsubid = 2 AND classid = %s::bigint::oid GROUP BY pid ORDER BY 1 DESC",
            (DEFAULT_SPEC.lock_space("shard"),),
        ).fetchall()
    return tuple(int(row[0]) for row in rows)


def wait_until_settled(conninfo: str, count: int) -> float:
    """Every shard held, in shares of at most ceil(16 / count), unchanged for 2 s."""
    started = time.monotonic()
    share = -(-SHARD_COUNT // count)
    last: tuple[int, ...] = ()
    stable_since = started
    while True:
        now = time.monotonic()
        held = holders(conninfo)
        if held != last:
            last, stable_since = held, now
        if sum(held) == SHARD_COUNT and held[0] <= share and now - stable_since >= 2.0:
            return now - started
        if now - started > 180:
            raise TimeoutError(f"{count} relays did not settle on the shards: {held}")
        time.sleep(0.2)


def pgbench(url: sa.URL, script: Path, clients: int, seconds: int) -> int:
    """Run pgbench; the transactions it committed."""
    binary = write_pgbench.pgbench_path()
    if binary is None:
        raise RuntimeError("pgbench not found (Debian's postgresql package ships it)")
    command = [
        binary,
        "-n",
        "-M",
        "prepared",
        "-c",
        str(clients),
        "-j",
        str(min(clients, 2)),
        "-T",
        str(seconds),
        "-f",
        str(script),
        "-h",
        url.host or "127.0.0.1",
        "-p",
        str(url.port or 5432),
        "-U",
        url.username or "postgres",
        url.database or "postgres",
    ]
    env = {**os.environ, "PGPASSWORD": url.password or ""}
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    found = re.search(r"number of transactions actually processed: (\d+)", done.stdout)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"pgbench failed: {(done.stderr or done.stdout).strip()[-500:]}")
    return int(found.group(1))


def measure(
    database_url: str, bootstrap: str, relay_counts: list[int], *, clients: int, seconds: int
) -> dict[int, dict[str, float]]:
    """Per relay count: commits and tps into the outbox table and the reference table, and
    the writers' NOTIFYs."""
    url = sa.make_url(database_url)
    conninfo = url.set(drivername="postgresql").render_as_string(hide_password=False)
    create_topics(bootstrap, [TOPIC], partitions=SHARD_COUNT)
    env = {
        **os.environ,
        "OUTBOX_DATABASE_URL": database_url,
        "OUTBOX_KAFKA_BOOTSTRAP_SERVERS": bootstrap,
        "OUTBOX_LOG_LEVEL": "WARNING",
    }
    value = os.urandom(190).hex()
    results: dict[int, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        scripts = {}
        for table in ("outbox", "outbox_shape"):
            scripts[table] = Path(scratch, f"{table}.sql")
            scripts[table].write_text(write_pgbench._SCRIPT.format(table=table, value=value))
        log = Path(scratch, "relays.log")
        for count in relay_counts:
            with psycopg.connect(conninfo, autocommit=True) as conn:
                conn.execute("TRUNCATE outbox, outbox_shape")
            with log.open("ab") as out:
                relays = [
                    subprocess.Popen(
                        [sys.executable, "-m", "outbox.cli", "relay"],
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                    )
                    for _ in range(count)
                ]
            counter = NotifyCounter(conninfo)
            try:
                settling = wait_until_settled(conninfo, count)
                reference = pgbench(url, scripts["outbox_shape"], clients, seconds)
                time.sleep(1.0)  # the relays have been idle: they sleep
                counter.counting.set()
                commits = pgbench(url, scripts["outbox"], clients, seconds)
                counter.counting.clear()
                with psycopg.connect(conninfo) as conn:
                    row = conn.execute(
                        "SELECT count(*) FILTER (WHERE status = 'pending') FROM outbox"
                    ).fetchone()
                pending = int(row[0]) if row else 0
            finally:
                counter.close()
                for relay in relays:
                    relay.send_signal(signal.SIGTERM)
                for relay in relays:
                    try:
                        relay.wait(60)
                    except subprocess.TimeoutExpired:
                        relay.kill()
                        relay.wait()
            results[count] = {
                "settled_s": round(settling, 1),
                "commits": commits,
                "tps": commits / seconds,
                "reference_tps": reference / seconds,
                "writer_notifies": counter.writers,
                "relay_notifies": counter.relays,
                "notify_share": counter.writers / max(1, commits),
                "pending_at_end": pending,
            }
            print(
                f"  {count:>2} relays: {commits / seconds:>8.0f} tps ({reference / seconds:.0f} "
                f"reference), {counter.writers} writer NOTIFYs for {commits} commits "
                f"({100 * counter.writers / max(1, commits):.2f}%)",
                flush=True,
            )
    return results


def print_figures(results: dict[int, dict[str, float]], clients: int, seconds: int) -> None:
    print()
    print(
        f"writers beside running relays: {clients} pgbench writers, {seconds} s per case, "
        "order row + one message row; reference: a table of the outbox's shape, no relay"
    )
    print(
        f"{'relays':>7}{'tps':>9}{'reference':>11}{'ratio':>7}{'NOTIFYs':>9}{'commits':>9}"
        f"{'share':>8}{'pending':>9}"
    )
    for count, r in results.items():
        print(
            f"{count:>7}{r['tps']:>9.0f}{r['reference_tps']:>11.0f}"
            f"{r['tps'] / r['reference_tps']:>7.2f}{r['writer_notifies']:>9.0f}"
            f"{r['commits']:>9.0f}{100 * r['notify_share']:>7.2f}%{r['pending_at_end']:>9.0f}"
        )
    worst = max(r["notify_share"] for r in results.values())
    verdict = "ok" if worst <= NOTIFY_FLOOR else "ABOVE THE FLOOR"
    print(f"writer NOTIFYs per commit, worst case: {100 * worst:.2f}%   floor <= 1%: {verdict}")


def main(argv: list[str] | None = None) -> dict[int, dict[str, float]]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--relays", default="1,2,5,17", help="relay counts, comma-separated")
    parser.add_argument("--clients", type=int, default=CLIENTS, help="pgbench writers")
    parser.add_argument("--seconds", type=int, default=10, help="seconds per pgbench run")
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.relays.split(",") if c.strip()]
    with bench_stack("bench-write-relays") as (_stack, info):
        migrate.upgrade(info.database_url)
        engine = sa.create_engine(info.database_url)
        with engine.begin() as conn:  # (bench.write_path makes it with its other tables)
            conn.execute(
                sa.text(
                    "CREATE TABLE IF NOT EXISTS orders "
                    "(id bigint PRIMARY KEY, customer text, total int)"
                )
            )
        write_pgbench.prepare(engine, DEFAULT_SPEC)
        engine.dispose()
        print(f"machine: {machine()}")
        results = measure(
            info.database_url,
            info.bootstrap_servers,
            counts,
            clients=args.clients,
            seconds=args.seconds,
        )
    print_figures(results, args.clients, args.seconds)
    print(json.dumps({str(k): v for k, v in results.items()}))
    return results


if __name__ == "__main__":
    main()
