"""Options shared by the ``outbox`` sub-commands (the relay's and the reconciliation's)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from outbox.errors import OutboxError
from outbox.redaction import mask_secrets
from outbox.schema import OutboxTableSpec

T = TypeVar("T")

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
        raise click.ClickException(f"database error: {mask_secrets(reason)}") from exc
