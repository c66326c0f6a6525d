"""The dead-letter side of ``outbox inbox parked retry``: ``--dead-letter`` reads dead
letters from Kafka and requeues (or puts back) the parked rows they stand for."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from outbox.cli_options import bootstrap_servers_option, kafka_settings_option, parse_key_values
from outbox.errors import OutboxError
from outbox.inbox.config import kafka_config_from_env
from outbox.inbox.dead_letter_retry import DeadLetter, parse_coordinates, read_dead_letter
from outbox.redaction import mask_secrets


def dead_letter_options(command: Callable[..., None]) -> Callable[..., None]:
    """``--dead-letter``, ``--bootstrap-servers`` and ``-X`` for ``parked retry``."""
    command = click.option(
        "--dead-letter",
        "dead_letters",
        multiple=True,
        metavar="TOPIC:PARTITION:OFFSET",
        help="The message a dead letter stands for, read from Kafka (repeatable; nothing "
        "else picks messages then). A parked row purged since is put back from it.",
    )(command)
    command = bootstrap_servers_option(required=False)(command)
    option = kafka_settings_option("A Kafka setting for reading dead letters (repeatable).")
    with_kafka: Callable[..., None] = option(command)
    return with_kafka


def read_dead_letters(
    places: tuple[str, ...], bootstrap_servers: str | None, kafka_settings: tuple[str, ...]
) -> list[DeadLetter]:
    """The dead letters at ``places`` (``TOPIC:PARTITION:OFFSET`` each), read from Kafka."""
    if not bootstrap_servers:
        raise click.UsageError("--dead-letter reads Kafka: pass --bootstrap-servers")
    kafka = {
        **kafka_config_from_env(),
        **parse_key_values(kafka_settings),
        "bootstrap.servers": bootstrap_servers,
    }
    try:
        return [read_dead_letter(kafka, *parse_coordinates(place)) for place in places]
    except OutboxError as exc:
        raise click.ClickException(mask_secrets(str(exc))) from exc


def requeue_dead_letters(engine: Any, store: Any, letters: list[DeadLetter]) -> int:
    """Requeue in one transaction; returns how many parked rows were put back."""
    with engine.begin() as conn:
        return sum(bool(store.requeue_dead_letter(conn, letter)) for letter in letters)
