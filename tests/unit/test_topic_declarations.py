"""Declared topics: the TOML file, the defaults docs/topics.md recommends, and the settings a
cluster cannot meet refused before anything is created."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from outbox.errors import ConfigError
from outbox.topics import TopicSettings, merge_names, read_topics_file, retention_ms


def test_defaults_follow_the_cluster_size() -> None:
    three = TopicSettings("orders").resolved(brokers=3)
    assert (three.partitions, three.replication_factor, three.min_insync_replicas) == (12, 3, 2)
    assert three.topic_config() == {
        "min.insync.replicas": "2",
        "retention.ms": str(7 * 24 * 3600 * 1000),
        "max.message.bytes": "1048588",
        "unclean.leader.election.enable": "false",
    }
    one = TopicSettings("orders").resolved(brokers=1)
    assert (one.replication_factor, one.min_insync_replicas) == (1, 1)
    five = TopicSettings("orders").resolved(brokers=5)
    assert (five.replication_factor, five.min_insync_replicas) == (3, 2)
    two = TopicSettings("orders").resolved(brokers=2)
    assert (two.replication_factor, two.min_insync_replicas) == (2, 1)


def test_what_the_cluster_cannot_meet_is_refused() -> None:
    with pytest.raises(ConfigError, match="needs 3 brokers, the cluster has 1"):
        TopicSettings("orders", replication_factor=3).resolved(brokers=1)
    with pytest.raises(ConfigError, match="no write would ever be accepted"):
        TopicSettings("orders", replication_factor=2, min_insync_replicas=3).resolved(brokers=3)
    with pytest.raises(ConfigError, match="not a valid topic name"):
        TopicSettings("orders/eu")
    with pytest.raises(ConfigError, match="partitions must be"):
        TopicSettings("orders", partitions=0)


def test_retention_reads_durations_and_forever() -> None:
    assert retention_ms("12h") == 12 * 3600 * 1000
    assert retention_ms("forever") == -1
    with pytest.raises(ConfigError, match="retention"):
        retention_ms("a week")


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "topics.toml"
    path.write_text(text)
    return path


def test_a_file_declares_topics_under_its_defaults(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        # the service's topics
        [defaults]
        partitions = 6
        retention = "3d"
        config = { "compression.type" = "lz4" }

        [topics.orders]
        partitions = 24

        [topics.payments]
        retention = "forever"
        config = { "cleanup.policy" = "delete" }

        [topics.audit]
        """,
    )
    orders, payments, audit = read_topics_file(path)
    assert (orders.name, orders.partitions, orders.retention) == ("orders", 24, "3d")
    assert payments.retention == "forever" and payments.partitions == 6
    assert payments.config == {"compression.type": "lz4", "cleanup.policy": "delete"}
    assert audit.config == {"compression.type": "lz4"}
    # Options on the command line win over the file, names on it come first.
    merged = merge_names(("extra", "orders"), [orders, payments], partitions=3)
    assert [(t.name, t.partitions) for t in merged] == [
        ("extra", 3),
        ("orders", 3),
        ("payments", 3),
    ]


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("[topics.orders]\npartition = 3\n", "unknown key"),
        ("[topic.orders]\n", "unknown section"),
        ("[defaults]\npartitions = 3\n", "declares no topic"),
        ("[topics.orders\n", "not valid TOML"),
        ('[topics.orders]\nretention = "soon"\n', "retention"),
    ],
)
def test_a_bad_file_says_what_is_wrong(tmp_path: Path, text: str, error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        read_topics_file(write(tmp_path, text))


def test_the_file_docs_topics_md_shows_reads_as_it_says(tmp_path: Path) -> None:
    docs = (Path(__file__).resolve().parents[2] / "docs" / "topics.md").read_text()
    [block] = re.findall(r"```toml\n(.*?)```", docs, re.DOTALL)
    declared = {t.name: t for t in read_topics_file(write(tmp_path, block))}
    assert sorted(declared) == ["audit", "orders", "payments"]
    assert declared["orders"].partitions == 24 and declared["orders"].retention == "7d"
    assert declared["payments"].retention == "30d"
    assert declared["payments"].config == {"compression.type": "lz4"}
    assert declared["audit"].resolved(brokers=3).partitions == 12


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        read_topics_file(tmp_path / "nope.toml")
