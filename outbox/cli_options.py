"""Options shared by the ``outbox`` sub-commands (the relay's, the reconciliation's, the
inbox's and check-back's)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import click

from outbox.database_errors import database_not_ready, first_line
from outbox.errors import ConfigError, OutboxError
from outbox.redaction import mask_secrets
from outbox.schema import OutboxTableSpec

if TYPE_CHECKING:
    import sqlalchemy as sa

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])


def psycopg_url_option_value(
    _ctx: click.Context, _param: click.Parameter, url: str | None
) -> str | None:
    # A usage error would print three lines (usage, hint, error); this one is one line.
    from outbox.engines import database_url

    try:
        return None if url is None else database_url(url)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc


DATABASE_URL = click.option(
    "--database-url",
    envvar="OUTBOX_DATABASE_URL",
    show_envvar=True,
    required=True,
    callback=psycopg_url_option_value,
    help="e.g. postgresql+psycopg://user:pw@host/db; postgres:// and postgresql:// mean "
    "the same (psycopg 3).",
)
SCHEMA = click.option(
    "--schema",
    envvar="OUTBOX_SCHEMA",
    show_envvar=True,
    default="public",
    show_default=True,
    help="Schema of the outbox table",
)
TABLE = click.option(
    "--table",
    envvar="OUTBOX_TABLE",
    show_envvar=True,
    default="outbox",
    show_default=True,
    help="Name of the outbox table",
)

INBOX_SCHEMA = click.option(
    "--inbox-schema",
    envvar="OUTBOX_INBOX_SCHEMA",
    show_envvar=True,
    default="public",
    show_default=True,
    help="Schema of the inbox tables",
)
INBOX_TABLE = click.option(
    "--inbox-table",
    envvar="OUTBOX_INBOX_TABLE",
    show_envvar=True,
    default="inbox",
    show_default=True,
    help="Name of the inbox table (parked messages: <name>_parked)",
)


def database_outage_limit_option(env_prefix: str) -> Callable[[F], F]:
    """``--database-outage-limit`` (``<env_prefix>_DATABASE_OUTAGE_LIMIT``) of the daemons that
    answer ``/healthz`` by the database's reach: the consumer and the check-back runner."""
    return click.option(
        "--database-outage-limit",
        default=120.0,
        show_default=True,
        envvar=f"{env_prefix}_DATABASE_OUTAGE_LIMIT",
        show_envvar=True,
        help="Seconds the database may stay out of reach before /healthz reports unhealthy.",
    )


def daemon_options(env_prefix: str) -> Callable[[F], F]:
    """The options every daemon has: ``--metrics-port``, ``--metrics-host``,
    ``--start-timeout`` (read from ``<env_prefix>_METRICS_PORT``, ``..._METRICS_HOST`` and
    ``..._START_TIMEOUT`` too), ``--log-level`` and ``--log-format``."""
    from outbox.logs import LOG_FORMATS

    options = (
        click.option(
            "--metrics-port",
            type=int,
            default=None,
            envvar=f"{env_prefix}_METRICS_PORT",
            show_envvar=True,
            help="Serve /metrics, /healthz and /readyz on this port (0: any free port).",
        ),
        click.option(
            "--metrics-host",
            default="127.0.0.1",
            show_default=True,
            envvar=f"{env_prefix}_METRICS_HOST",
            show_envvar=True,
            help="Address the metrics and health server listens on (0.0.0.0 in a container).",
        ),
        click.option(
            "--start-timeout",
            default=60.0,
            show_default=True,
            envvar=f"{env_prefix}_START_TIMEOUT",
            show_envvar=True,
            help="Seconds to wait at start for a database that does not accept connections "
            "yet (refused: starting or restarting); a wrong password, a missing database or "
            "table, or missing privileges fail at once.",
        ),
        click.option(
            "--log-level",
            default="INFO",
            show_default=True,
            envvar="OUTBOX_LOG_LEVEL",
            show_envvar=True,
        ),
        click.option(
            "--log-format",
            type=click.Choice(LOG_FORMATS),
            default=None,
            envvar="OUTBOX_LOG_FORMAT",
            show_envvar=True,
            help="json: one JSON object per line; text: readable lines. "
            "Default: text on a terminal, json otherwise.",
        ),
    )

    def apply(command: F) -> F:
        for option in reversed(options):
            command = option(command)
        return command

    return apply


def message_selection(topic_help: str, all_help: str) -> Callable[[F], F]:
    """The options of a command that acts on messages of the outbox table: the table,
    ``--topic``, ``--all`` and the ids given as arguments (``message_ids``)."""

    def apply(command: F) -> F:
        for decorator in reversed(
            (
                DATABASE_URL,
                SCHEMA,
                TABLE,
                click.option("--topic", default=None, help=topic_help),
                click.option("--all", "everything", is_flag=True, help=all_help),
                click.argument("message_ids", nargs=-1, type=click.UUID),
            )
        ):
            command = decorator(command)
        return command

    return apply


