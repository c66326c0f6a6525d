"""``outbox partitions list|maintain``: retention on the partitioned layout
(docs/retention.md), registered on the ``outbox`` command line by ``outbox.cli``."""

from __future__ import annotations

from datetime import UTC, datetime

import click
import sqlalchemy as sa

from outbox.cli_options import DATABASE_URL, SCHEMA, TABLE, run_db_step, table_spec


@click.group()
def partitions() -> None:
    """The partitioned layout: list partitions, create coming ones, drop old ones."""


@partitions.command("list")
@DATABASE_URL
@SCHEMA
@TABLE
def list_command(database_url: str, schema: str, table: str) -> None:
    """List the partitions, oldest first, with their rows by status (estimated sizes)."""
    from outbox.partition_layout import Names, is_partitioned, list_partitions

    spec = table_spec(schema, table)
    engine = sa.create_engine(database_url)

    def read() -> list[tuple[str, str, str, int]]:
        with engine.connect() as conn:
            if not is_partitioned(conn, spec):
                raise click.ClickException(f"{spec.qualified_name} is not partitioned")
            rows = []
            for partition in list_partitions(conn, spec):
                name = Names(spec).qualified(partition.name)
                counts = conn.execute(
                    sa.text(f"SELECT status, count(*) FROM {name} GROUP BY status ORDER BY 1")
                ).all()
                size = conn.execute(sa.text(f"SELECT pg_table_size('{name}')")).scalar_one()
                span = f"{partition.start:%Y-%m-%d %H:%M}" if partition.start else "default"
                what = ", ".join(f"{status} {count}" for status, count in counts) or "empty"
                rows.append((partition.name, span, what, int(size)))
            return rows

    try:
        rows = run_db_step(read)
    finally:
        engine.dispose()
    for name, span, what, size in rows:
        click.echo(f"{name:<40} {span:<17} {size / 2**20:>9.1f} MB  {what}")


@partitions.command("maintain")
@DATABASE_URL
@SCHEMA
@TABLE
@click.option(
    "--older-than",
    required=True,
    help="Drop partitions that ended this long ago (90s, 15m, 12h, 7d, 1w).",
)
@click.option(
    "--ahead",
    type=click.IntRange(min=0),
    help="Partitions to have after the current one  [default: 7 daily, 48 hourly]",
)
@click.option(
    "--carry",
    is_flag=True,
    help="Move the rows not done yet (pending, dead, prepared) out of an old partition "
    "into the default one, so that it can go; without it, such a partition is kept.",
)
@click.option(
    "--detach", is_flag=True, help="Detach old partitions (to archive) instead of dropping them."
)
@click.option("--dry-run", is_flag=True, help="Say what would be done; change nothing.")
@click.option(
    "--ignore-audit-window",
    is_flag=True,
    help="Drop even partitions the nightly reconciliation may still read.",
)
def maintain_command(
    database_url: str,
    schema: str,
    table: str,
    older_than: str,
    ahead: int | None,
    carry: bool,
    detach: bool,
    dry_run: bool,
    ignore_audit_window: bool,
) -> None:
    """Create the coming partitions and drop the old ones that hold only sent rows.

    Run it from a scheduler (hourly for hourly partitions, daily for daily ones). A partition
    that still holds a pending, dead or prepared row is kept (reported), or with --carry its
    rows move to the default partition in the transaction that drops it. Refuses a cut-off
    the nightly reconciliation may still read unless --ignore-audit-window is given.
    """
    from outbox.durations import parse_duration
    from outbox.partition_retention import maintain
    from outbox.retention import audit_refusal

    try:
        age = parse_duration(older_than)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--older-than") from exc
    now = datetime.now(UTC)
    too_recent = audit_refusal(now, now - age)
    if too_recent and not (dry_run or ignore_audit_window):
        raise click.ClickException(too_recent)
    spec = table_spec(schema, table)
    engine = sa.create_engine(database_url)
    try:
        report = run_db_step(
            lambda: maintain(
                engine,
                age,
                spec=spec,
                ahead=ahead,
                carry=carry,
                detach=detach,
                dry_run=dry_run,
                now=now,
            )
        )
    finally:
        engine.dispose()
    prefix = "would have " if dry_run else ""
    for label, names in (
        ("created", report.created),
        ("dropped", report.dropped),
        ("detached", report.detached),
    ):
        for name in names:
            click.echo(f"{prefix}{label} {name}")
    for name, rows in report.carried.items():
        click.echo(f"{prefix}carried {rows} rows not done out of {name} into the default partition")
    for name, why in report.kept.items():
        click.echo(f"kept {name}: {why}")
    if report.purged:
        click.echo(f"deleted {report.purged} carried rows that are done now")
    if dry_run:
        click.echo("dry run, nothing changed")
