"""The consumer runner's settings, validated in one place."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from outbox.errors import ConfigError
from outbox.inbox.schema import InboxTableSpec
from outbox.outages import DATABASE_OUTAGE_LIMIT

#: Environment variables OUTBOX_KAFKA_<NAME> become Kafka settings, by the relay's rule:
#: OUTBOX_KAFKA_SASL_PASSWORD -> sasl.password; a double underscore stands for a literal one.
KAFKA_ENV_PREFIX = "OUTBOX_KAFKA_"


def kafka_config_from_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Kafka settings from ``OUTBOX_KAFKA_*`` variables (bootstrap servers excepted)."""
    environ = os.environ if environ is None else environ
    config = {}
    for name, value in environ.items():
        if name.startswith(KAFKA_ENV_PREFIX) and name != "OUTBOX_KAFKA_BOOTSTRAP_SERVERS":
            key = name[len(KAFKA_ENV_PREFIX) :].lower().replace("__", "\0").replace("_", ".")
            config[key.replace("\0", "_")] = value
    return config


#: Kafka settings the runner owns: changing them would break its guarantees.
MANAGED_KAFKA_SETTINGS = ("enable.auto.commit", "enable.auto.offset.store", "isolation.level")


@dataclass(frozen=True)
class ConsumerConfig:
    """Everything ``outbox consume`` needs; see ``outbox consume --help``."""

    database_url: str
    kafka: dict[str, Any]
    spec: InboxTableSpec = field(default_factory=InboxTableSpec)
    #: Records per database transaction.
    batch_size: int = 500
    #: Seconds the runner waits to fill a batch before it applies what it has.
    max_wait: float = 0.1
    #: Handler attempts before a message is parked.
    max_attempts: int = 5
    backoff_base: float = 0.5
    backoff_max: float = 60.0
    #: Inbox rows older than this are purged by the runner (None: never; purge with the CLI).
    retention: timedelta | None = None
    purge_interval: float = 3600.0
    #: Seconds between looks for parked messages an operator asked to retry.
    requeue_interval: float = 5.0
    #: Seconds the database may stay out of reach before /healthz reports the consumer
    #: unhealthy (/readyz does at once).
    database_outage_limit: float = DATABASE_OUTAGE_LIMIT
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if not self.kafka.get("bootstrap.servers"):
            raise ConfigError("Kafka bootstrap servers are required (--bootstrap-servers)")
        for managed in MANAGED_KAFKA_SETTINGS:
            if managed in self.kafka:
                raise ConfigError(f"Kafka setting {managed!r} is managed by the inbox runner")
        if "group.id" in self.kafka:
            raise ConfigError("the consumer group comes from the Inbox (Inbox(group=...)), not -X")
        if not 1 <= self.batch_size <= 50_000:
            raise ConfigError("batch size must be between 1 and 50000")
        if self.max_wait <= 0:
            raise ConfigError("max wait must be positive")
        if self.max_attempts < 1:
            raise ConfigError("max attempts must be at least 1")
        if self.backoff_base <= 0 or self.backoff_max < self.backoff_base:
            raise ConfigError("backoff base must be positive and at most the backoff maximum")
        if not 0 < self.database_outage_limit <= 86400:
            raise ConfigError("the database outage limit must be positive, at most a day")
        if self.retention is not None and self.retention <= timedelta(0):
            raise ConfigError("retention must be positive")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError("metrics port must be between 0 and 65535")
