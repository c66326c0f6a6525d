"""The ``outbox`` command line.

The library's own commands (``db``, ``purge``, ``dead``, ``status``) live here, their longer
logic in modules of their own. The others load only when named: ``topics``
(:mod:`outbox.topics_cli`), and those that live with the package they run: ``relay``
(:mod:`outbox.relay.cli`), ``reconcile`` (:mod:`outbox.spark_jobs.cli`), ``consume`` and
``inbox`` (:mod:`outbox.inbox.cli`), ``checkback`` and ``prepared``
(:mod:`outbox.prepared.cli`), ``scheduled`` (:mod:`outbox.scheduled.cli`), and from a source
checkout ``dev`` (:mod:`outbox.devstack.cli`) and ``chaos`` (:mod:`outbox.chaos.cli`). So
``outbox --help`` loads neither librdkafka nor PySpark, and a command whose package is not
installed says so in one line.
"""

from __future__ import annotations

import sys

from outbox import early_stop

# Before the imports that take seconds (SQLAlchemy, through cli_options): see early_stop.
if __name__ == "__main__" or early_stop.is_the_outbox_command(sys.argv):
    early_stop.install()

import importlib
import importlib.util
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import TYPE_CHECKING, Any, NamedTuple

import click

from outbox.cli_options import (
    DATABASE_URL,
    SCHEMA,
    TABLE,
    database_engine,
    message_selection,
    run_db_step,
    table_spec,
)
from outbox.errors import OutboxError

if TYPE_CHECKING:
    from outbox.operator import DeadAction


class LazyCommand(NamedTuple):
    """A command defined in another package, imported only when it runs."""

    module: str
    attribute: str
    #: Shown by ``outbox --help`` without importing the module; tests/unit/test_cli_help.py
    #: checks it against the command's own.
    short_help: str
    #: Why the command is missing from an installed package, if it can be.
    unavailable: str = ""


#: The commands that run until stopped and handle SIGTERM/SIGINT themselves: until they do,
#: a stop asked for is a clean stop before start (:mod:`outbox.early_stop`).
DAEMONS = frozenset({"relay", "consume", "checkback"})

_TOOLING = "development tooling: it runs from a source checkout (pip install -e .), not from "
LAZY_COMMANDS = {
    "relay": LazyCommand(
        "outbox.relay.cli",
        "relay",
        "Publish pending outbox rows to Kafka until stopped (SIGTERM/SIGINT).",
    ),
    "reconcile": LazyCommand(
        "outbox.spark_jobs.cli",
        "reconcile",
        "Audit the outbox against what landed on the topics; exit 1 when over the limits.",
    ),
    "consume": LazyCommand(
        "outbox.inbox.cli",
        "consume",
        "Apply the records of MODULE:INBOX's topics through the inbox until stopped.",
    ),
    "inbox": LazyCommand(
        "outbox.inbox.cli",
        "inbox",
        "The inbox tables: install, purge old rows, deal with parked messages.",
    ),
    "checkback": LazyCommand(
        "outbox.prepared.cli",
        "checkback",
        "Check prepared messages with MODULE:REGISTRY's checkers until stopped.",
    ),
    "prepared": LazyCommand(
        "outbox.prepared.cli",
        "prepared",
        "Inspect prepared messages; commit or roll back those waiting for a verdict.",
    ),
    "scheduled": LazyCommand(
        "outbox.scheduled.cli",
        "scheduled",
        "List scheduled messages; cancel those not yet due.",
    ),
    "dashboard": LazyCommand(
        "outbox.dashboard.cli",
        "dashboard",
        "Serve a web page for operators: messages pending, dead, parked or prepared.",
    ),
    "partitions": LazyCommand(
        "outbox.partitions_cli",
        "partitions",
        "The partitioned layout: list partitions, create coming ones, drop old ones.",
    ),
    "topics": LazyCommand(
        "outbox.topics_cli",
        "topics",
        "Create, describe and check the topics the outbox publishes to.",
    ),
    "dev": LazyCommand(
        "outbox.devstack.cli",
        "dev",
        "The local stack: PostgreSQL + Apache Kafka (KRaft) + Spark jars on 127.0.0.1.",
        f"the local stack is {_TOOLING}the installed package",
    ),
    "chaos": LazyCommand(
        "outbox.chaos.cli",
        "chaos",
        "Break things on purpose and prove nothing was lost, invented or reordered.",
        f"chaos runs are {_TOOLING}the installed package",
    ),
}


