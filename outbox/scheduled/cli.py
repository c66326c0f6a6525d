"""``outbox scheduled ...``: the operator's view of scheduled messages (list, show, cancel),
registered on the ``outbox`` command line by ``outbox.cli``."""

from __future__ import annotations

import sys
from typing import Any

import click

from outbox.cli import dead_show
from outbox.cli_options import DATABASE_URL, SCHEMA, TABLE, database_engine, run_db_step, table_spec


@click.group()
def scheduled() -> None:
    """List scheduled messages; cancel those not yet due."""


def _store(schema: str, table: str) -> Any:
    from outbox.scheduled.store import ScheduledStore

    return ScheduledStore(table_spec(schema, table))


@scheduled.command("list")
@DATABASE_URL
@SCHEMA
@TABLE
@click.option("--topic", default=None)
@click.option("--limit", default=50, show_default=True)
def scheduled_list(
    database_url: str, schema: str, table: str, topic: str | None, limit: int
) -> None:
    """List scheduled messages, the soonest due first (a negative "due in": overdue, no relay
    made it pending yet)."""
    store = _store(schema, table)

    def run(engine: Any) -> None:
        with engine.connect() as conn:
            rows = store.waiting(conn, topic=topic, limit=limit)
        for row in rows:
            key = row["key"].decode(errors="replace") if row["key"] is not None else "-"
            click.echo(
                f"{row['id']}  {row['topic']}  key={key}  "
                f"due={row['deliver_at'].isoformat(timespec='seconds')}  "
                f"in={float(row['due_in']):.0f}s  "
                f"published={row['created_at'].isoformat(timespec='seconds')}"
            )
        click.echo(f"{len(rows)} scheduled message(s)")

    with database_engine(database_url) as engine:
        run_db_step(lambda: run(engine))


scheduled.add_command(dead_show, "show")


@scheduled.command("cancel")
@DATABASE_URL
@SCHEMA
@TABLE
@click.argument("message_ids", nargs=-1, required=True, type=click.UUID)
def scheduled_cancel(
    database_url: str, schema: str, table: str, message_ids: tuple[Any, ...]
) -> None:
    """Cancel scheduled messages not yet due: they are never sent. Exits 1 when it cancelled
    none of them, or not every id given (one already due may be on its topic)."""
    from outbox.scheduled.store import OPERATOR

    store = _store(schema, table)

    def run(engine: Any) -> tuple[set[Any], dict[Any, str]]:
        with engine.begin() as conn:
            cancelled = store.cancel(conn, message_ids, OPERATOR)
            rest = [mid for mid in message_ids if mid not in cancelled]
            return cancelled, store.statuses(conn, rest)

    with database_engine(database_url) as engine:
        cancelled, others = run_db_step(lambda: run(engine))
    click.echo(f"cancelled {len(cancelled)} scheduled message(s)")
    missed = [mid for mid in dict.fromkeys(message_ids) if mid not in cancelled]
    for mid in missed:
        where = others.get(mid)
        click.echo(f"{mid}: not scheduled ({where or 'no such message'})", err=True)
    if missed:
        sys.exit(1)  # a script must see that nothing (or not all it named) was cancelled
