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


def test_exactly_once_events_are_served_while_a_transaction_drops_its_lost_producer() -> None:
    """The loop serves the producers' events while shard transactions run (a rebalance no
    longer waits for them); one of them may meanwhile drop the producer of a shard it lost."""
    import threading
    import time

    from outbox.relay.producers import ExactlyOncePublisher

    publisher = ExactlyOncePublisher(
        {"bootstrap.servers": "127.0.0.1:9"},
        transactional_id_prefix="race",
        progress_topic="race-progress",
        owner="race",
        delivery_timeout_ms=1000,
    )
    polled: list[int] = []

    class SlowProducer:
        def __init__(self, shard: int) -> None:
            self.shard = shard

        def poll(self, timeout: float) -> int:
            polled.append(self.shard)
            time.sleep(0.05)  # librdkafka's poll lets other threads run meanwhile
            return 0

    producers = {shard: SlowProducer(shard) for shard in range(4)}
    publisher.producers = producers  # type: ignore[assignment]

    def lose_shard_2() -> None:  # what a transaction thread does when it was fenced
        time.sleep(0.01)
        publisher._lost(2, producers[2], [], BatchResult(), None)  # type: ignore[arg-type]

    thread = threading.Thread(target=lose_shard_2)
    thread.start()
    try:
        publisher.serve_events()
    finally:
        thread.join()
        publisher.producers = {}
        publisher.close()
    assert polled == [0, 1, 2, 3] and 2 not in publisher.producers


def test_an_exactly_once_batch_that_ends_while_the_publisher_looks_is_still_returned() -> None:
    """A shard transaction may end (in its thread) between two looks at it: it must come
    back from wait() all the same, or its shards stay busy and are never read again."""
    from concurrent.futures import Future

    from outbox.relay.producers import ExactlyOncePublisher, ShardFlight

    class EndsWhileLookedAt(ShardFlight):
        looks = 0

        def done(self) -> bool:
            self.looks += 1
            return self.looks > 1  # running at the first look, ended at the next

    publisher = ExactlyOncePublisher(
        {"bootstrap.servers": "127.0.0.1:9"},
        transactional_id_prefix="race",
        progress_topic="race-progress",
        owner="race",
        delivery_timeout_ms=1000,
    )
    future: Future[BatchResult] = Future()
    future.set_result(BatchResult())
    flight = EndsWhileLookedAt([], future)
    publisher._flights = [flight]
    try:
        returned = publisher.wait(0) + publisher.wait(0)
    finally:
        publisher.close()
    assert returned == [flight]


def test_letting_go_of_a_fenced_exactly_once_producer_does_not_raise() -> None:
    """A shard is often let go because its producer was fenced; flushing such a producer
    raises, and that must not take the relay down (seen in a chaos run after a database
    restart: the relay exited from its own error handling)."""
    from outbox.relay.producers import ExactlyOncePublisher

    class FencedProducer:
        def flush(self, timeout: float) -> int:
            raise KafkaException(KafkaError(KafkaError._FENCED, "fenced", fatal=True))

    publisher = ExactlyOncePublisher(
        {"bootstrap.servers": "127.0.0.1:9"},
        transactional_id_prefix="fenced",
        progress_topic="fenced-progress",
        owner="fenced",
        delivery_timeout_ms=1000,
    )
    publisher.producers = {3: FencedProducer(), 4: FencedProducer()}  # type: ignore[dict-item]
    try:
        publisher.let_go([3, 4])
    finally:
        publisher.close()
    assert publisher.producers == {}


def test_outcomes_are_recorded_in_the_background_in_order_and_collected_as_they_finish() -> None:
    import threading

    from outbox.relay.recording import OutcomeRecorder

    recorder: OutcomeRecorder[str] = OutcomeRecorder()
    release = threading.Event()
    ran: list[str] = []

    def first() -> None:
        release.wait(5)
        ran.append("first")

    recorder.submit("first", first)
    recorder.submit("second", lambda: ran.append("second"))
    assert list(recorder.collect(block=False)) == []  # the first still runs: nothing yet
    assert len(recorder) == 2
    release.set()
    assert list(recorder.collect(block=True)) == ["first", "second"]
    assert ran == ["first", "second"] and len(recorder) == 0
    recorder.close()


def test_an_outcome_recorded_behind_a_slow_one_is_collected_without_waiting_for_it() -> None:
    """Head-of-line: a slow mark must not keep the shards of the batches marked after it busy."""
    import threading

    from outbox.relay.recording import OutcomeRecorder

    recorder: OutcomeRecorder[str] = OutcomeRecorder(workers=2)
    release = threading.Event()
    recorder.submit("slow", lambda: release.wait(5) and None)
    second_done = threading.Event()
    recorder.submit("fast", second_done.set)
    assert second_done.wait(5)
    recorder.wait(5)  # returns once any outcome is recorded: "fast" is
    assert list(recorder.collect(block=False)) == ["fast"]
    assert len(recorder) == 1  # the slow one is still being recorded
    assert list(recorder.collect(block=False)) == []
    release.set()
    assert list(recorder.collect(block=True)) == ["slow"]
    assert len(recorder) == 0
    recorder.close()


def test_a_failed_recording_raises_when_collected_and_abandon_forgets_the_rest() -> None:
    from outbox.relay.recording import OutcomeRecorder

    def fail() -> None:
        raise ConnectionError("session lost")

    recorder: OutcomeRecorder[str] = OutcomeRecorder()
    recorder.submit("ok", lambda: None)
    recorder.submit("lost", fail)
    recorder.submit("after", lambda: None)
    collected: list[str] = []
    with pytest.raises(ConnectionError):
        for batch in recorder.collect(block=True):
            collected.append(batch)
    assert collected == ["ok"] and len(recorder) == 2
    recorder.abandon()
    assert len(recorder) == 0 and list(recorder.collect(block=True)) == []
    recorder.close()


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
    from outbox.relay.producers import TRANSACTION_LINGER_MS, ExactlyOncePublisher

    publisher = ExactlyOncePublisher(
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
