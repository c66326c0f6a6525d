"""QMQ-style immediate send on real PostgreSQL and Kafka: it never races the relay into
duplicates, never overtakes an earlier message of the same key, and loses nothing on failure."""

from __future__ import annotations

import time
import uuid

import pytest
import sqlalchemy as sa

from outbox import ID_HEADER, NO_KEY, Message, NoKey, Outbox
from outbox.devstack.topics import consume_messages
from outbox.immediate import ImmediateSender
from outbox.schema import DEFAULT_SPEC

pytestmark = pytest.mark.integration


def rows(engine: sa.Engine) -> dict[uuid.UUID, sa.RowMapping]:
    with engine.connect() as conn:
        result = conn.execute(
            sa.text(
                "SELECT id, status, kafka_partition, kafka_offset, lease_owner, attempts "
                "FROM outbox ORDER BY seq"
            )
        )
        return {row["id"]: row for row in result.mappings()}


def publish(
    engine: sa.Engine,
    topic: str,
    count: int,
    key: str | NoKey = NO_KEY,
    leased_to: ImmediateSender | str | None = None,
    lease_seconds: float = 10.0,
) -> list[uuid.UUID]:
    """Commit ``count`` messages; ``leased_to``: written leased, as for that immediate sender
    (without submitting them to it)."""
    ob = Outbox(engine)
    with ob.transaction() as tx:
        results = tx.publish_many([Message(topic, {"n": i}, key=key) for i in range(count)])
    ids = [r.message_id for r in results]
    if leased_to is not None:
        owner = leased_to if isinstance(leased_to, str) else leased_to.owner
        lease(engine, ids, owner, lease_seconds)
    return ids


def lease(engine: sa.Engine, ids: list[uuid.UUID], owner: str, seconds: float) -> None:
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE outbox SET lease_owner = :owner,"
                " lease_until = clock_timestamp() + make_interval(secs => :seconds)"
                " WHERE id = ANY(:ids)"
            ),
            {"ids": ids, "owner": owner, "seconds": seconds},
        )


@pytest.fixture
def sender(engine: sa.Engine, bootstrap_servers: str):  # type: ignore[no-untyped-def]
    made: list[ImmediateSender] = []

    def make(**options):  # type: ignore[no-untyped-def]
        config = {"bootstrap.servers": bootstrap_servers, **options.pop("kafka", {})}
        instance = ImmediateSender(engine, config, **options)
        made.append(instance)
        return instance

    yield make
    for instance in made:
        instance.close(10)


def test_committed_messages_are_sent_and_marked_with_their_offsets(
    engine, bootstrap_servers, make_topic, sender
) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("imm", partitions=2)
    immediate = sender()
    ob = Outbox(engine, immediate=immediate)
    with ob.transaction() as tx:
        sent = [tx.publish(topic, {"n": i}, key=f"k{i % 4}").message_id for i in range(20)]
    with pytest.raises(RuntimeError), ob.transaction() as tx:
        tx.publish(topic, b"rolled back")
        raise RuntimeError
    assert immediate.flush(30)

    stored = rows(engine)
    assert {r["status"] for r in stored.values()} == {"sent"}
    records = consume_messages(bootstrap_servers, topic, expect=20)
    assert len(records) == 20
    by_id = {uuid.UUID(dict(m.headers())[ID_HEADER].decode()): m for m in records}
    assert set(by_id) == set(sent)
    for message_id, message in by_id.items():
        assert (stored[message_id]["kafka_partition"], stored[message_id]["kafka_offset"]) == (
            message.partition(),
            message.offset(),
        )


def test_rows_are_written_leased_to_the_sender_which_sends_each_once(
    engine, bootstrap_servers, make_topic, sender
) -> None:  # type: ignore[no-untyped-def]
    """The lease is taken in the writing transaction itself: there is no moment at which the
    relay could read the rows as free. Another sender does not send them either."""
    topic = make_topic("leased")
    immediate, other = sender(), sender()
    ob = Outbox(engine, immediate=immediate)
    with ob.transaction() as tx:
        ids = [tx.publish(topic, {"n": n}, key=f"k{n % 3}").message_id for n in range(50)]
        owners = tx.session.execute(
            sa.text("SELECT DISTINCT lease_owner, lease_until > now() FROM outbox")
        ).all()
        assert owners == [(immediate.owner, True)]
    assert other.send_now(ids).sent == []  # not its lease
    assert immediate.flush(30)
    assert {r["status"] for r in rows(engine).values()} == {"sent"}
    records = consume_messages(bootstrap_servers, topic, expect=50)
    assert sorted(uuid.UUID(dict(m.headers())[ID_HEADER].decode()) for m in records) == sorted(ids)