def _installed(module: str) -> bool:
    # Finds the command's package without importing it (only `outbox`, already loaded).
    return importlib.util.find_spec(module.rpartition(".")[0]) is not None


#: The exit status of a command that could not do its work (a server out of reach, a bad
#: argument, an unexpected error); 1 is left to the checks for what they find
#: (docs/operations.md, "Exit codes").
CANNOT_RUN = 2


class LazyGroup(click.Group):
    """A group that imports a command's module only when that command runs, and ends every
    command the same way: an error exits with :data:`CANNOT_RUN`, its line written last (in
    the daemons' JSON log format when that is theirs)."""

    def invoke(self, ctx: click.Context) -> Any:
        from outbox.logs import configured_handler, log_fatal

        before = configured_handler()

        def own_handler() -> Any:
            # This command's log set-up (a daemon's), not one that an earlier command in the
            # same process left behind.
            handler = configured_handler()
            return None if handler is before else handler

        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.exceptions.Abort):
            raise
        except click.ClickException as exc:
            # 1 is click's for any error: here it is left to the checks' findings.
            code = CANNOT_RUN if exc.exit_code == 1 else exc.exit_code
            if not log_fatal(own_handler(), exc.format_message(), code):
                exc.show()
            ctx.exit(code)
        except Exception as exc:
            message = f"unexpected error: {type(exc).__name__}: {exc}"
            if not log_fatal(own_handler(), message, CANNOT_RUN, sys.exc_info()):
                traceback.print_exc()
            ctx.exit(CANNOT_RUN)

    def list_commands(self, ctx: click.Context) -> list[str]:
        lazy = [name for name, lazy in LAZY_COMMANDS.items() if _installed(lazy.module)]
        return sorted({*super().list_commands(ctx), *lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in LAZY_COMMANDS:
            return super().get_command(ctx, cmd_name)
        lazy = LAZY_COMMANDS[cmd_name]
        if not _installed(lazy.module):
            ctx.fail(f"outbox {cmd_name}: {lazy.unavailable}")
        command = getattr(importlib.import_module(lazy.module), lazy.attribute)
        assert isinstance(command, click.Command)
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # As click.Group's, but a lazy command's help comes from LAZY_COMMANDS: listing the
        # commands imports none of them.
        names = self.list_commands(ctx)
        if not names:
            return
        limit = formatter.width - 6 - max(len(name) for name in names)
        rows = []
        for name in names:
            command: click.Command | None
            if name in LAZY_COMMANDS:  # a stand-in that only carries the help text
                command = click.Command(name, help=LAZY_COMMANDS[name].short_help)
            else:
                command = super().get_command(ctx, name)
            if command is not None and not command.hidden:
                rows.append((name, command.get_short_help_str(limit)))
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup)
@click.version_option(package_name="outbox-kafka")
@click.pass_context
def main(ctx: click.Context) -> None:
    """Transactional outbox for PostgreSQL and Kafka."""
    if ctx.invoked_subcommand not in DAEMONS:  # a daemon installs handlers of its own
        early_stop.release()


@main.group()
def db() -> None:
    """Create and upgrade the outbox table (the outbox's own Alembic history)."""


@db.command("upgrade")
@DATABASE_URL
@SCHEMA
@TABLE
@click.option("--revision", default="head", show_default=True)
@click.option("--sql", is_flag=True, help="Print the SQL instead of running it.")
@click.option(
    "--partitioned",
    type=click.Choice(["daily", "hourly"]),
    help="Create the table partitioned by time (docs/retention.md).",
)
def db_upgrade(
    database_url: str, schema: str, table: str, revision: str, sql: bool, partitioned: str | None
) -> None:
    """Create the outbox table or bring it up to date."""
    from outbox import migrate

    spec = table_spec(schema, table)
    run_db_step(
        lambda: migrate.upgrade(database_url, spec, revision, sql=sql, partitioned=partitioned)
    )


@db.command("downgrade")
@DATABASE_URL
@SCHEMA
@TABLE
@click.option("--revision", default="base", show_default=True, help="'base' drops the table.")
@click.option("--sql", is_flag=True, help="Print the SQL instead of running it.")
def db_downgrade(database_url: str, schema: str, table: str, revision: str, sql: bool) -> None:
    """Step the outbox table back to an earlier revision."""
    from outbox import migrate

    run_db_step(
        lambda: migrate.downgrade(database_url, table_spec(schema, table), revision, sql=sql)
    )


@db.command("current")
@DATABASE_URL
@SCHEMA
@TABLE
def db_current(database_url: str, schema: str, table: str) -> None:
    """Show the outbox table's revision."""
    from outbox import migrate

    run_db_step(lambda: migrate.current(database_url, table_spec(schema, table)))


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

    Prepared messages rolled back (scheduled ones cancelled) before the cut-off go too (they
    were never published); messages waiting for a verdict or for their time never do.
    Refuses a cut-off the nightly reconciliation may still read (the previous UTC day, with
    its grace period) unless --ignore-audit-window is given.
    """
    from datetime import UTC

    import sqlalchemy as sa

    from outbox.durations import parse_duration
    from outbox.retention import audit_refusal, purge_sent

    try:
        age = parse_duration(older_than)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--older-than") from exc
    now = datetime.now(UTC)
    cutoff = now - age
    too_recent = audit_refusal(now, cutoff)
    if too_recent and not (dry_run or ignore_audit_window):
        raise click.ClickException(too_recent)
    spec = table_spec(schema, table)
    engine = sa.create_engine(database_url)
    try:
        count = run_db_step(
            lambda: purge_sent(
                engine, age, spec=spec, batch_size=batch_size, now=now, dry_run=dry_run
            )
        )
    finally:
        engine.dispose()
    what = (
        f"sent and rolled-back rows older than {older_than} "
        f"(created and sent, or rolled back, before {cutoff:%Y-%m-%d %H:%M:%S} UTC)"
    )
    if dry_run:
        click.echo(f"would delete {count} {what}; dry run, nothing deleted")
        if too_recent and not ignore_audit_window:
            click.echo(f"a real run would be refused: {too_recent}")
    else:
        click.echo(f"deleted {count} {what}")


@main.command()
@DATABASE_URL
@SCHEMA
@TABLE
@click.option("--json", "as_json", is_flag=True, help="One JSON object instead of a table.")
@click.option(
    "--exact",
    is_flag=True,
    help="Count sent, dead, rolled-back and cancelled rows per topic exactly: one scan of the "
    "whole table (without it they are estimates from the planner's statistics, for the whole "
    "table).",
)
@click.option(
    "--inbox-schema",
    envvar="OUTBOX_INBOX_SCHEMA",
    show_envvar=True,
    default="public",
    show_default=True,
    help="Schema of the inbox tables whose parked rows to count, if they are in this database.",
)
@click.option(
    "--inbox-table",
    envvar="OUTBOX_INBOX_TABLE",
    show_envvar=True,
    default="inbox",
    show_default=True,
    help="Name of the inbox table (parked rows: <name>_parked).",
)
@click.option(
    "--bootstrap-servers",
    default=None,
    help="Also read the inbox's consumer groups' lag from these Kafka brokers "
    "(OUTBOX_KAFKA_<NAME> variables give the client's other settings).",
)
def status(
    database_url: str,
    schema: str,
    table: str,
    as_json: bool,
    exact: bool,
    inbox_schema: str,
    inbox_table: str,
    bootstrap_servers: str | None,
) -> None:
    """Where every message stands: counts per topic and status, the oldest pending message,
    the relays and the shards each owns, prepared and scheduled messages waiting (overdue
    ones too), parked inbox rows.

    Cheap on a large table: pending, prepared and scheduled rows are read through their
    partial indexes, the other statuses estimated unless --exact is given. In a consumer's
    own database (inbox tables, no outbox table): the inbox's groups, parked messages and,
    with --bootstrap-servers, lag.
    """
    from outbox.queries import Queries
    from outbox.status import InboxStatus, inbox_groups, read_any_status
    from outbox.status_report import inbox_to_text, to_json, to_text

    queries = Queries(table_spec(schema, table))
    inbox = (inbox_schema, inbox_table)
    with database_engine(database_url) as engine:
        report = run_db_step(lambda: read_any_status(engine, queries, exact=exact, inbox=inbox))
        groups: list[str] = []
        if isinstance(report, InboxStatus):
            groups = report.groups
        elif bootstrap_servers:  # the inbox tables beside the outbox table, if any
            groups = run_db_step(lambda: inbox_groups(engine, inbox))
    if bootstrap_servers:
        from outbox.inbox.config import kafka_config_from_env
        from outbox.inbox.lag import read_lag

        kafka = {**kafka_config_from_env(), "bootstrap.servers": bootstrap_servers}
        report.lag = read_lag(kafka, groups)
    if as_json:
        click.echo(to_json(report))
    else:
        lines = inbox_to_text(report) if isinstance(report, InboxStatus) else to_text(report)
        for line in lines:
            click.echo(line)


@main.group()
def dead() -> None:
    """Inspect, retry and purge messages the relay gave up on."""


@contextmanager
def _dead_store(database_url: str, schema: str, table: str) -> Iterator[tuple[Any, Any]]:
    """An engine (disposed afterwards, whatever happens) and the table's named queries."""
    from outbox.queries import Queries

    queries = Queries(table_spec(schema, table))
    with database_engine(database_url) as engine:
        yield engine, queries


@dead.command("list")
@DATABASE_URL
@SCHEMA
@TABLE
@click.option("--topic", default=None)
@click.option("--limit", default=50, show_default=True)
@click.option(
    "--by-reason",
    is_flag=True,
    help="Group them by cause (error class + message with numbers, ids, hex and quoted "
    "values left out): one line per FINGERPRINT, with counts and first/last written.",
)
def dead_list(
    database_url: str, schema: str, table: str, topic: str | None, limit: int, by_reason: bool
) -> None:
    """List dead messages, newest first (or grouped by cause, the largest group first)."""

    def run(engine: Any, queries: Any) -> None:
        if by_reason:
            from outbox.failed_rows import dead_rows
            from outbox.fingerprints import by_reason_lines

            with engine.connect() as conn:
                found = dead_rows(conn, queries, topic)
            for line in by_reason_lines(found, limit, seen="written", noun="dead message(s)"):
                click.echo(line)
            return
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
        run_db_step(lambda: run(engine, queries))


@dead.command("show")
@DATABASE_URL
@SCHEMA
@TABLE
@click.argument("message_id", type=click.UUID)
def dead_show(database_url: str, schema: str, table: str, message_id: object) -> None:
    """Show one message, every column."""

    def run(engine: Any, queries: Any) -> None:
        from outbox.operator import find_message

        with engine.connect() as conn:
            row = find_message(conn, queries, message_id)  # type: ignore[arg-type]
        if row is None:
            raise OutboxError(f"no message {message_id}")
        for name, value in row.items():
            if isinstance(value, bytes):
                value = value.decode(errors="replace")
            click.echo(f"{name:>16}  {value}")

    with _dead_store(database_url, schema, table) as (engine, queries):
        run_db_step(lambda: run(engine, queries))


def _dead_bulk(action: DeadAction, verb: str):  # type: ignore[no-untyped-def]
    @message_selection("Only this topic's dead messages.", "Every dead message.")
    @click.option(
        "--reason",
        default=None,
        metavar="FINGERPRINT",
        help="Only the dead messages of this cause (a FINGERPRINT of `dead list --by-reason`).",
    )
    def command(
        database_url: str,
        schema: str,
        table: str,
        topic: str | None,
        everything: bool,
        message_ids: tuple[object, ...],
        reason: str | None,
    ) -> None:
        if not (message_ids or topic or everything or reason):
            raise click.UsageError("name message ids, or pass --topic, --reason or --all")
        if reason is not None and (message_ids or everything):
            raise click.UsageError("--reason picks the messages: give no ids and no --all")

        def run(engine: Any, queries: Any) -> int:
            from outbox.operator import act_on_dead

            with engine.begin() as conn:
                ids: list[Any] = list(message_ids)  # click.UUID made them UUIDs
                return act_on_dead(conn, queries, action, ids=ids, topic=topic, reason=reason)

        with _dead_store(database_url, schema, table) as (engine, queries):
            count = run_db_step(lambda: run(engine, queries))
        click.echo(f"{verb} {count} dead message(s)")

    return command


dead.command("retry", help="Put dead messages back to pending, with a fresh attempt count.")(
    _dead_bulk("retry_dead", "requeued")
)
dead.command("purge", help="Delete dead messages.")(_dead_bulk("purge_dead", "deleted"))


if __name__ == "__main__":
    main()
