"""The topics an outbox publishes to, declared: names, partitions, replication and retention,
with the defaults docs/topics.md recommends (``outbox topics create|check|describe``).

A declared-topics file is TOML, read with the standard library's ``tomllib`` (no
dependency; comments allowed; the format of ``pyproject.toml``)::

    [defaults]                  # optional; every key optional
    partitions = 12
    replication_factor = 3
    min_insync_replicas = 2
    retention = "7d"            # 90s, 15m, 12h, 7d, 1w, or "forever"

    [topics.orders]             # one table per topic; an empty one takes the defaults
    partitions = 24

    [topics.payments]
    retention = "30d"
    config = { "compression.type" = "lz4" }   # any other topic setting

Left unset, the replication factor is 3, or the number of brokers when the cluster has
fewer (the local stack's one); ``min.insync.replicas`` is 2 with three replicas or more, 1
below (two replicas that must both be in sync would stop writes whenever one broker is down).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from outbox.durations import parse_duration
from outbox.errors import ConfigError

DEFAULT_PARTITIONS = 12
DEFAULT_REPLICATION_FACTOR = 3
#: Kafka's own default, set explicitly: the nightly reconciliation reads the previous UTC
#: day of records (with a grace period), so a topic must keep at least two days.
DEFAULT_RETENTION = "7d"
#: The shortest retention ``check`` accepts without a warning (see DEFAULT_RETENTION).
SHORTEST_SAFE_RETENTION_MS = 2 * 24 * 3600 * 1000
#: 1 MiB + 12, the broker's default: the largest batch the topic takes, above the outbox's
#: and the producer's 1,000,000 bytes (docs/topics.md, "Sizes").
DEFAULT_MAX_MESSAGE_BYTES = 1_048_588

_KEYS = {"partitions", "replication_factor", "min_insync_replicas", "retention", "config"}


@dataclass(frozen=True)
class TopicSettings:
    """A topic as it should be. ``None`` means "the default" (see :meth:`resolved`)."""

    name: str
    partitions: int | None = None
    replication_factor: int | None = None
    min_insync_replicas: int | None = None
    retention: str | None = None
    config: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        validate_topic_name(self.name)
        for what, value in (
            ("partitions", self.partitions),
            ("replication_factor", self.replication_factor),
            ("min_insync_replicas", self.min_insync_replicas),
        ):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"topic {self.name}: {what} must be a whole number >= 1")
        if self.retention is not None:
            retention_ms(self.retention)  # raises on a bad one

    def resolved(self, brokers: int) -> TopicSettings:
        """Every setting filled in for a cluster of ``brokers`` brokers; a replication
        factor or ``min.insync.replicas`` the cluster cannot meet is a ConfigError."""
        replicas = self.replication_factor or min(DEFAULT_REPLICATION_FACTOR, max(1, brokers))
        if replicas > brokers:
            raise ConfigError(
                f"topic {self.name}: replication factor {replicas} needs {replicas} brokers, "
                f"the cluster has {brokers}"
            )
        min_isr = self.min_insync_replicas or (2 if replicas >= 3 else 1)
        if min_isr > replicas:
            raise ConfigError(
                f"topic {self.name}: min.insync.replicas {min_isr} is more than its "
                f"{replicas} replica(s): no write would ever be accepted"
            )
        return replace(
            self,
            partitions=self.partitions or DEFAULT_PARTITIONS,
            replication_factor=replicas,
            min_insync_replicas=min_isr,
            retention=self.retention or DEFAULT_RETENTION,
        )

    def topic_config(self) -> dict[str, str]:
        """The topic-level settings to create it with (of a :meth:`resolved` one)."""
        assert self.min_insync_replicas is not None and self.retention is not None
        return {
            "min.insync.replicas": str(self.min_insync_replicas),
            "retention.ms": str(retention_ms(self.retention)),
            "max.message.bytes": str(DEFAULT_MAX_MESSAGE_BYTES),
            "unclean.leader.election.enable": "false",
            **self.config,
        }


def validate_topic_name(name: str) -> None:
    """Kafka's rule for topic names: 1-249 of ``[a-zA-Z0-9._-]``, not ``.`` or ``..``."""
    import re

    if not re.fullmatch(r"[a-zA-Z0-9._-]{1,249}", name or "") or name in {".", ".."}:
        raise ConfigError(
            f"{name!r} is not a valid topic name: 1-249 letters, digits, '.', '_' or '-'"
        )


def retention_ms(text: str) -> int:
    """``"7d"`` -> 604800000; ``"forever"`` -> -1 (Kafka's "keep everything")."""
    if text.strip().lower() in {"forever", "-1"}:
        return -1
    try:
        return int(parse_duration(text).total_seconds() * 1000)
    except ValueError as exc:
        raise ConfigError(f"retention: {exc}, or 'forever'") from exc


def read_topics_file(path: Path) -> list[TopicSettings]:
    """The topics a declared-topics file lists, each with the file's ``[defaults]`` under
    its own settings. A key it does not know is an error (a typo must not pass silently)."""
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from exc
    unknown = set(data) - {"defaults", "topics"}
    if unknown:
        raise ConfigError(
            f"{path}: unknown section(s) {sorted(unknown)}; use [defaults], [topics.NAME]"
        )
    defaults = _settings(path, "[defaults]", data.get("defaults", {}))
    topics = data.get("topics", {})
    if not isinstance(topics, dict) or not topics:
        raise ConfigError(f"{path} declares no topic: add a [topics.NAME] table per topic")
    declared = []
    for name, settings in topics.items():
        own = _settings(path, f"[topics.{name}]", settings)
        config = {**defaults.get("config", {}), **own.pop("config", {})}
        merged = {**defaults, **own, "config": config}
        declared.append(TopicSettings(name=name, **merged))
    return declared


def _settings(path: Path, where: str, table: Any) -> dict[str, Any]:
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: {where} must be a table of settings")
    unknown = set(table) - _KEYS
    if unknown:
        raise ConfigError(
            f"{path}: {where} has unknown key(s) {sorted(unknown)}; known: {sorted(_KEYS)}"
        )
    settings = dict(table)
    if "config" in settings:
        config = settings["config"]
        if not isinstance(config, dict):
            raise ConfigError(f"{path}: {where} config must be a table of topic settings")
        settings["config"] = {str(k): str(v) for k, v in config.items()}
    if "retention" in settings:
        settings["retention"] = str(settings["retention"])
    return settings


def merge_names(
    names: tuple[str, ...] | list[str], declared: list[TopicSettings], **overrides: Any
) -> list[TopicSettings]:
    """The topics named on the command line (with ``overrides``, the options given) and those
    of a file, in that order, each once; an option given on the command line applies to the
    file's topics too."""
    given = {k: v for k, v in overrides.items() if v not in (None, {}, ())}
    topics: dict[str, TopicSettings] = {}
    for topic in declared:
        config = {**topic.config, **given.get("config", {})}
        topics[topic.name] = replace(topic, **{**given, "config": config})
    for name in names:
        if name not in topics:
            topics[name] = TopicSettings(name=name, **given)
    named_first = [topics[n] for n in dict.fromkeys(names)]
    return named_first + [t for t in topics.values() if t.name not in names]
