"""The ``outbox`` command line."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TypeVar

import click

from outbox.errors import OutboxError
from outbox.schema import OutboxTableSpec

T = TypeVar("T")


@click.group()
@click.version_option(package_name="outbox-kafka")
def main() -> None:
    """Transactional outbox for PostgreSQL and Kafka."""


DATABASE_URL = click.option(
    "--database-url",
    envvar="OUTBOX_DATABASE_URL",
    required=True,
    help="SQLAlchemy URL, e.g. postgresql+psycopg://user:pw@host/db [env: OUTBOX_DATABASE_URL]",
)
SCHEMA = click.option(
    "--schema",
    envvar="OUTBOX_SCHEMA",
    default="public",
    show_default=True,
    help="Schema of the outbox table [env: OUTBOX_SCHEMA]",
)
TABLE = click.option(
    "--table",
    envvar="OUTBOX_TABLE",
    default="outbox",
    show_default=True,
    help="Name of the outbox table [env: OUTBOX_TABLE]",
)


def _spec(schema: str, table: str) -> OutboxTableSpec:
    try:
        return OutboxTableSpec(schema=schema, table=table)
    except OutboxError as exc:
        raise click.BadParameter(str(exc)) from exc


@main.group()
def db() -> None:
    """Create and upgrade the outbox table (the outbox's own Alembic history)."""


@db.command("upgrade")
@DATABASE_URL
@SCHEMA
@TABLE
@click.option("--revision", default="head", show_default=True)
@click.option("--sql", is_flag=True, help="Print the SQL instead of running it.")
def db_upgrade(database_url: str, schema: str, table: str, revision: str, sql: bool) -> None:
    """Create the outbox table or bring it up to date."""
    from outbox import migrate

    _run_db_step(lambda: migrate.upgrade(database_url, _spec(schema, table), revision, sql=sql))


@db.command("downgrade")
@DATABASE_URL
@SCHEMA
@TABLE
@click.option("--revision", default="base", show_default=True, help="'base' drops the table.")
@click.option("--sql", is_flag=True, help="Print the SQL instead of running it.")
def db_downgrade(database_url: str, schema: str, table: str, revision: str, sql: bool) -> None:
    """Step the outbox table back to an earlier revision."""
    from outbox import migrate

    _run_db_step(lambda: migrate.downgrade(database_url, _spec(schema, table), revision, sql=sql))


@db.command("current")
@DATABASE_URL
@SCHEMA
@TABLE
def db_current(database_url: str, schema: str, table: str) -> None:
    """Show the outbox table's revision."""
    from outbox import migrate

    _run_db_step(lambda: migrate.current(database_url, _spec(schema, table)))


@main.command()
@DATABASE_URL
@SCHEMA
@TABLE
@click.option(
    "--older-than", required=True, help="Age of sent rows to delete: 90s, 15m, 12h, 7d, 1w."
)
@click.option("--batch-size", default=1000, show_default=True, type=click.IntRange(min=1))
def purge(database_url: str, schema: str, table: str, older_than: str, batch_size: int) -> None:
    """Delete sent rows older than --older-than, in short batches."""
    import sqlalchemy as sa

    from outbox.durations import parse_duration
    from outbox.retention import purge_sent

    try:
        age = parse_duration(older_than)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--older-than") from exc
    engine = sa.create_engine(database_url)
    try:
        deleted = _run_db_step(
            lambda: purge_sent(engine, age, spec=_spec(schema, table), batch_size=batch_size)
        )
    finally:
        engine.dispose()
    click.echo(f"deleted {deleted} sent rows older than {older_than}")


@main.group()
def dev() -> None:
    """The local stack: PostgreSQL + Apache Kafka (KRaft) + Spark jars on 127.0.0.1."""


@dev.command()
def prepare() -> None:
    """Install PostgreSQL if missing and resolve the Kafka and Spark jars (idempotent)."""
    from devstack import prepare as prepare_stack

    _run_stack_step(prepare_stack)
    click.echo("local stack prepared")


@dev.command()
@click.option("--name", default="dev", show_default=True, help="Stack instance name.")
def up(name: str) -> None:
    """Start the stack (or keep it running) and print its connection settings."""
    from devstack import LocalStack

    info = _run_stack_step(lambda: LocalStack.named(name).up())
    for key, value in info.as_env().items():
        click.echo(f"{key}={value}")


@dev.command()
@click.option("--name", default="dev", show_default=True, help="Stack instance name.")
def down(name: str) -> None:
    """Stop the stack's servers and remove their data."""
    from devstack import LocalStack

    _run_stack_step(lambda: LocalStack.named(name).down())
    click.echo(f"stack '{name}' stopped")


@dev.command()
@click.option("--name", default="dev", show_default=True, help="Stack instance name.")
def status(name: str) -> None:
    """Say which of the stack's servers are running; exit 1 unless all are."""
    from devstack import LocalStack

    states = LocalStack.named(name).status()
    for server, running in states.items():
        click.echo(f"{server}: {'running' if running else 'stopped'}")
    sys.exit(0 if all(states.values()) else 1)


def _run_stack_step(step: Callable[[], T]) -> T:
    """Run a stack operation, turning its failure into one clear error line."""
    from devstack import StackError

    try:
        return step()
    except StackError as exc:
        raise click.ClickException(str(exc)) from exc


def _run_db_step(step: Callable[[], T]) -> T:
    """Run a database operation; a failure becomes one clear line, not a traceback."""
    from sqlalchemy.exc import SQLAlchemyError

    try:
        return step()
    except OutboxError as exc:
        raise click.ClickException(str(exc)) from exc
    except SQLAlchemyError as exc:
        reason = getattr(exc, "orig", None) or exc
        raise click.ClickException(f"database error: {_redact(str(reason))}") from exc


def _redact(text: str) -> str:
    """Hide passwords that a driver error may repeat (user:password@host)."""
    import re

    return re.sub(r"(://[^:/@\s]+:)[^@\s]+@", r"\1***@", text)
