"""What the promotions forgot: each killed primary read back, against the last primary.

A primary killed by a failover is started once more after the run, on its own (it replays
its WAL, as after a crash, and so holds every commit it acknowledged), and read: its outbox
rows with their sends, and the consuming service's applications. What it held that the last
primary does not is what a promotion forgot, exactly:

- **forgotten rows**: outbox rows committed on the old primary that no later primary has
  (asynchronous replication loses the lag; synchronous, only commits nobody saw confirmed);
- **forgotten sends**: rows the old primary had marked sent at one offset that the last
  primary holds sent at another: the mark was forgotten and the message went again;
- **forgotten applications**: messages the consuming service had applied whose application
  the last primary does not hold;
- **made pending again**: of the forgotten sends, the rows whose ``seq`` differs: a due
  scheduled message the relay had made pending (a new ``seq``) and sent, whose making
  pending was forgotten too; made pending again later, its ``seq`` now follows messages its
  first copy preceded on the topic, and the order audit cannot judge it by ``seq``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

from outbox.devstack.postgres import PostgresServer
from outbox.devstack.procs import free_port

SENDS = "SELECT id, kafka_partition, kafka_offset, seq FROM outbox WHERE status = 'sent'"
ROWS = "SELECT id FROM outbox"
APPLIED = "SELECT DISTINCT message_id FROM chaos_applied"


@dataclass
class Holdings:
    """What one database held: outbox rows, where each sent one went, applications."""

    rows: set[uuid.UUID] = field(default_factory=set)
    sends: dict[uuid.UUID, tuple[int, int]] = field(default_factory=dict)
    applied: set[uuid.UUID] = field(default_factory=set)
    #: The seq of each sent row.
    seqs: dict[uuid.UUID, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Forgotten:
    rows: frozenset[uuid.UUID] = frozenset()
    sends: frozenset[uuid.UUID] = frozenset()
    applications: frozenset[uuid.UUID] = frozenset()
    made_pending_again: frozenset[uuid.UUID] = frozenset()


def compare(old: Iterable[Holdings], last: Holdings) -> Forgotten:
    """What the old primaries held that the last one does not (pure, for the unit tests)."""
    rows: set[uuid.UUID] = set()
    sends: set[uuid.UUID] = set()
    applications: set[uuid.UUID] = set()
    again: set[uuid.UUID] = set()
    for held in old:
        rows |= held.rows - last.rows
        applications |= held.applied - last.applied
        for message_id, place in held.sends.items():
            now = last.sends.get(message_id)
            if now is not None and now != place:
                sends.add(message_id)
                if held.seqs.get(message_id) != last.seqs.get(
                    message_id, held.seqs.get(message_id)
                ):
                    again.add(message_id)
    return Forgotten(frozenset(rows), frozenset(sends), frozenset(applications), frozenset(again))


def read(conninfo: str, database: str, service_database: str | None) -> Holdings:
    """What ``database`` (and the service's, when given) on the server at ``conninfo``
    holds."""
    held = Holdings()
    with psycopg.connect(f"{conninfo} dbname={database}", autocommit=True) as conn:
        held.rows = {row[0] for row in conn.execute(ROWS)}
        for row in conn.execute(SENDS):
            held.sends[row[0]] = (row[1], row[2])
            held.seqs[row[0]] = row[3]
    if service_database is not None:
        with psycopg.connect(f"{conninfo} dbname={service_database}", autocommit=True) as conn:
            held.applied = {row[0] for row in conn.execute(APPLIED)}
    return held


def read_old_primary(
    folder: Path, password: str, database: str, service_database: str | None
) -> Holdings:
    """Start the killed primary kept in ``folder`` alone, on a free port, read it, stop it."""
    server = PostgresServer(root=folder, port=free_port(), password=password)
    # Its settings still ask for a synchronous standby: reads need none.
    server.start()
    try:
        conninfo = f"host=127.0.0.1 port={server.port} user=postgres password={password}"
        return read(conninfo, database, service_database)
    finally:
        server.stop(mode="immediate")
