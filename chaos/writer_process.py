"""A chaos writer as a process of its own, so that a fault can kill it with -9 mid-transaction.

It runs the writers' loop (:class:`outbox.chaos.writers.Writer`) with a journal, pausing
inside each transaction so that a kill often lands there; PostgreSQL then rolls the
transaction back, and the audit checks that none of it reached a topic. With
``--immediate`` it publishes through an outbox with an immediate sender, which sends its
messages right after commit: a kill then also leaves rows leased to a dead sender, which the
relays must send once the lease runs out, in order with the rest of their key.

Serves ``/metrics`` on ``--metrics-port`` (the fleet's sign that it has started); SIGTERM
finishes the transaction in hand, closes the sender and exits 0.

Run: python -m outbox.chaos.writer_process --index 0 --name p0.1 --rate 50 --seed 1
     --journal writer-0.jsonl --metrics-port 9000 [--immediate]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import uuid
from pathlib import Path
from types import FrameType
from typing import Any

import sqlalchemy as sa
from prometheus_client import start_http_server

from outbox import ImmediateSender, Outbox
from outbox.chaos.writers import TOPICS, Writer
from outbox.immediate import SendOutcome

#: The longest pause inside a transaction, in seconds (drawn per transaction).
HOLD_OPEN = 0.05
#: The immediate sender's lease: the relays send a killed writer's rows this long after it.
LEASE_SECONDS = 12.0


class CountingSender(ImmediateSender):
    """An immediate sender that writes down the ids of the messages it sent itself, one a
    line in ``counts``, so that the run can show immediate send at work (and tell its records
    from the relays')."""

    def __init__(self, counts: Path, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.counts = counts

    def send_now(self, ids: list[uuid.UUID]) -> SendOutcome:
        outcome = super().send_now(ids)
        if outcome.sent:
            with self.counts.open("a", encoding="utf-8") as counts:
                counts.write("".join(f"{message_id}\n" for message_id in outcome.sent))
        return outcome


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--name", required=True, help="names the keys: one per process life")
    parser.add_argument("--rate", type=float, required=True, help="messages per second")
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--journal", required=True)
    parser.add_argument("--metrics-port", type=int, required=True)
    parser.add_argument("--immediate", action="store_true", help="send after commit")
    args = parser.parse_args(argv)
    database_url = os.environ["OUTBOX_DATABASE_URL"]
    start_http_server(args.metrics_port, addr="127.0.0.1")
    engine = sa.create_engine(database_url, pool_pre_ping=True, pool_size=1)
    sender = None
    if args.immediate:
        bootstrap = os.environ["OUTBOX_KAFKA_BOOTSTRAP_SERVERS"]
        sender = CountingSender(
            Path(args.journal).with_suffix(".sent"),
            engine,
            {"bootstrap.servers": bootstrap},
            lease_seconds=LEASE_SECONDS,
        )
    with open(args.journal, "a", encoding="utf-8") as journal:
        writer = Writer(
            args.index,
            database_url,
            list(TOPICS),
            args.seed,
            args.rate,
            name=args.name,
            outbox=Outbox(engine, immediate=sender),
            journal=journal,
            hold_open=HOLD_OPEN,
        )

        def stop(_signum: int, _frame: FrameType | None) -> None:
            writer.stop()

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        writer.run()  # in this thread: returns once stopped
    if sender is not None:
        sender.close()
    if writer.failure is not None:
        print(f"writer failed: {writer.failure!r}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