def test_the_relay_leaves_a_leased_row_and_its_key_alone_until_the_lease_ends(
    engine, make_topic
) -> None:  # type: ignore[no-untyped-def]
    from outbox.relay.store import RelayStore
    from outbox.schema import SHARD_COUNT

    topic = make_topic("held")
    (held,) = publish(engine, topic, 1, key="k", leased_to="immediate-gone", lease_seconds=2)
    behind = publish(engine, topic, 2, key="k")
    other = publish(engine, topic, 1, key="other")
    store = RelayStore(engine, DEFAULT_SPEC, "relay-test")
    shards = list(range(SHARD_COUNT))
    assert [row.id for row in store.read_batch(shards, 1000)] == other
    time.sleep(2.2)
    assert [row.id for row in store.read_batch(shards, 1000)] == [held, *behind, *other]
    store.close()


def test_a_message_never_overtakes_an_earlier_one_of_its_key(
    engine, bootstrap_servers, make_topic, sender
) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("order")
    immediate = sender()
    publish(engine, topic, 1, key="same")  # pending: with the relay
    (second_id,) = publish(engine, topic, 1, key="same", leased_to=immediate)
    outcome = immediate.send_now([second_id])
    assert outcome.sent == []
    assert outcome.left_to_relay == [second_id]
    stored = rows(engine)
    assert stored[second_id]["status"] == "pending"
    assert stored[second_id]["lease_owner"] is None  # released at once for the relay
    assert consume_messages(bootstrap_servers, topic, expect=0, timeout=3) == []


def test_a_row_waits_for_an_earlier_row_of_its_key_even_one_held_by_the_same_sender(
    engine, make_topic, sender
) -> None:  # type: ignore[no-untyped-def]
    """Two writers of a key take turns, and the second's ids reach the sender first (or the
    first's never do: a full queue). The later row is left to the relay, which sends it after
    the earlier one; it never overtakes it."""
    from outbox.relay.store import RelayStore
    from outbox.schema import SHARD_COUNT

    topic = make_topic("turns")
    immediate = sender()
    (first,) = publish(engine, topic, 1, key="k", leased_to=immediate)
    (second,) = publish(engine, topic, 1, key="k", leased_to=immediate)
    outcome = immediate.send_now([second])
    assert outcome.sent == [] and outcome.left_to_relay == [second]
    store = RelayStore(engine, DEFAULT_SPEC, "relay-test")
    assert store.read_batch(list(range(SHARD_COUNT)), 100) == []  # behind the first's lease
    # The first's lease runs out while it waits: the relay may send it now, and a batch of
    # both clears neither (the second is behind the first, which is no longer the sender's).
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE outbox SET lease_until = now() - interval '1 s' WHERE id = :id"),
            {"id": first},
        )
    assert immediate.send_now([first, second]).sent == []
    assert [row.id for row in store.read_batch(list(range(SHARD_COUNT)), 100)] == [first, second]
    store.close()


def test_a_sender_never_sends_once_its_lease_has_run_out(engine, make_topic, sender) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("expired")
    immediate = sender()
    ids = publish(engine, topic, 3, leased_to=immediate, lease_seconds=0.5)
    time.sleep(0.7)
    outcome = immediate.send_now(ids)
    assert outcome.sent == [] and sorted(outcome.left_to_relay) == sorted(ids)


def test_a_crashed_senders_rows_go_with_the_relay_once_their_lease_ends(
    engine, outbox_url, bootstrap_servers, make_topic
) -> None:  # type: ignore[no-untyped-def]
    from tests.relay_helpers import relay_config, running_relay, wait_for

    topic = make_topic("crash")
    written = time.monotonic()
    ids = publish(engine, topic, 3, leased_to="immediate-died", lease_seconds=3)
    with running_relay(relay_config(outbox_url, bootstrap_servers)):
        assert consume_messages(bootstrap_servers, topic, expect=0, timeout=1.5) == []
        wait_for(
            lambda: {r["status"] for r in rows(engine).values()} == {"sent"}, 20, "sent by relay"
        )
    assert time.monotonic() - written >= 3
    assert len(consume_messages(bootstrap_servers, topic, expect=3)) == 3
    assert sorted(ids) == sorted(rows(engine))


