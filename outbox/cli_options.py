"""Options shared by the ``outbox`` sub-commands (the relay's and the reconciliation's)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

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
