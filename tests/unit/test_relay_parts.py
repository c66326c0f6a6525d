"""Pure parts of the relay: error classes, backoff, settings, masking, progress records."""

from __future__ import annotations

import json
import logging
import random
import uuid

import pytest
from confluent_kafka import KafkaError, KafkaException

from outbox.errors import ConfigError
from outbox.logs import JsonFormatter
from outbox.records import OutboxRecord
from outbox.relay.config import RelayConfig, kafka_config_from_env, masked_kafka_config
from outbox.relay.observability import HealthState, mask_secrets
from outbox.relay.policy import RETRIABLE, RetryPolicy, classify
from outbox.relay.progress import decode_progress, encode_progress
from outbox.sending import Ack, BatchResult, kafka_error_of, order_gaps


@pytest.mark.parametrize(
    ("code", "kind"),
    [
        (KafkaError.MSG_SIZE_TOO_LARGE, "message_too_large"),
        (KafkaError.UNKNOWN_TOPIC_OR_PART, "unknown_topic"),
        (KafkaError._UNKNOWN_TOPIC, "unknown_topic"),
        (KafkaError.TOPIC_AUTHORIZATION_FAILED, "topic_unauthorized"),
        (KafkaError.INVALID_RECORD, "invalid_record"),
        (KafkaError._MSG_TIMED_OUT, RETRIABLE),
        (KafkaError.NOT_ENOUGH_REPLICAS, RETRIABLE),
        (KafkaError._TRANSPORT, RETRIABLE),
    ],
)
def test_errors_are_classified(code: int, kind: str) -> None:
    assert classify(KafkaError(code)) == kind


def test_backoff_grows_exponentially_with_jitter_up_to_the_cap() -> None:
    policy = RetryPolicy(max_attempts=5, base_seconds=1.0, cap_seconds=10.0)
    rng = random.Random(7)
    for attempts, ceiling in [(0, 1.0), (1, 2.0), (2, 4.0), (3, 8.0), (4, 10.0), (20, 10.0)]:
        delays = [policy.delay(attempts, rng) for _ in range(200)]
        assert min(delays) >= 0 and max(delays) <= ceiling
        assert max(delays) > ceiling * 0.8  # jitter covers the range
    assert not policy.gives_up(3)
    assert policy.gives_up(4)  # the fifth failed attempt is the last
    with pytest.raises(ValueError):
        RetryPolicy(max_attempts=0)