def modules_from_working_directory() -> None:
    """Let a MODULE:ATTRIBUTE argument name a module in the working directory, as
    ``python -m`` does."""
    import sys

    if "." not in sys.path and "" not in sys.path:
        sys.path.insert(0, "")


def bootstrap_servers_option(*, required: bool) -> Callable[[Any], Any]:
    return click.option(
        "--bootstrap-servers",
        envvar="OUTBOX_KAFKA_BOOTSTRAP_SERVERS",
        show_envvar=True,
        required=required,
        help="Kafka bootstrap servers",
    )


def kafka_settings_option(help_text: str) -> Callable[[Any], Any]:
    """``-X KEY=VALUE`` (repeatable), read with :func:`parse_key_values`."""
    return click.option(
        "-X", "--kafka", "kafka_settings", multiple=True, metavar="KEY=VALUE", help=help_text
    )


def parse_key_values(settings: tuple[str, ...], option: str = "-X") -> dict[str, str]:
    """``("acks=all", ...)`` -> ``{"acks": "all"}``; a setting without ``=`` is a usage error."""
    parsed = {}
    for setting in settings:
        key, sep, value = setting.partition("=")
        if not sep or not key.strip():
            raise click.BadParameter(f"{setting!r} is not KEY=VALUE", param_hint=option)
        parsed[key.strip()] = value
    return parsed


def table_spec(schema: str, table: str) -> OutboxTableSpec:
    """The table ``--schema`` and ``--table`` name; a bad identifier is a usage error."""
    try:
        return OutboxTableSpec(schema=schema, table=table)
    except OutboxError as exc:
        raise click.BadParameter(str(exc)) from exc


def on_stop_signals(stop: Callable[[], None], log: logging.Logger, doing: str) -> None:
    """On SIGTERM or SIGINT: log the signal and what the daemon does now, then ``stop()``."""
    import signal

    def handle(signum: int, _frame: object) -> None:
        log.info("%s received: %s", signal.Signals(signum).name, doing)
        stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handle)


def waiting_for_database(
    step: Callable[[], T],
    timeout: float,
    stop: Callable[[float], bool],
    warn: Callable[[str], None],
) -> Callable[[], T | None]:
    """``step``, tried again while the database is not ready, for up to ``timeout`` seconds.

    ``stop(seconds)`` waits between tries and returns True when a stop was asked for (the
    step then returns None); ``warn`` reports each wait. Any other failure, or the last one,
    is raised at once (see :func:`outbox.database_errors.database_not_ready`).
    """
    import time

    def waiting() -> T | None:
        deadline = time.monotonic() + timeout
        pause = 0.5
        while True:
            try:
                return step()
            except Exception as exc:
                left = deadline - time.monotonic()
                if not database_not_ready(exc) or left <= 0:
                    raise
                warn(f"database not ready ({first_line(exc)}); trying again in {pause:.1f}s")
                if stop(min(pause, left)):
                    return None
                pause = min(10.0, pause * 2)

    return waiting


def check_database_at_start(
    url: str,
    problem: Callable[[sa.Engine], str | None],
    timeout: float,
    stop: Callable[[float], bool],
    log: logging.Logger,
) -> bool:
    """A daemon's check before it starts: ``problem(engine)`` says why the daemon cannot
    work on this database (a missing table, a privilege), or None.

    A database that does not accept connections yet is waited for, up to ``timeout``
    seconds, each try logged; anything else (that, or a wrong password, a missing database)
    raises :class:`click.ClickException` with one line. False when ``stop`` was asked for
    meanwhile.
    """
    import sqlalchemy as sa
    from sqlalchemy.pool import NullPool

    def check() -> bool:
        engine = sa.create_engine(url, poolclass=NullPool, connect_args={"connect_timeout": 10})
        try:
            found = problem(engine)
        finally:
            engine.dispose()
        if found:
            raise OutboxError(found)
        return True

    return run_db_step(waiting_for_database(check, timeout, stop, log.warning)) is not None


def run_db_step(step: Callable[[], T]) -> T:
    """Run a database operation; a failure becomes one clear line, not a traceback."""
    from sqlalchemy.exc import SQLAlchemyError

    try:
        return step()
    except OutboxError as exc:
        raise click.ClickException(mask_secrets(str(exc))) from exc
    except SQLAlchemyError as exc:
        reason = first_line(exc)
        if getattr(getattr(exc, "orig", None), "sqlstate", None) == "42703":  # undefined_column
            raise click.ClickException(
                f"the table is older than this version of outbox ({reason}): "
                "run `outbox db upgrade`"
            ) from exc
        raise click.ClickException(f"database error: {reason}") from exc


@contextmanager
def database_engine(database_url: str, **options: Any) -> Iterator[sa.Engine]:
    """An engine for one command (``options`` go to ``create_engine``), disposed afterwards
    whatever happens."""
    import sqlalchemy as sa

    engine = sa.create_engine(database_url, **options)
    try:
        yield engine
    finally:
        engine.dispose()