def test_unreachable_broker_leaves_rows_pending_and_unleased(engine, sender) -> None:  # type: ignore[no-untyped-def]
    from outbox.devstack.procs import free_port

    immediate = sender(
        kafka={"bootstrap.servers": f"127.0.0.1:{free_port()}", "delivery.timeout.ms": 1500},
        lease_seconds=5,
    )
    ids = publish(engine, "orders", 2, leased_to=immediate)
    outcome = immediate.send_now(ids)
    assert outcome.sent == []
    assert set(outcome.failed) == set(ids)
    stored = rows(engine)
    assert {r["status"] for r in stored.values()} == {"pending"}
    assert {r["lease_owner"] for r in stored.values()} == {None}


def test_keep_nothing_mode_deletes_rows_once_acknowledged(
    engine, bootstrap_servers, make_topic, sender
) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("nothing")
    immediate = sender(delete_on_send=True)
    ids = publish(engine, topic, 5, leased_to=immediate)
    outcome = immediate.send_now(ids)
    assert sorted(outcome.sent) == sorted(ids)
    assert rows(engine) == {}
    assert len(consume_messages(bootstrap_servers, topic, expect=5)) == 5


def test_rows_released_after_a_send_ran_out_of_time_are_no_longer_retried_by_the_sender(
    engine, kafka_broker, faulty_kafka, make_topic, sender
) -> None:  # type: ignore[no-untyped-def]
    """The sender waits its whole delivery timeout (here longer than 20 s), then purges what
    Kafka has not acknowledged before it gives the rows back: when the broker comes back,
    none of them is sent from this producer behind the relay's back."""
    topic = make_topic("timeout")
    faulty_kafka.drop()  # the broker cannot be reached at all
    immediate = sender(
        kafka={
            "bootstrap.servers": f"127.0.0.1:{faulty_kafka.listen_port}",
            "delivery.timeout.ms": 25_000,
        },
        lease_seconds=40,
    )
    ids = publish(engine, topic, 5, leased_to=immediate, lease_seconds=40)
    started = time.monotonic()
    outcome = immediate.send_now(ids)
    assert time.monotonic() - started >= 24
    assert outcome.sent == [] and set(outcome.failed) == set(ids)
    assert {(r["status"], r["lease_owner"]) for r in rows(engine).values()} == {("pending", None)}
    faulty_kafka.heal()
    late = consume_messages(
        kafka_broker.bootstrap_servers, topic, expect=0, timeout=6, isolation="read_uncommitted"
    )
    assert late == []


def test_a_message_behind_a_deep_backlog_of_its_shard_is_left_to_the_relay(
    engine, bootstrap_servers, make_topic, sender
) -> None:  # type: ignore[no-untyped-def]
    """The order check reads at most ORDER_CHECK_REACH earlier rows of a shard; behind a deeper
    backlog the relay is behind anyway, and sends the message in order."""
    from outbox.immediate import ORDER_CHECK_REACH
    from outbox.schema import shard_of

    topic = make_topic("backlog")
    key = "behind"
    shard = shard_of(key.encode(), uuid.uuid4())
    others = [f"o{n}" for n in range(5000) if shard_of(f"o{n}".encode(), uuid.uuid4()) == shard]
    with Outbox(engine).transaction() as tx:
        tx.publish_many(
            [
                Message(topic, {"n": n}, key=others[n % len(others)])
                for n in range(ORDER_CHECK_REACH + 50)
            ]
        )
    immediate = sender()
    (newest,) = publish(engine, topic, 1, key=key, leased_to=immediate)
    outcome = immediate.send_now([newest])
    assert outcome.sent == [] and outcome.left_to_relay == [newest]
    assert rows(engine)[newest]["lease_owner"] is None


def test_a_failed_immediate_send_logs_why(engine, sender, caplog) -> None:  # type: ignore[no-untyped-def]
    import logging

    immediate = sender()
    ids = publish(engine, "no-such-topic-here", 2, leased_to=immediate)
    with caplog.at_level(logging.WARNING, logger="outbox.immediate"):
        assert immediate.submit(ids)
        assert immediate.flush(30)
    (line,) = [r.getMessage() for r in caplog.records if r.name == "outbox.immediate"]
    assert "2 of 2 messages failed" in line and "Unknown topic" in line, line
    assert {r["status"] for r in rows(engine).values()} == {"pending"}