def config(**overrides: object) -> RelayConfig:
    return RelayConfig(
        database_url="postgresql+psycopg://u:p@h/db",
        kafka={"bootstrap.servers": "k:9092", **overrides.pop("kafka", {})},  # type: ignore[dict-item]
        **overrides,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"mode": "twice"}, "mode"),
        ({"kafka": {"bootstrap.servers": ""}}, "bootstrap"),
        ({"batch_size": 0}, "batch size"),
        ({"poll_interval": 0}, "intervals"),
        ({"kafka": {"transactional.id": "x"}}, "managed by the relay"),
        ({"metrics_port": 70_000}, "port"),
    ],
)
def test_bad_relay_settings_are_refused(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config(**overrides)


def test_defaults_name_the_transactional_ids_and_progress_topic_after_the_table() -> None:
    relay = config()
    assert relay.transactional_prefix == "outbox-relay.public.outbox"
    assert relay.progress_topic_name == "outbox-progress.public.outbox"


def test_kafka_settings_from_the_environment() -> None:
    env = {
        "OUTBOX_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
        "OUTBOX_KAFKA_SASL_PASSWORD": "hunter2",
        "OUTBOX_KAFKA_SSL_CA_LOCATION": "/ca.pem",
        "OUTBOX_KAFKA_BOOTSTRAP_SERVERS": "not-a-setting-here",
        "OTHER": "x",
    }
    assert kafka_config_from_env(env) == {
        "security.protocol": "SASL_SSL",
        "sasl.password": "hunter2",
        "ssl.ca.location": "/ca.pem",
    }
    assert masked_kafka_config({"sasl.password": "hunter2", "acks": "all"}) == {
        "sasl.password": "***",
        "acks": "all",
    }


def test_secrets_are_masked_in_text_and_log_lines() -> None:
    text = "could not connect to postgresql+psycopg://relay:s3cr3t@db:5432/shop; password=s3cr3t"
    assert "s3cr3t" not in mask_secrets(text)
    assert "relay:***@db" in mask_secrets(text)
    record = logging.makeLogRecord(
        {"msg": "failed: %s", "args": (text,), "levelname": "ERROR", "name": "t"}
    )
    record.__dict__["message_id"] = "m-1"
    line = json.loads(JsonFormatter().format(record))
    assert "s3cr3t" not in json.dumps(line)
    assert line["message_id"] == "m-1" and line["level"] == "error"


def test_progress_records_round_trip() -> None:
    acks = [Ack(uuid.uuid4(), 0, 17), Ack(uuid.uuid4(), 2, 5)]
    assert decode_progress(encode_progress(3, "relay-x", acks)) == acks


def test_progress_records_carry_the_generation_and_older_ones_read_as_generation_zero() -> None:
    ack = Ack(uuid.uuid4(), 1, 7, generation=3)
    assert decode_progress(encode_progress(0, "relay-x", [ack])) == [ack]
    older = json.dumps({"shard": 0, "owner": "relay-x", "acks": [[str(ack.id), 1, 7]]})
    assert decode_progress(older.encode()) == [Ack(ack.id, 1, 7, 0)]


def _record(n: int, key: bytes | None) -> OutboxRecord:
    return OutboxRecord(uuid.UUID(int=n + 1), n, 0, "orders", key, b"v", [])


def test_order_gaps_are_acks_behind_a_failure_that_holds_the_key() -> None:
    a1, b1, a2, b2, c1 = (_record(n, key) for n, key in enumerate([b"a", b"b", b"a", b"b", None]))
    result = BatchResult(
        acks=[Ack(r.id, 0, n) for n, r in enumerate([b1, a2, c1])],
        errors={a1.id: KafkaError(KafkaError._TIMED_OUT), b2.id: KafkaError(KafkaError._FAIL)},
    )
    retriable = lambda error: classify(error) == RETRIABLE  # noqa: E731
    assert order_gaps([a1, b1, a2, b2, c1], result, retriable) == [a2.id]
    # A message that went dead (too large, say) does not hold its key back: no gap.
    dead = BatchResult(
        acks=[Ack(a2.id, 0, 0)], errors={a1.id: KafkaError(KafkaError.MSG_SIZE_TOO_LARGE)}
    )
    assert order_gaps([a1, a2], dead, retriable) == []


def test_health_turns_bad_when_batches_keep_going_unsent() -> None:
    health = HealthState(stale_after=30)
    health.batch_done(progressed=False)
    assert health.alive and not health.stuck  # one unsent batch is not yet stuck
    health.batch_done(progressed=False)
    assert health.stuck_since is not None
    health.stuck_since -= 31  # as if every batch since had come back unsent for 31 s
    health.tick()
    assert health.stuck and not health.alive
    health.batch_done(progressed=True)
    assert health.alive and not health.stuck


def test_a_client_failure_without_a_reason_counts_as_fatal() -> None:
    """confluent-kafka can raise a bare SystemError from flush() while it raises a fatal
    error (a fence) and runs a log callback: the producer must then be treated as done for."""
    bare = SystemError("<method 'flush' of 'cimpl.Producer' objects> returned NULL")
    error = kafka_error_of(bare)
    assert error is not None and error.fatal() and error.code() == KafkaError._FATAL
    fenced = KafkaException(KafkaError(KafkaError._FENCED, "fenced", fatal=True))
    wrapped = SystemError("flush")
    wrapped.__cause__ = fenced
    assert kafka_error_of(wrapped) is fenced.args[0]
    assert kafka_error_of(ValueError("not Kafka's")) is None


@pytest.mark.parametrize(
    ("settings", "linger"),
    [
        ({}, 5),  # the transactional default
        ({"linger.ms": 0}, 0),  # the operator's word wins
        ({"queue.buffering.max.ms": 20}, None),  # librdkafka's other name for it
    ],
)
def test_transactional_producers_linger_unless_told_otherwise(
    settings: dict[str, object], linger: int | None
) -> None:
    from outbox.relay.transactions import TRANSACTION_LINGER_MS, ExactlyOnceSender

    publisher = ExactlyOnceSender(
        {"bootstrap.servers": "127.0.0.1:9", **settings},
        transactional_id_prefix="lin",
        progress_topic="lin-progress",
        owner="lin",
        delivery_timeout_ms=1000,
    )
    try:
        config = publisher.producer_config(7)
    finally:
        publisher.close()
    assert config["transactional.id"] == "lin-7"
    if linger is None:
        assert config["queue.buffering.max.ms"] == 20 and "linger.ms" not in settings
        assert config.get("linger.ms") != TRANSACTION_LINGER_MS
    else:
        assert config["linger.ms"] == linger
    # The producer accepts them (a bad combination fails here, not at a take-over).
    from confluent_kafka import Producer

    Producer({k: v for k, v in config.items() if k != "logger"}).flush(0)


def test_the_deadline_watchdog_purges_at_the_earliest_deadline_and_never_before() -> None:
    """Woken only for an earlier deadline: one that moved later or went is found when the
    thread wakes by itself, so it must purge neither early nor late."""
    import threading
    import time

    from outbox.flights import _DeadlineWatchdog

    purged: list[float] = []
    purged_event = threading.Event()

    def purge() -> None:
        purged.append(time.monotonic())
        purged_event.set()

    watchdog = _DeadlineWatchdog(purge)
    try:
        start = time.monotonic()
        watchdog.watch(start + 0.6)
        watchdog.watch(start + 0.2)  # earlier: the thread must wake for it
        assert purged_event.wait(5)
        assert purged[0] - start >= 0.2 and purged[0] - start < 0.6
        purged_event.clear()

        start = time.monotonic()
        watchdog.watch(start + 0.2)
        watchdog.watch(start + 0.5)  # later: found when the thread wakes at 0.2
        assert purged_event.wait(5)
        assert purged[1] - start >= 0.5
        purged_event.clear()

        start = time.monotonic()
        watchdog.watch(start + 0.2)
        watchdog.watch(None)  # every batch settled: nothing to purge at 0.2
        time.sleep(0.4)
        assert len(purged) == 2
        watchdog.watch(time.monotonic() + 0.1)  # a batch started while the thread waits
        assert purged_event.wait(5)
        assert len(purged) == 3
    finally:
        watchdog.stop()
