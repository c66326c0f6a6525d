"""The ``outbox`` command line."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any, TypeVar

import click

from outbox.cli_options import (
    DATABASE_URL,
    SCHEMA,
    TABLE,
    bootstrap_servers_option,
    kafka_settings_option,
    parse_key_values,
)
from outbox.errors import OutboxError
from outbox.schema import OutboxTableSpec

T = TypeVar("T")


@click.group()
@click.version_option(package_name="outbox-kafka")
def main() -> None:
    """Transactional outbox for PostgreSQL and Kafka."""


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
@click.option("--dry-run", is_flag=True, help="Count the rows that would go; delete nothing.")
@click.option(
    "--ignore-audit-window",
    is_flag=True,
    help="Purge even rows the nightly reconciliation may still read (it will then report "
    "their records as phantoms).",
)
def purge(
    database_url: str,
    schema: str,
    table: str,
    older_than: str,
    batch_size: int,
    dry_run: bool,
    ignore_audit_window: bool,
) -> None:
    """Delete sent rows older than --older-than, in short batches.

    Refuses a cut-off the nightly reconciliation may still read (the previous UTC day, with
    its grace period) unless --ignore-audit-window is given.
    """
    from datetime import UTC

    import sqlalchemy as sa

    from outbox.durations import parse_duration
    from outbox.retention import purge_sent

    try:
        age = parse_duration(older_than)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--older-than") from exc
    now = datetime.now(UTC)
    cutoff = now - age
    too_recent = _purge_reaches_the_audit(now, cutoff)
    if too_recent and not (dry_run or ignore_audit_window):
        raise click.ClickException(too_recent)
    spec = _spec(schema, table)
    engine = sa.create_engine(database_url)
    try:
        count = _run_db_step(
            lambda: purge_sent(
                engine, age, spec=spec, batch_size=batch_size, now=now, dry_run=dry_run
            )
        )
    finally:
        engine.dispose()
    what = (
        f"sent rows older than {older_than} "
        f"(created and sent before {cutoff:%Y-%m-%d %H:%M:%S} UTC)"
    )
    if dry_run:
        click.echo(f"would delete {count} {what}; dry run, nothing deleted")
        if too_recent and not ignore_audit_window:
            click.echo(f"a real run would be refused: {too_recent}")
    else:
        click.echo(f"deleted {count} {what}")


def _purge_reaches_the_audit(now: datetime, cutoff: datetime) -> str | None:
    """Why a purge up to ``cutoff`` could take rows the nightly audit still reads, or None."""
    import math

    from outbox.retention import AUDIT_GRACE, audit_horizon

    horizon = audit_horizon(now)
    if cutoff <= horizon:
        return None
    hours = math.ceil((now - horizon).total_seconds() / 3600)
    grace = int(AUDIT_GRACE.total_seconds() // 60)
    return (
        f"refusing to purge up to {cutoff:%Y-%m-%d %H:%M} UTC: the nightly reconciliation "
        f"still reads rows made since {horizon:%Y-%m-%d %H:%M} UTC (the previous UTC day, "
        f"with {grace} minutes of grace) and would report their records as phantoms. "
        f"Use --older-than {hours}h or more, or pass --ignore-audit-window if no audit "
        "will read them"
    )


@main.command()
@DATABASE_URL
@SCHEMA
@TABLE
@bootstrap_servers_option(required=True)
@kafka_settings_option(
    "A Kafka client setting, e.g. -X security.protocol=SASL_SSL (repeatable). "
    "OUTBOX_KAFKA_<NAME> variables work too: OUTBOX_KAFKA_SASL_PASSWORD -> sasl.password."
)
@click.option(
    "--mode",
    type=click.Choice(["at-least-once", "exactly-once"]),
    default="at-least-once",
    show_default=True,
    envvar="OUTBOX_RELAY_MODE",
    show_envvar=True,
)
@click.option(
    "--batch-size",
    default=1000,
    show_default=True,
    envvar="OUTBOX_RELAY_BATCH_SIZE",
    show_envvar=True,
)
@click.option(
    "--poll-interval",
    default=1.0,
    show_default=True,
    envvar="OUTBOX_RELAY_POLL_INTERVAL",
    show_envvar=True,
    help="Seconds between polls when no NOTIFY arrives.",
)
@click.option(
    "--max-attempts",
    default=12,
    show_default=True,
    envvar="OUTBOX_RELAY_MAX_ATTEMPTS",
    show_envvar=True,
)
@click.option(
    "--backoff-base",
    default=0.5,
    show_default=True,
    envvar="OUTBOX_RELAY_BACKOFF_BASE",
    show_envvar=True,
)
@click.option(
    "--backoff-max",
    default=300.0,
    show_default=True,
    envvar="OUTBOX_RELAY_BACKOFF_MAX",
    show_envvar=True,
)
@click.option(
    "--delivery-timeout-ms",
    default=300_000,
    show_default=True,
    envvar="OUTBOX_RELAY_DELIVERY_TIMEOUT_MS",
    show_envvar=True,
    help="How long Kafka may take to acknowledge one attempt.",
)
@click.option(
    "--lease-seconds",
    default=360.0,
    show_default=True,
    envvar="OUTBOX_RELAY_LEASE_SECONDS",
    show_envvar=True,
)
@click.option(
    "--metrics-port",
    type=int,
    default=None,
    envvar="OUTBOX_RELAY_METRICS_PORT",
    show_envvar=True,
    help="Serve /metrics, /healthz and /readyz on this port (0: any free port).",
)
@click.option(
    "--metrics-host",
    default="127.0.0.1",
    show_default=True,
    envvar="OUTBOX_RELAY_METRICS_HOST",
    show_envvar=True,
    help="Address the metrics and health server listens on (0.0.0.0 in a container).",
)
@click.option(
    "--transactional-id-prefix",
    default=None,
    envvar="OUTBOX_RELAY_TRANSACTIONAL_ID_PREFIX",
    show_envvar=True,
)
@click.option(
    "--progress-topic", default=None, envvar="OUTBOX_RELAY_PROGRESS_TOPIC", show_envvar=True
)
@click.option(
    "--delete-on-send",
    is_flag=True,
    envvar="OUTBOX_RELAY_DELETE_ON_SEND",
    show_envvar=True,
    help="Keep nothing: delete rows once Kafka acknowledged them, instead of marking them sent.",
)
@click.option(
    "--shutdown-timeout",
    default=30.0,
    show_default=True,
    envvar="OUTBOX_RELAY_SHUTDOWN_TIMEOUT",
    show_envvar=True,
    help="Seconds a SIGTERM may wait for the batch in hand.",
)
@click.option(
    "--log-level", default="INFO", show_default=True, envvar="OUTBOX_LOG_LEVEL", show_envvar=True
)
def relay(
    database_url: str,
    schema: str,
    table: str,
    bootstrap_servers: str,
    kafka_settings: tuple[str, ...],
    mode: str,
    batch_size: int,
    poll_interval: float,
    max_attempts: int,
    backoff_base: float,
    backoff_max: float,
    delivery_timeout_ms: int,
    lease_seconds: float,
    metrics_port: int | None,
    metrics_host: str,
    transactional_id_prefix: str | None,
    progress_topic: str | None,
    delete_on_send: bool,
    shutdown_timeout: float,
    log_level: str,
) -> None:
    """Publish pending outbox rows to Kafka until stopped (SIGTERM/SIGINT)."""
    import signal
    import threading

    # A stop asked for while starting up is honoured as soon as the loop exists.
    stop_early = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop_early.set())

    from relay.config import RelayConfig, kafka_config_from_env
    from relay.daemon import Relay
    from relay.observability import configure_logging
    from relay.policy import RetryPolicy

    configure_logging(log_level)
    kafka = {
        **kafka_config_from_env(),
        **parse_key_values(kafka_settings),
        "bootstrap.servers": bootstrap_servers,
    }
    try:
        config = RelayConfig(
            database_url=database_url,
            kafka=kafka,
            spec=_spec(schema, table),
            mode=mode,
            batch_size=batch_size,
            poll_interval=poll_interval,
            lease_seconds=lease_seconds,
            delivery_timeout_ms=delivery_timeout_ms,
            retry=RetryPolicy(max_attempts, backoff_base, backoff_max),
            transactional_id_prefix=transactional_id_prefix,
            progress_topic=progress_topic,
            metrics_port=metrics_port,
            metrics_host=metrics_host,
            delete_on_send=delete_on_send,
            shutdown_timeout=shutdown_timeout,
        )
        _run_db_step(_check_relay_access(config))
    except (OutboxError, ValueError) as exc:
        raise click.ClickException(_redact(str(exc))) from exc
    daemon = Relay(config)
    daemon.install_signal_handlers()
    if stop_early.is_set():
        daemon.stop()
    sys.exit(daemon.run())


def _check_relay_access(config: object) -> Callable[[], None]:
    """Fail fast, in one line, when the database or the table is out of reach."""

    def check() -> None:
        import sqlalchemy as sa

        from relay.config import RelayConfig

        assert isinstance(config, RelayConfig)
        engine = sa.create_engine(config.database_url, connect_args={"connect_timeout": 10})
        try:
            with engine.connect() as conn:
                spec = config.spec
                row = conn.execute(
                    sa.text(
                        # One privilege per call: given a list, Postgres answers true
                        # when any one of them is held.
                        "SELECT t.oid IS NOT NULL, t.oid IS NOT NULL"
                        " AND has_table_privilege(t.oid, 'SELECT')"
                        " AND has_table_privilege(t.oid, 'UPDATE'),"
                        # The newest revision's column: a table not upgraded yet is refused
                        # here, in one line, not by the first batch.
                        " EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = t.oid"
                        " AND attname = 'generation' AND NOT attisdropped)"
                        " FROM (SELECT to_regclass(:name) AS oid) AS t"
                    ),
                    {"name": spec.qualified_name},
                ).one()
        finally:
            engine.dispose()
        if not row[0]:
            raise OutboxError(
                f"table {spec.qualified_name} does not exist: run `outbox db upgrade`"
            )
        if not row[1]:
            raise OutboxError(
                f"role {sa.make_url(config.database_url).username} needs SELECT and UPDATE "
                f"on {spec.qualified_name} (see docs/relay.md, 'Database role')"
            )
        if not row[2]:
            raise OutboxError(
                f"table {spec.qualified_name} is older than this relay: run `outbox db upgrade`"
            )

    return check


@main.group()
def dead() -> None:
    """Inspect, retry and purge messages the relay gave up on."""


@contextmanager
def _dead_store(database_url: str, schema: str, table: str) -> Iterator[tuple[Any, Any]]:
    """An engine (disposed afterwards, whatever happens) and the table's named queries."""
    import sqlalchemy as sa

    from outbox.queries import Queries

    queries = Queries(_spec(schema, table))
    engine = sa.create_engine(database_url)
    try:
        yield engine, queries
    finally:
        engine.dispose()


