"""``outbox consume`` (the runner) and ``outbox inbox ...`` (tables, retention, parked
messages), registered on the ``outbox`` command line by ``outbox.cli``."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import click

from outbox.cli_options import (
    DATABASE_URL,
    INBOX_SCHEMA,
    INBOX_TABLE,
    bootstrap_servers_option,
    check_database_at_start,
    daemon_options,
    database_engine,
    database_outage_limit_option,
    kafka_settings_option,
    modules_from_working_directory,
    on_stop_signals,
    parse_key_values,
    run_db_step,
)
from outbox.errors import OutboxError
from outbox.inbox.dead_letter_cli import (
    dead_letter_options,
    read_dead_letters,
    requeue_dead_letters,
)
from outbox.redaction import mask_secrets

if TYPE_CHECKING:
    from outbox.inbox.parked import ParkedAction

T = TypeVar("T")


def _spec(schema: str, table: str) -> Any:
    from outbox.inbox.schema import InboxTableSpec

    try:
        return InboxTableSpec(schema=schema, table=table)
    except OutboxError as exc:
        raise click.BadParameter(str(exc)) from exc


@click.command()
@click.argument("target", metavar="MODULE:INBOX")
@DATABASE_URL
@INBOX_SCHEMA
@INBOX_TABLE
@bootstrap_servers_option(required=True)
@kafka_settings_option(
    "A Kafka consumer setting, e.g. -X security.protocol=SASL_SSL (repeatable). "
    "OUTBOX_KAFKA_<NAME> variables work too: OUTBOX_KAFKA_SASL_PASSWORD -> sasl.password."
)
@click.option(
    "--batch-size",
    default=500,
    show_default=True,
    envvar="OUTBOX_CONSUME_BATCH_SIZE",
    show_envvar=True,
    help="Records per database transaction.",
)
@click.option(
    "--max-wait",
    default=0.1,
    show_default=True,
    envvar="OUTBOX_CONSUME_MAX_WAIT",
    show_envvar=True,
    help="Seconds to wait for a batch to fill before applying what came.",
)
@click.option(
    "--max-attempts",
    default=5,
    show_default=True,
    envvar="OUTBOX_CONSUME_MAX_ATTEMPTS",
    show_envvar=True,
    help="Handler attempts before a message is parked.",
)
@click.option(
    "--backoff-base",
    default=0.5,
    show_default=True,
    envvar="OUTBOX_CONSUME_BACKOFF_BASE",
    show_envvar=True,
    help="Seconds before a failed message's first retry (doubling, jittered).",
)
@click.option(
    "--backoff-max",
    default=60.0,
    show_default=True,
    envvar="OUTBOX_CONSUME_BACKOFF_MAX",
    show_envvar=True,
    help="The longest wait between two retries of a message.",
)
@click.option(
    "--retention",
    default=None,
    envvar="OUTBOX_INBOX_RETENTION",
    show_envvar=True,
    help="Purge inbox rows older than this (14d, 2w, ...) every hour; see docs/inbox.md.",
)
@database_outage_limit_option("OUTBOX_CONSUME")
@daemon_options("OUTBOX_CONSUME")
def consume(
    target: str,
    database_url: str,
    inbox_schema: str,
    inbox_table: str,
    bootstrap_servers: str,
    kafka_settings: tuple[str, ...],
    batch_size: int,
    max_wait: float,
    max_attempts: int,
    backoff_base: float,
    backoff_max: float,
    retention: str | None,
    database_outage_limit: float,
    metrics_port: int | None,
    metrics_host: str,
    start_timeout: float,
    log_level: str,
    log_format: str | None,
) -> None:
    """Apply the records of MODULE:INBOX's topics through the inbox until stopped.

    MODULE:INBOX names an outbox.inbox.Inbox, e.g. myapp.handlers:inbox. SIGTERM finishes
    the batch in hand, commits its offsets and leaves the group.
    """
    import threading

    from outbox.logs import KAFKA_LOGGER, configure_logging

    configure_logging(log_level, log_format)
    log = logging.getLogger("outbox.inbox")
    stop_early = threading.Event()

    on_stop_signals(stop_early.set, log, "stopping while it starts")

    from outbox.durations import parse_duration
    from outbox.inbox.api import load_inbox
    from outbox.inbox.config import ConsumerConfig, kafka_config_from_env
    from outbox.inbox.runner import InboxRunner

    kafka = {
        **kafka_config_from_env(),
        **parse_key_values(kafka_settings),
        "bootstrap.servers": bootstrap_servers,
        "logger": KAFKA_LOGGER,  # librdkafka's lines in the daemon's format, folded
    }
    try:
        age = parse_duration(retention) if retention else None
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--retention") from exc
    modules_from_working_directory()
    try:
        inbox = load_inbox(target)
        config = ConsumerConfig(
            database_url=database_url,
            kafka=kafka,
            spec=_spec(inbox_schema, inbox_table),
            batch_size=batch_size,
            max_wait=max_wait,
            max_attempts=max_attempts,
            backoff_base=backoff_base,
            backoff_max=backoff_max,
            retention=age,
            database_outage_limit=database_outage_limit,
            metrics_port=metrics_port,
            metrics_host=metrics_host,
        )
        if not check_database_at_start(
            database_url, _inbox_access_problem(config.spec), start_timeout, stop_early.wait, log
        ):
            sys.exit(0)  # stopped while it waited for the database
        runner = InboxRunner(inbox, config)
    except (OutboxError, ValueError) as exc:
        raise click.ClickException(mask_secrets(str(exc))) from exc
    on_stop_signals(
        runner.stop, log, "finishing the batch in hand, committing its offsets, leaving the group"
    )
    if stop_early.is_set():
        runner.stop()
    log.info("inbox consumer starting", extra={"group": inbox.group, "topics": inbox.topics})
    try:
        code = runner.run()
    except OutboxError as exc:
        raise click.ClickException(mask_secrets(str(exc))) from exc
    sys.exit(code)


#: What the consumer does with each inbox table (docs/inbox.md, "Database role").
_PRIVILEGES = ("SELECT", "INSERT", "UPDATE", "DELETE")


def _inbox_access_problem(spec: Any) -> Callable[[Any], str | None]:
    """Why the consumer cannot work on the inbox tables (missing, or a privilege missing)."""

    def problem(engine: Any) -> str | None:
        import sqlalchemy as sa

        from outbox.inbox.store import InboxStore

        tables = [spec.qualified_name, f"{spec.schema}.{spec.parked_name}"]
        with engine.connect() as conn:
            missing = InboxStore(spec).check(conn)
            if missing:
                return str(missing)
            lacking = list(
                conn.execute(
                    sa.text(
                        "SELECT t.name || ': ' || string_agg(p.privilege, ', ' ORDER BY p.n)"
                        " FROM unnest(CAST(:tables AS text[])) AS t(name),"
                        " unnest(CAST(:privileges AS text[])) WITH ORDINALITY AS p(privilege, n)"
                        " WHERE NOT has_table_privilege(t.name, p.privilege)"
                        " GROUP BY t.name ORDER BY t.name"
                    ),
                    {"tables": tables, "privileges": list(_PRIVILEGES)},
                ).scalars()
            )
        if lacking:
            return (
                f"role {engine.url.username} needs {', '.join(_PRIVILEGES)} on the inbox tables; "
                f"it lacks {'; '.join(lacking)} (see docs/inbox.md, 'Database role')"
            )
        return None

    return problem


@click.group()
def inbox() -> None:
    """The inbox tables: install, purge old rows, deal with parked messages."""


@inbox.command("install")
@DATABASE_URL
@INBOX_SCHEMA
@INBOX_TABLE
@click.option("--sql", is_flag=True, help="Print the SQL instead of running it.")
def install(database_url: str, inbox_schema: str, inbox_table: str, sql: bool) -> None:
    """Create the inbox tables or bring them up to date (the inbox's Alembic branch)."""
    from outbox.inbox import migrate

    spec = _spec(inbox_schema, inbox_table)
    run_db_step(lambda: migrate.install(database_url, spec, sql=sql))


@inbox.command("uninstall")
@DATABASE_URL
@INBOX_SCHEMA
@INBOX_TABLE
@click.option("--yes", is_flag=True, required=True, help="Confirm: applied ids are lost.")
def uninstall(database_url: str, inbox_schema: str, inbox_table: str, yes: bool) -> None:
    """Drop the inbox tables: every record of applied and parked messages goes."""
    from outbox.inbox import migrate

    spec = _spec(inbox_schema, inbox_table)
    run_db_step(lambda: migrate.uninstall(database_url, spec))


@inbox.command("purge")
@DATABASE_URL
@INBOX_SCHEMA
@INBOX_TABLE
@click.option(
    "--older-than", required=True, help="Age of inbox rows to delete: 90s, 15m, 12h, 7d, 1w."
)
@click.option("--batch-size", default=5000, show_default=True, type=click.IntRange(min=1))
@click.option("--dry-run", is_flag=True, help="Count the rows that would go; delete nothing.")
def purge(
    database_url: str,
    inbox_schema: str,
    inbox_table: str,
    older_than: str,
    batch_size: int,
    dry_run: bool,
) -> None:
    """Delete inbox rows older than --older-than (a duplicate arriving later is applied
    again: keep them longer than Kafka can redeliver, see docs/inbox.md)."""
    from outbox.durations import parse_duration

    try:
        age = parse_duration(older_than)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--older-than") from exc
    with _store(database_url, inbox_schema, inbox_table) as (engine, store):
        count = run_db_step(
            lambda: store.purge_processed(engine, age, batch_size=batch_size, dry_run=dry_run)
        )
    if dry_run:
        click.echo(f"would delete {count} inbox row(s) older than {older_than}; dry run")
    else:
        click.echo(f"deleted {count} inbox row(s) older than {older_than}")


@contextmanager
def _store(database_url: str, schema: str, table: str) -> Iterator[tuple[Any, Any]]:
    from outbox.inbox.store import InboxStore

    store = InboxStore(_spec(schema, table))
    with database_engine(database_url) as engine:
        yield engine, store


@inbox.group()
def parked() -> None:
    """Inspect, retry and purge messages the consumer parked."""


@parked.command("list")
@DATABASE_URL
@INBOX_SCHEMA
@INBOX_TABLE
@click.option("--group", default=None, help="Only this consumer group's messages.")
@click.option("--topic", default=None)
@click.option("--limit", default=50, show_default=True)
@click.option(
    "--by-reason",
    is_flag=True,
    help="Group those waiting for an operator by cause (reason, exception class, message with "
    "numbers, ids, hex and quoted values left out): one line per FINGERPRINT.",
)
def parked_list(
    database_url: str,
    inbox_schema: str,
    inbox_table: str,
    group: str | None,
    topic: str | None,
    limit: int,
    by_reason: bool,
) -> None:
    """List parked messages, newest first (or grouped by cause, the largest group first)."""

    from outbox.inbox.error_text import error_line

    def run(engine: Any, store: Any) -> None:
        if by_reason:
            from outbox.failed_rows import parked_rows
            from outbox.fingerprints import by_reason_lines

            with engine.connect() as conn:
                found = parked_rows(conn, store.spec, group, topic)
            noun = "parked message(s) waiting"
            for line in by_reason_lines(found, limit, seen="parked", noun=noun):
                click.echo(line)
            return
        with engine.connect() as conn:
            rows = store.list_parked(conn, group, topic, limit)
        for row in rows:
            key = row.key.decode(errors="replace") if row.key is not None else "-"
            click.echo(
                f"{row.id}  {row.consumer_group}  {row.topic}[{row.kafka_partition}]"
                f"@{row.kafka_offset}  key={key}  {row.status}  {row.reason}: "
                f"{error_line(row.error)[:120]}"
            )
        click.echo(f"{len(rows)} parked message(s)")

    with _store(database_url, inbox_schema, inbox_table) as (engine, store):
        run_db_step(lambda: run(engine, store))


@parked.command("show")
@DATABASE_URL
@INBOX_SCHEMA
@INBOX_TABLE
@click.argument("parked_id", type=int)
def parked_show(database_url: str, inbox_schema: str, inbox_table: str, parked_id: int) -> None:
    """Show one parked message, every column."""

    def run(engine: Any, store: Any) -> None:
        with engine.connect() as conn:
            row = store.show_parked(conn, parked_id)
        if row is None:
            raise OutboxError(f"no parked message {parked_id}")
        for name, value in row._mapping.items():
            if isinstance(value, bytes):
                value = value.decode(errors="replace")
            elif isinstance(value, list):
                value = [v.decode(errors="replace") if isinstance(v, bytes) else v for v in value]
            click.echo(f"{name:>16}  {value}")

    with _store(database_url, inbox_schema, inbox_table) as (engine, store):
        run_db_step(lambda: run(engine, store))


def _parked_bulk(action: ParkedAction, verb: str) -> Callable[..., None]:
    @DATABASE_URL
    @INBOX_SCHEMA
    @INBOX_TABLE
    @click.option("--group", default=None, help="Only this consumer group's messages.")
    @click.option("--topic", default=None, help="Only this topic's messages.")
    @click.option("--all", "everything", is_flag=True, help="Every parked message.")
    @click.argument("parked_ids", nargs=-1, type=int)
    @click.option(
        "--reason",
        default=None,
        metavar="FINGERPRINT",
        help="Only the parked messages of this cause (a FINGERPRINT of `list --by-reason`).",
    )
    def command(
        database_url: str,
        inbox_schema: str,
        inbox_table: str,
        group: str | None,
        topic: str | None,
        everything: bool,
        parked_ids: tuple[int, ...],
        reason: str | None,
        dead_letters: tuple[str, ...] = (),
        bootstrap_servers: str | None = None,
        kafka_settings: tuple[str, ...] = (),
    ) -> None:
        if dead_letters:
            if parked_ids or group or topic or everything or reason:
                raise click.UsageError("--dead-letter picks the messages: give nothing else")
            letters = read_dead_letters(dead_letters, bootstrap_servers, kafka_settings)
            with _store(database_url, inbox_schema, inbox_table) as (engine, store):
                restored = run_db_step(lambda: requeue_dead_letters(engine, store, letters))
            counts = f"{verb} {len(letters)} parked message(s), {restored} put back"
            click.echo(f"{counts} from their dead letters")
            return
        if not (parked_ids or group or topic or everything or reason):
            raise click.UsageError("name parked ids, or pass --group, --topic, --reason or --all")
        if reason is not None and (parked_ids or everything):
            raise click.UsageError("--reason picks the messages: give no ids and no --all")

        def run(engine: Any, store: Any) -> int:
            from outbox.inbox.parked import act_on_parked

            with engine.begin() as conn:
                return act_on_parked(
                    conn,
                    store,
                    action,
                    ids=list(parked_ids),
                    group=group,
                    topic=topic,
                    reason=reason,
                )

        with _store(database_url, inbox_schema, inbox_table) as (engine, store):
            count = run_db_step(lambda: run(engine, store))
        click.echo(f"{verb} {count} parked message(s)")

    return command


parked.command(
    "retry",
    help="Hand parked messages back to their group's running consumer, which applies them "
    "(or parks them again) within a few seconds: by id, --group, --topic, --reason, --all, "
    "or --dead-letter.",
)(dead_letter_options(_parked_bulk("requeue", "requeued")))
parked.command("purge", help="Delete parked messages.")(_parked_bulk("purge_parked", "deleted"))
