"""Options shared by the ``outbox`` sub-commands (the relay's, the reconciliation's, the
inbox's and check-back's)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import click

from outbox.errors import OutboxError
from outbox.redaction import mask_secrets
from outbox.schema import OutboxTableSpec

if TYPE_CHECKING:
    import sqlalchemy as sa

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

DATABASE_URL = click.option(
    "--database-url",
    envvar="OUTBOX_DATABASE_URL",
    show_envvar=True,
    required=True,
    help="SQLAlchemy URL, e.g. postgresql+psycopg://user:pw@host/db",
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


LOG_LEVEL = click.option(
    "--log-level", default="INFO", show_default=True, envvar="OUTBOX_LOG_LEVEL", show_envvar=True
)


def metrics_options(env_prefix: str) -> Callable[[Any], Any]:
    """``--metrics-port`` and ``--metrics-host`` of a daemon, read from
    ``<env_prefix>_METRICS_PORT`` and ``<env_prefix>_METRICS_HOST`` too."""
    port = click.option(
        "--metrics-port",
        type=int,
        default=None,
        envvar=f"{env_prefix}_METRICS_PORT",
        show_envvar=True,
        help="Serve /metrics, /healthz and /readyz on this port (0: any free port).",
    )
    host = click.option(
        "--metrics-host",
        default="127.0.0.1",
        show_default=True,
        envvar=f"{env_prefix}_METRICS_HOST",
        show_envvar=True,
        help="Address the metrics and health server listens on (0.0.0.0 in a container).",
    )
    return lambda command: port(host(command))


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


#: SQLSTATEs of a server that is there but not accepting connections yet (or now): shutting
#: down, crashed, starting up, too many connections. A refused or timed-out connection has none.
_NOT_YET = frozenset({"57P01", "57P02", "57P03", "53300", "08001", "08006"})


def database_not_ready(error: BaseException) -> bool:
    """Whether ``error`` says the database is not reachable *yet* (worth waiting for), as
    opposed to a wrong password, a missing database or table, or missing privileges."""
    from sqlalchemy.exc import OperationalError

    if not isinstance(error, OperationalError):
        return False
    return getattr(error.orig, "sqlstate", None) in _NOT_YET | {None}


def waiting_for_database(
    step: Callable[[], T],
    timeout: float,
    stop: Callable[[float], bool],
    warn: Callable[[str], None],
) -> Callable[[], T | None]:
    """``step``, tried again while the database is not ready, for up to ``timeout`` seconds.

    ``stop(seconds)`` waits between tries and returns True when a stop was asked for (the
    step then returns None); ``warn`` reports each wait. Any other failure, or the last one,
    is raised at once.
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
                reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
                warn(f"database not ready ({mask_secrets(reason)}); trying again in {pause:.1f}s")
                if stop(min(pause, left)):
                    return None
                pause = min(10.0, pause * 2)

    return waiting


def run_db_step(step: Callable[[], T]) -> T:
    """Run a database operation; a failure becomes one clear line, not a traceback."""
    from sqlalchemy.exc import SQLAlchemyError

    try:
        return step()
    except OutboxError as exc:
        raise click.ClickException(str(exc)) from exc
    except SQLAlchemyError as exc:
        reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
        if getattr(getattr(exc, "orig", None), "sqlstate", None) == "42703":  # undefined_column
            raise click.ClickException(
                f"the table is older than this version of outbox ({mask_secrets(reason)}): "
                "run `outbox db upgrade`"
            ) from exc
        raise click.ClickException(f"database error: {mask_secrets(reason)}") from exc


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