@dead.command("list")
@DATABASE_URL
@SCHEMA
@TABLE
@click.option("--topic", default=None)
@click.option("--limit", default=50, show_default=True)
def dead_list(database_url: str, schema: str, table: str, topic: str | None, limit: int) -> None:
    """List dead messages, newest first."""

    def run(engine: Any, queries: Any) -> None:
        with engine.connect() as conn:
            rows = conn.execute(queries["list_dead"], {"topic": topic, "limit": limit}).all()
        for row in rows:
            key = row.key.decode(errors="replace") if row.key is not None else "-"
            click.echo(
                f"{row.id}  {row.topic}  key={key}  attempts={row.attempts}  "
                f"{row.error_kind}: {(row.last_error or '')[:120]}"
            )
        click.echo(f"{len(rows)} dead message(s)")

    with _dead_store(database_url, schema, table) as (engine, queries):
        _run_db_step(lambda: run(engine, queries))


@dead.command("show")
@DATABASE_URL
@SCHEMA
@TABLE
@click.argument("message_id", type=click.UUID)
def dead_show(database_url: str, schema: str, table: str, message_id: object) -> None:
    """Show one message, every column."""

    def run(engine: Any, queries: Any) -> None:
        with engine.connect() as conn:
            row = conn.execute(queries["show_message"], {"id": message_id}).mappings().first()
        if row is None:
            raise OutboxError(f"no message {message_id}")
        for name, value in row.items():
            if isinstance(value, bytes):
                value = value.decode(errors="replace")
            click.echo(f"{name:>16}  {value}")

    with _dead_store(database_url, schema, table) as (engine, queries):
        _run_db_step(lambda: run(engine, queries))


