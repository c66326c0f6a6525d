"""What the partitioned layout costs a writer: messages a second into the plain and the
partitioned table, with and without idempotency keys (which the partitioned layout keeps
unique through a side table and row triggers), one writer, ``--per-txn`` messages a
transaction. Each case runs ``--rounds`` times in turn; the best round counts.

Run: python -m bench.partition_writes   (a PostgreSQL of its own)
"""

from __future__ import annotations

import argparse
import secrets
import shutil
import tempfile
import time
from pathlib import Path

import sqlalchemy as sa

from bench.stack import machine
from outbox import Message, Outbox, migrate
from outbox.devstack.postgres import PostgresServer
from outbox.devstack.procs import free_port


def write(engine: sa.Engine, messages: int, per_txn: int, keyed: bool, round_: int) -> float:
    outbox = Outbox(engine)
    started = time.perf_counter()
    for first in range(0, messages, per_txn):
        with outbox.transaction() as tx:
            tx.publish_many(
                [
                    Message(
                        "orders",
                        {"n": n},
                        key=f"k{n % 97}",
                        idempotency_key=f"r{round_}-{n}" if keyed else None,
                    )
                    for n in range(first, first + per_txn)
                ]
            )
    return messages / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--per-txn", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="bench-writes-"))
    root.chmod(0o777)  # the server may run as the postgres user
    postgres = PostgresServer(root, free_port(), secrets.token_urlsafe(12), durable=True)
    try:
        postgres.start()
        engines = {}
        for layout in ("plain", "partitioned"):
            url = postgres.create_database(layout)
            migrate.upgrade(url, partitioned="daily" if layout == "partitioned" else None)
            engines[layout] = sa.create_engine(url)
        print(
            f"writes: {args.messages:,} messages, {args.per_txn} a transaction, one writer, "
            f"best of {args.rounds}; {machine()}"
        )
        best: dict[tuple[str, bool], float] = {}
        for round_ in range(args.rounds):
            for keyed in (False, True):
                for layout, engine in engines.items():
                    rate = write(engine, args.messages, args.per_txn, keyed, round_)
                    best[layout, keyed] = max(best.get((layout, keyed), 0.0), rate)
        for keyed in (False, True):
            plain, parted = best["plain", keyed], best["partitioned", keyed]
            print(
                f"  {'with' if keyed else 'without'} idempotency keys: plain {plain:,.0f}/s, "
                f"partitioned {parted:,.0f}/s, ratio {parted / plain:.2f}"
            )
        for engine in engines.values():
            engine.dispose()
    finally:
        postgres.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
