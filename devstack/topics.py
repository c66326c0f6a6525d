"""Reading a topic back whole: for tests, the demo and the benchmarks."""

from __future__ import annotations

import time
import uuid

from confluent_kafka import Consumer, KafkaError, KafkaException, Message


def consume_messages(
    bootstrap: str,
    topic: str,
    *,
    expect: int,
    isolation: str = "read_committed",
    timeout: float = 30.0,
    quiet: float = 1.5,
) -> list[Message]:
    """Read ``topic`` from the start until ``expect`` records arrived and it stayed quiet."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"test-{uuid.uuid4().hex}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "isolation.level": isolation,
        }
    )
    consumer.subscribe([topic])
    records: list[Message] = []
    deadline = time.monotonic() + timeout
    quiet_since = None
    try:
        while time.monotonic() < deadline:
            message = consumer.poll(0.5)
            if message is None:
                if len(records) >= expect:
                    quiet_since = quiet_since or time.monotonic()
                    if time.monotonic() - quiet_since > quiet:
                        break
                continue
            error = message.error()
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF:
                    continue
                raise KafkaException(error)
            records.append(message)
            quiet_since = None
    finally:
        consumer.close()
    return records


def consume_all(
    bootstrap: str, topic: str, *, isolation: str, expect: int, timeout: float = 30.0
) -> list[tuple[bytes | None, bytes | None]]:
    """(key, value) of every record, as :func:`consume_messages` reads them."""
    messages = consume_messages(
        bootstrap, topic, expect=expect, isolation=isolation, timeout=timeout
    )
    return [(m.key(), m.value()) for m in messages]


def create_topics(
    bootstrap: str,
    names: list[str],
    partitions: int = 1,
    config: dict[str, str] | None = None,
) -> None:
    """Create ``names`` with the brokers' default replication factor (1 on a lone broker, 3
    on the cluster) and the topic settings ``config`` (``max.message.bytes``, ...); an
    existing topic is kept as it is."""
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    admin = AdminClient({"bootstrap.servers": bootstrap})
    futures = admin.create_topics(
        [NewTopic(name, partitions, replication_factor=-1, config=config or {}) for name in names],
        operation_timeout=30,
    )
    for future in futures.values():
        try:
            future.result(60)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise
    _wait_known_everywhere(bootstrap, names)


def _wait_known_everywhere(bootstrap: str, names: list[str], timeout: float = 30.0) -> None:
    """Wait until every broker of ``bootstrap`` answers metadata with ``names`` and a leader
    for each partition: on a cluster, brokers learn of a new topic a moment after it is
    created, and a client asking one that has not yet would not find it."""
    from confluent_kafka.admin import AdminClient

    deadline = time.monotonic() + timeout
    for address in bootstrap.split(","):
        while True:
            # A new client's first metadata request goes to its one bootstrap address.
            admin = AdminClient({"bootstrap.servers": address, "log_level": 0})
            try:
                topics = admin.list_topics(timeout=5).topics
            except KafkaException:
                topics = {}
            known = all(
                name in topics
                and topics[name].partitions
                and all(p.leader >= 0 for p in topics[name].partitions.values())
                for name in names
            )
            if known:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"topics {names} not known to the broker at {address}")
            time.sleep(0.2)
