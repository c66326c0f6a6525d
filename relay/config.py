"""The relay's settings, validated in one place."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from outbox.errors import ConfigError
from outbox.relay.policy import RetryPolicy
from outbox.schema import OutboxTableSpec

AT_LEAST_ONCE = "at-least-once"
EXACTLY_ONCE = "exactly-once"

#: Environment variables OUTBOX_KAFKA_<NAME> become Kafka settings: OUTBOX_KAFKA_SASL_PASSWORD
#: -> sasl.password. Dots are underscores; a double underscore stands for a literal one.
KAFKA_ENV_PREFIX = "OUTBOX_KAFKA_"

_SECRET_KEYS = re.compile(r"(password|secret|token|credential|private|key\.pem)", re.IGNORECASE)


def kafka_config_from_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    environ = os.environ if environ is None else environ
    config = {}
    for name, value in environ.items():
        if name.startswith(KAFKA_ENV_PREFIX) and name != "OUTBOX_KAFKA_BOOTSTRAP_SERVERS":
            key = name[len(KAFKA_ENV_PREFIX) :].lower().replace("__", "\0").replace("_", ".")
            config[key.replace("\0", "_")] = value
    return config


def masked_kafka_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with every secret-looking value replaced, for logs."""
    return {key: "***" if _SECRET_KEYS.search(key) else value for key, value in config.items()}


@dataclass(frozen=True)
class RelayConfig:
    """Everything ``outbox relay`` needs; see ``outbox relay --help``."""

    database_url: str
    kafka: dict[str, Any]
    spec: OutboxTableSpec = field(default_factory=OutboxTableSpec)
    mode: str = AT_LEAST_ONCE
    batch_size: int = 1000
    poll_interval: float = 1.0
    #: Shards move within about this long (a dead relay's, a joining relay's share); a
    #: rebalance that changes nothing costs two small queries.
    rebalance_interval: float = 0.5
    # Long, so that a broker outage of minutes is ridden out inside the idempotent producer,
    # in order; only longer ones turn into per-message retries with backoff.
    delivery_timeout_ms: int = 300_000
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    transactional_id_prefix: str | None = None
    progress_topic: str | None = None
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    shutdown_timeout: float = 30.0
    delete_on_send: bool = False
    #: At-least-once marks wait for the WAL flush too (exactly-once marks always do).
    durable_marks: bool = False
    #: Seconds a mark (what Kafka answered being recorded) or a shard's take-over may last
    #: before /healthz answers 503 "wedged": a mark is one statement, and a take-over gives up
    #: after 25 s (init_transactions 10 s, the progress read 15 s), so longer is a hang.
    wedge_timeout: float = 90.0

    def __post_init__(self) -> None:
        if self.mode not in (AT_LEAST_ONCE, EXACTLY_ONCE):
            raise ConfigError(f"mode must be {AT_LEAST_ONCE} or {EXACTLY_ONCE}, got {self.mode!r}")
        if not self.kafka.get("bootstrap.servers"):
            raise ConfigError("Kafka bootstrap servers are required (--bootstrap-servers)")
        if not 1 <= self.batch_size <= 50_000:
            raise ConfigError("batch size must be between 1 and 50000")
        if self.poll_interval <= 0 or self.rebalance_interval <= 0:
            raise ConfigError("poll and rebalance intervals must be positive")
        if self.wedge_timeout <= 0:
            raise ConfigError("the wedge timeout must be positive")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError("metrics port must be between 0 and 65535")
        if self.exactly_once and self.delivery_timeout_ms + 30_000 > 900_000:
            raise ConfigError(
                "in exactly-once mode the delivery timeout must stay under 870000 ms: a Kafka "
                "transaction must outlive its deliveries and may last 15 minutes at most"
            )
        for forbidden in ("transactional.id", "enable.idempotence", "acks"):
            if forbidden in self.kafka:
                raise ConfigError(f"Kafka setting {forbidden!r} is managed by the relay")

    @property
    def exactly_once(self) -> bool:
        return self.mode == EXACTLY_ONCE

    @property
    def marks_wait_for_flush(self) -> bool:
        """Whether marking a batch sent waits for PostgreSQL to flush it to disk.

        Exactly-once: always, because recovery restores only a shard's last batches from Kafka,
        and a forgotten mark of any earlier one would send its rows again. At-least-once:
        only with ``durable_marks``. Otherwise a database crash may forget the marks of its
        last moments (the WAL writer flushes them within a fraction of a second): those rows
        go again, duplicates that at-least-once allows, and the loop never waits for a disk.
        """
        return self.exactly_once or self.durable_marks

    @property
    def transactional_prefix(self) -> str:
        return self.transactional_id_prefix or f"outbox-relay.{self.spec.qualified_name}"

    @property
    def progress_topic_name(self) -> str:
        return self.progress_topic or f"outbox-progress.{self.spec.qualified_name}"
