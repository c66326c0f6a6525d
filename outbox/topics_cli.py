"""``outbox topics create|check|describe``, registered on the ``outbox`` command line by
``outbox.cli`` (loaded only when named: it loads librdkafka)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from outbox.cli_options import (
    SCHEMA,
    TABLE,
    bootstrap_servers_option,
    database_engine,
    kafka_settings_option,
    parse_key_values,
    psycopg_url_option_value,
    run_db_step,
    table_spec,
)
from outbox.errors import ConfigError
from outbox.redaction import mask_secrets
from outbox.topics import (
    DEFAULT_PARTITIONS,
    DEFAULT_RETENTION,
    TopicSettings,
    merge_names,
    read_topics_file,
)

#: How many of the latest rows `check` and `describe` read for the topics the table uses.
RECENT_ROWS = 10_000

FILE = click.option(
    "--file",
    "topics_file",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar="OUTBOX_TOPICS_FILE",
    show_envvar=True,
    help="A declared-topics file (TOML: [defaults] and one [topics.NAME] per topic; "
    "see docs/topics.md).",
)
KAFKA = kafka_settings_option(
    "A Kafka admin client setting, e.g. -X security.protocol=SASL_SSL (repeatable)."
)
TABLE_DATABASE_URL = click.option(
    "--database-url",
    envvar="OUTBOX_DATABASE_URL",
    show_envvar=True,
    default=None,
    callback=psycopg_url_option_value,
    help="Also take the topics the outbox table uses: those of its pending and prepared rows "
    f"and of its latest {RECENT_ROWS:,} rows.",
)


def topic_selection(command: Callable[..., Any]) -> Callable[..., Any]:
    """The options of the commands that look at topics: NAMES, --file, the table's own topics
    (--database-url, --schema, --table) and the Kafka connection."""
    for option in reversed(
        (
            click.argument("names", nargs=-1),
            FILE,
            TABLE_DATABASE_URL,
            SCHEMA,
            TABLE,
            bootstrap_servers_option(required=True),
            KAFKA,
        )
    ):
        command = option(command)
    return command


def _admin(bootstrap_servers: str, kafka_settings: tuple[str, ...]) -> Any:
    from outbox.inbox.config import kafka_config_from_env
    from outbox.topic_admin import TopicAdmin

    return TopicAdmin(
        {
            **kafka_config_from_env(),
            **parse_key_values(kafka_settings),
            "bootstrap.servers": bootstrap_servers,
        }
    )


def _declared(
    names: tuple[str, ...], topics_file: Path | None, **options: Any
) -> list[TopicSettings]:
    try:
        from_file = read_topics_file(topics_file) if topics_file else []
        return merge_names(names, from_file, **options)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc


def _table_topics(database_url: str, schema: str, table: str) -> list[str]:
    from outbox.queries import Queries

    queries = Queries(table_spec(schema, table))

    def read() -> list[str]:
        with engine.begin() as conn:
            conn.exec_driver_sql("SET LOCAL enable_seqscan = off")  # the partial indexes
            rows = conn.execute(queries["topics_in_use"], {"recent": RECENT_ROWS})
            return sorted(row.topic for row in rows)

    with database_engine(database_url) as engine:
        return run_db_step(read)


def _kafka_step(step: Callable[[], Any]) -> Any:
    try:
        return step()
    except ConfigError as exc:
        raise click.ClickException(mask_secrets(str(exc))) from exc


@click.group()
def topics() -> None:
    """Create, describe and check the topics the outbox publishes to."""


@topics.command("create")
@click.argument("names", nargs=-1)
@FILE
@bootstrap_servers_option(required=True)
@KAFKA
@click.option(
    "--partitions",
    type=click.IntRange(min=1),
    default=None,
    help=f"Partitions of each new topic [default: {DEFAULT_PARTITIONS}]; pick it up front: "
    "adding partitions later moves keys.",
)
@click.option(
    "--replication-factor",
    type=click.IntRange(min=1),
    default=None,
    help="Replicas of each partition [default: 3, or the number of brokers if fewer].",
)
@click.option(
    "--min-insync-replicas",
    type=click.IntRange(min=1),
    default=None,
    help="Replicas that must have a write before acks=all is answered "
    "[default: 2 with 3 replicas or more, else 1].",
)
@click.option(
    "--retention",
    default=None,
    help=f"How long records are kept: 12h, 7d, 2w or 'forever' [default: {DEFAULT_RETENTION}].",
)
@click.option(
    "--config",
    "topic_config",
    multiple=True,
    metavar="KEY=VALUE",
    help="Any other topic setting, e.g. --config compression.type=lz4 (repeatable).",
)
@click.option("--dry-run", is_flag=True, help="Ask the brokers to validate; create nothing.")
def create(
    names: tuple[str, ...],
    topics_file: Path | None,
    bootstrap_servers: str,
    kafka_settings: tuple[str, ...],
    partitions: int | None,
    replication_factor: int | None,
    min_insync_replicas: int | None,
    retention: str | None,
    topic_config: tuple[str, ...],
    dry_run: bool,
) -> None:
    """Create the topics NAMES (and those of --file) that do not exist yet.

    An existing topic is left as it is (`outbox topics check` says how it differs).
    """
    if not (names or topics_file):
        raise click.UsageError("name topics, or pass --file")
    declared = _declared(
        names,
        topics_file,
        partitions=partitions,
        replication_factor=replication_factor,
        min_insync_replicas=min_insync_replicas,
        retention=retention,
        config=parse_key_values(topic_config, "--config"),
    )
    admin = _admin(bootstrap_servers, kafka_settings)
    for name, outcome in _kafka_step(lambda: admin.create(declared, dry_run=dry_run)):
        click.echo(f"{name}: {outcome}")


def _names_to_look_at(
    names: tuple[str, ...],
    topics_file: Path | None,
    database_url: str | None,
    schema: str,
    table: str,
) -> tuple[list[str], dict[str, TopicSettings]]:
    declared = _declared(names, topics_file)
    wanted = {t.name: t for t in declared}
    listed = list(wanted)
    if database_url:
        listed += [t for t in _table_topics(database_url, schema, table) if t not in wanted]
    if not listed:
        raise click.UsageError(
            "no topic to look at: name topics, pass --file, or --database-url for the "
            "topics the outbox table uses"
        )
    return listed, wanted


@topics.command("describe")
@topic_selection
def describe(
    names: tuple[str, ...],
    topics_file: Path | None,
    database_url: str | None,
    schema: str,
    table: str,
    bootstrap_servers: str,
    kafka_settings: tuple[str, ...],
) -> None:
    """Show each topic's partitions, replicas in sync and settings."""
    from outbox.topic_admin import describe_line

    listed, _ = _names_to_look_at(names, topics_file, database_url, schema, table)
    admin = _admin(bootstrap_servers, kafka_settings)
    states = _kafka_step(lambda: admin.describe(listed))
    width = max(len(name) for name in listed)
    for name in listed:
        state = states[name]
        click.echo(f"{name:<{width}}  " + ("MISSING" if state is None else describe_line(state)))