def _dead_bulk(query: str, verb: str):  # type: ignore[no-untyped-def]
    @DATABASE_URL
    @SCHEMA
    @TABLE
    @click.option("--topic", default=None, help="Only this topic's dead messages.")
    @click.option("--all", "everything", is_flag=True, help="Every dead message.")
    @click.argument("message_ids", nargs=-1, type=click.UUID)
    def command(
        database_url: str,
        schema: str,
        table: str,
        topic: str | None,
        everything: bool,
        message_ids: tuple[object, ...],
    ) -> None:
        if not (message_ids or topic or everything):
            raise click.UsageError("name message ids, or pass --topic or --all")

        def run(engine: Any, queries: Any) -> int:
            with engine.begin() as conn:
                params = {"ids": list(message_ids) or None, "topic": topic}
                return int(conn.execute(queries[query], params).rowcount)

        with _dead_store(database_url, schema, table) as (engine, queries):
            count = _run_db_step(lambda: run(engine, queries))
        click.echo(f"{verb} {count} dead message(s)")

    return command


dead.command("retry", help="Put dead messages back to pending, with a fresh attempt count.")(
    _dead_bulk("retry_dead", "requeued")
)
dead.command("purge", help="Delete dead messages.")(_dead_bulk("purge_dead", "deleted"))


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
        reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
        raise click.ClickException(f"database error: {_redact(reason)}") from exc


def _redact(text: str) -> str:
    """Hide passwords that a driver error may repeat (user:password@host)."""
    import re

    return re.sub(r"(://[^:/@\s]+:)[^@\s]+@", r"\1***@", text)


def _add_reconcile() -> None:
    # The command's module imports PySpark only when it runs.
    from spark_jobs.cli import reconcile

    main.add_command(reconcile)


_add_reconcile()


def _add_chaos() -> None:
    # The run's modules load the stack and Spark only when it runs.
    from chaos.cli import chaos

    main.add_command(chaos)


_add_chaos()


def _add_inbox() -> None:
    # The consuming side: `outbox consume` and `outbox inbox ...` live with their package.
    from outbox.inbox.cli import consume, inbox

    main.add_command(consume)
    main.add_command(inbox)


_add_inbox()

if __name__ == "__main__":
    main()
