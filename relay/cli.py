"""``outbox relay``: the relay daemon's command line.

Only click and the library's option helpers load with this module; the daemon, librdkafka and
the Prometheus client load when the command runs.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import click

from outbox.cli_options import (
    DATABASE_URL,
    SCHEMA,
    TABLE,
    bootstrap_servers_option,
    check_database_at_start,
    daemon_options,
    kafka_settings_option,
    parse_key_values,
    table_spec,
)
from outbox.errors import OutboxError
from outbox.redaction import mask_secrets

if TYPE_CHECKING:
    import sqlalchemy as sa


@click.command()
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
    "--rebalance-interval",
    default=0.5,
    show_default=True,
    envvar="OUTBOX_RELAY_REBALANCE_INTERVAL",
    show_envvar=True,
    help="Seconds between looks at the other relays: a dead relay's shards, or a joining "
    "relay's share, move within about this long.",
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
    "--durable-marks",
    is_flag=True,
    envvar="OUTBOX_RELAY_DURABLE_MARKS",
    show_envvar=True,
    help="At-least-once: wait for the disk flush of every mark, so that a database crash "
    "sends no acknowledged row again (exactly-once marks always wait).",
)
@click.option(
    "--wedge-timeout",
    default=90.0,
    show_default=True,
    envvar="OUTBOX_RELAY_WEDGE_TIMEOUT",
    show_envvar=True,
    help="Seconds a mark (recording what Kafka answered for a batch) or a shard's take-over "
    "may last before /healthz answers 503 wedged (a take-over gives up after 25 s on its own).",
)
@click.option(
    "--shutdown-timeout",
    default=30.0,
    show_default=True,
    envvar="OUTBOX_RELAY_SHUTDOWN_TIMEOUT",
    show_envvar=True,
    help="Seconds a SIGTERM may wait for the batch in hand.",
)
@daemon_options("OUTBOX_RELAY")
def relay(
    database_url: str,
    schema: str,
    table: str,
    bootstrap_servers: str,
    kafka_settings: tuple[str, ...],
    mode: str,
    batch_size: int,
    poll_interval: float,
    rebalance_interval: float,
    max_attempts: int,
    backoff_base: float,
    backoff_max: float,
    delivery_timeout_ms: int,
    transactional_id_prefix: str | None,
    progress_topic: str | None,
    delete_on_send: bool,
    durable_marks: bool,
    wedge_timeout: float,
    shutdown_timeout: float,
    metrics_port: int | None,
    metrics_host: str,
    start_timeout: float,
    log_level: str,
    log_format: str | None,
) -> None:
    """Publish pending outbox rows to Kafka until stopped (SIGTERM/SIGINT)."""
    import signal
    import threading

    # A stop asked for while starting up is honoured as soon as the loop exists.
    stop_early = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop_early.set())

    from outbox.logs import configure_logging
    from outbox.relay.config import RelayConfig, kafka_config_from_env
    from outbox.relay.daemon import Relay, tune_garbage_collector
    from outbox.relay.policy import RetryPolicy

    configure_logging(log_level, log_format)
    kafka = {
        **kafka_config_from_env(),
        **parse_key_values(kafka_settings),
        "bootstrap.servers": bootstrap_servers,
    }
    try:
        config = RelayConfig(
            database_url=database_url,
            kafka=kafka,
            spec=table_spec(schema, table),
            mode=mode,
            batch_size=batch_size,
            poll_interval=poll_interval,
            rebalance_interval=rebalance_interval,
            delivery_timeout_ms=delivery_timeout_ms,
            retry=RetryPolicy(max_attempts, backoff_base, backoff_max),
            transactional_id_prefix=transactional_id_prefix,
            progress_topic=progress_topic,
            metrics_port=metrics_port,
            metrics_host=metrics_host,
            delete_on_send=delete_on_send,
            durable_marks=durable_marks,
            shutdown_timeout=shutdown_timeout,
            wedge_timeout=wedge_timeout,
        )
        started = check_database_at_start(
            database_url,
            _relay_access_problem(config),
            start_timeout,
            stop=stop_early.wait,
            log=logging.getLogger("outbox.relay"),
        )
    except (OutboxError, ValueError) as exc:
        raise click.ClickException(mask_secrets(str(exc))) from exc
    if not started:  # stopped while it waited for the database
        sys.exit(0)
    daemon = Relay(config)
    daemon.install_signal_handlers()
    tune_garbage_collector()
    if stop_early.is_set():
        daemon.stop()
    sys.exit(daemon.run())


def _relay_access_problem(config: object) -> Callable[[sa.Engine], str | None]:
    """Why the relay cannot work on the table (missing, not upgraded, no privileges)."""

    def problem(engine: sa.Engine) -> str | None:
        import sqlalchemy as sa

        from outbox.relay.config import RelayConfig

        assert isinstance(config, RelayConfig)
        spec = config.spec
        with engine.connect() as conn:
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
                    " AND attname = 'deliver_at' AND NOT attisdropped)"
                    " FROM (SELECT to_regclass(:name) AS oid) AS t"
                ),
                {"name": spec.qualified_name},
            ).one()
        if not row[0]:
            return f"table {spec.qualified_name} does not exist: run `outbox db upgrade`"
        if not row[1]:
            return (
                f"role {engine.url.username} needs SELECT and UPDATE "
                f"on {spec.qualified_name} (see docs/relay.md, 'Database role')"
            )
        if not row[2]:
            return f"table {spec.qualified_name} is older than this relay: run `outbox db upgrade`"
        return None

    return problem