@topics.command("check")
@topic_selection
def check(
    names: tuple[str, ...],
    topics_file: Path | None,
    database_url: str | None,
    schema: str,
    table: str,
    bootstrap_servers: str,
    kafka_settings: tuple[str, ...],
) -> None:
    """Exit 1, naming each, when a topic is missing, has a partition without a leader or
    fewer replicas in sync than it has (or than declared); warn about risky settings.

    The topics are NAMES, those of --file, and with --database-url those the outbox table
    uses (its pending and prepared rows', and its latest rows').
    """
    from outbox.topic_admin import check as find_problems
    from outbox.topic_admin import describe_line

    listed, wanted = _names_to_look_at(names, topics_file, database_url, schema, table)
    admin = _admin(bootstrap_servers, kafka_settings)
    states = _kafka_step(lambda: admin.describe(listed))
    findings = find_problems(states, wanted, _kafka_step(admin.brokers))
    width = max(len(name) for name in listed)
    for name in listed:
        state = states[name]
        problems = [f for f in findings if f.topic == name and not f.warning]
        verdict = ", ".join(dict.fromkeys(str(f.problem).upper() for f in problems)) or "ok"
        click.echo(f"{name:<{width}}  {verdict}" + (f"  {describe_line(state)}" if state else ""))
        for finding in (f for f in findings if f.topic == name):
            click.echo(
                f"{'':<{width}}    {'warning' if finding.warning else 'problem'}: {finding.detail}"
            )
    failed = [f for f in findings if not f.warning]
    if failed:
        named = "; ".join(f"{f.topic} {f.problem}" for f in failed)
        click.echo(f"check failed: {named}", err=True)
        sys.exit(1)
    click.echo(f"{len(listed)} topic(s) ok")
