"""``outbox dashboard``, registered on the ``outbox`` command line by ``outbox.cli``."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

import click

from outbox.cli_options import (
    DATABASE_URL,
    INBOX_SCHEMA,
    INBOX_TABLE,
    SCHEMA,
    TABLE,
    bootstrap_servers_option,
    kafka_settings_option,
    on_stop_signals,
    parse_key_values,
    psycopg_url_option_value,
    run_db_step,
    table_spec,
)
from outbox.errors import OutboxError

if TYPE_CHECKING:
    import sqlalchemy as sa

    from outbox.queries import Queries

MISSING_EXTRA = (
    "the dashboard needs Jinja2, in the 'dashboard' extra: pip install 'outbox-kafka[dashboard]'"
)


@click.command()
@DATABASE_URL
@SCHEMA
@TABLE
@click.option(
    "--inbox-database-url",
    envvar="OUTBOX_INBOX_DATABASE_URL",
    show_envvar=True,
    default=None,
    callback=psycopg_url_option_value,
    help="The database of the inbox tables (a consumer's); default: --database-url.",
)
@INBOX_SCHEMA
@INBOX_TABLE
@bootstrap_servers_option(required=False)
@kafka_settings_option(
    "A Kafka admin client setting for reading the consumers' lag (repeatable); "
    "OUTBOX_KAFKA_<NAME> variables work too."
)
@click.option(
    "--host",
    envvar="OUTBOX_DASHBOARD_HOST",
    show_envvar=True,
    default="127.0.0.1",
    show_default=True,
    help="Address to listen on; anything but loopback needs --allow-remote.",
)
@click.option(
    "--port",
    envvar="OUTBOX_DASHBOARD_PORT",
    show_envvar=True,
    type=click.IntRange(0, 65535),
    default=8321,
    show_default=True,
    help="Port to listen on (0: any free port).",
)
@click.option(
    "--allow-remote",
    is_flag=True,
    help="Listen on a --host that is not loopback (prints a warning: put it behind TLS and "
    "an authenticating proxy).",
)
@click.option(
    "--token",
    envvar="OUTBOX_DASHBOARD_TOKEN",
    show_envvar=True,
    default=None,
    help="The token an operator logs in with to retry, commit or roll back; without one the "
    "dashboard is read-only. Prefer the variable: a command line is visible to other users.",
)
@click.option(
    "--checker",
    "checker_target",
    metavar="MODULE:REGISTRY",
    envvar="OUTBOX_DASHBOARD_CHECKER",
    show_envvar=True,
    default=None,
    help="The service's CheckRegistry (as `outbox prepared rollback --checker` takes it): a "
    "rollback asks the message's checker first and rolls back only on its ROLLBACK. Without "
    "it a rollback needs the operator to tick that the step cannot happen.",
)
@click.option(
    "--check-timeout",
    envvar="OUTBOX_DASHBOARD_CHECK_TIMEOUT",
    show_envvar=True,
    type=click.FloatRange(min=0, min_open=True),
    default=10.0,
    show_default=True,
    help="Seconds each checker may take (with --checker); past it the message is left.",
)
@click.option(
    "--refresh",
    envvar="OUTBOX_DASHBOARD_REFRESH",
    show_envvar=True,
    type=click.FloatRange(min=0),
    default=10.0,
    show_default=True,
    help="Seconds between a page's reloads (0: never).",
)
@click.option(
    "--scan-interval",
    envvar="OUTBOX_DASHBOARD_SCAN_INTERVAL",
    show_envvar=True,
    type=click.FloatRange(min=0),
    default=60.0,
    show_default=True,
    help="Seconds between two reads of the overview's dead counts, sent-in-the-last-hour "
    "counts and lag (each scans more than an index).",
)
@click.option(
    "--log-level", default="INFO", show_default=True, envvar="OUTBOX_LOG_LEVEL", show_envvar=True
)
def dashboard(
    database_url: str,
    schema: str,
    table: str,
    inbox_database_url: str | None,
    inbox_schema: str,
    inbox_table: str,
    bootstrap_servers: str | None,
    kafka_settings: tuple[str, ...],
    host: str,
    port: int,
    allow_remote: bool,
    token: str | None,
    checker_target: str | None,
    check_timeout: float,
    refresh: float,
    scan_interval: float,
    log_level: str,
) -> None:
    """Serve a web page for operators: messages pending, dead, parked or prepared.

    The overview (what is pending, dead, parked, prepared or scheduled; the relays and
    their shards; the consumers), dead and parked messages by cause with their retries,
    prepared messages with their commit and rollback (the rules of `outbox prepared
    rollback`: through --checker's checkers, or on the operator's word that the step cannot
    happen), a message looked up by id (docs/dashboard.md). Reads the outbox's database and
    the inbox's (--inbox-database-url); read-only unless started with a token. Stops on
    SIGTERM or SIGINT.
    """
    try:
        import jinja2  # noqa: F401
    except ImportError:
        raise click.ClickException(MISSING_EXTRA) from None
    import sqlalchemy as sa

    from outbox.dashboard.app import Dashboard
    from outbox.dashboard.guard import Guard
    from outbox.dashboard.reads import Reads
    from outbox.dashboard.server import check_bind, serve
    from outbox.inbox.schema import InboxTableSpec
    from outbox.logs import configure_logging
    from outbox.prepared.cli import load_checkers
    from outbox.queries import Queries

    configure_logging(log_level, None)
    log = logging.getLogger("outbox.dashboard")
    try:
        warning = check_bind(host, allow_remote)
        inbox_spec = InboxTableSpec(schema=inbox_schema, table=inbox_table)
        guard = Guard(token)
    except (OutboxError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    checkers = load_checkers(checker_target)
    kafka = None
    if bootstrap_servers:
        from outbox.inbox.config import kafka_config_from_env

        kafka = {
            **kafka_config_from_env(),
            **parse_key_values(kafka_settings),
            "bootstrap.servers": bootstrap_servers,
        }
    queries = Queries(table_spec(schema, table))
    outbox_engine = sa.create_engine(database_url, pool_pre_ping=True)
    same = inbox_database_url in (None, database_url)
    inbox_engine = (
        outbox_engine if same else sa.create_engine(inbox_database_url or "", pool_pre_ping=True)
    )
    try:
        run_db_step(lambda: _check_table(outbox_engine, queries))
        reads = Reads(
            outbox_engine, queries, inbox_engine, inbox_spec, kafka=kafka,
            scan_interval=scan_interval,
        )  # fmt: skip
        sources = [f"outbox {outbox_engine.url.render_as_string(hide_password=True)}"]
        if not same:
            sources.append(f"inbox {inbox_engine.url.render_as_string(hide_password=True)}")
        app = Dashboard(
            reads, guard, refresh=refresh, loopback_only=warning is None, sources=sources,
            checkers=checkers, check_timeout=check_timeout,
        )  # fmt: skip
        try:
            server = serve(app, host, port)
        except OSError as exc:
            raise click.ClickException(f"cannot listen on {host}:{port}: {exc}") from exc
        if warning:
            click.echo(warning, err=True)
        bound_host, bound_port = str(server.server_address[0]), int(server.server_address[1])
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        mode = "read-only: no token" if guard.read_only else "actions need the token"
        if checker_target and not guard.read_only:
            mode += f"; rollbacks ask {checker_target}"
        click.echo(f"outbox dashboard on http://{shown}:{bound_port}/ ({mode})")
        on_stop_signals(
            lambda: threading.Thread(target=server.shutdown).start(), log, "stopping the dashboard"
        )
        server.serve_forever()
        server.server_close()
    finally:
        outbox_engine.dispose()
        inbox_engine.dispose()


def _check_table(engine: sa.Engine, queries: Queries) -> None:
    """Fail at start on a database that cannot be reached or has no outbox table."""
    import sqlalchemy as sa

    name = queries.spec.qualified_name
    with engine.connect() as conn:
        found = conn.execute(sa.text("SELECT to_regclass(:n) IS NOT NULL"), {"n": name})
        if not found.scalar_one():
            raise OutboxError(f"table {name} does not exist: run `outbox db upgrade`")
