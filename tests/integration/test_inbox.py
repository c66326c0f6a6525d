"""The inbox on the real stack: each message's effect (a ledger row) happens exactly once,
whatever Kafka delivers twice, and failures retry in order, then park."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient

from outbox.cli import main
from outbox.inbox import BY_OFFSET
from outbox.inbox.schema import PARKED
from tests import inbox_app
from tests.inbox_helpers import (
    assert_exactly_once,
    assert_partition_order,
    consumer_config,
    ledger,
    ledger_count,
    prepare_database,
    produce,
    running_consumer,
)
from tests.relay_helpers import wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def inbox_engine(outbox_url: str) -> Iterator[sa.Engine]:
    engine = prepare_database(outbox_url)
    yield engine
    engine.dispose()


def group() -> str:
    return f"g-{uuid.uuid4().hex[:8]}"


def parked_rows(engine: sa.Engine) -> list[sa.Row]:
    with engine.connect() as conn:
        return list(conn.execute(sa.text("SELECT * FROM inbox_parked ORDER BY id")).all())


def test_records_produced_twice_are_applied_once(
    inbox_engine: sa.Engine, outbox_url: str, bootstrap_servers: str, make_topic
) -> None:
    topic = make_topic("inbox-dup", partitions=3)
    numbers = range(600)
    ids = produce(bootstrap_servers, topic, numbers)
    # The same ids again: a relay that resent every message after a crash.
    produce(bootstrap_servers, topic, range(0, 600, 3), ids=ids)
    inbox = inbox_app.make_inbox([topic], group())
    with running_consumer(inbox, consumer_config(outbox_url, bootstrap_servers)) as runner:
        wait_for(lambda: runner.metrics.duplicates.labels(topic)._value.get() == 200, 60, "dups")
        wait_for(lambda: ledger_count(inbox_engine) >= 600, 60, "all applied")
    assert_exactly_once(inbox_engine, numbers)
    assert_partition_order(inbox_engine)
    assert runner.metrics.processed.labels(topic)._value.get() == 600
    with inbox_engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM inbox")).scalar_one() == 600


def test_a_second_group_applies_the_same_messages_again_once(
    inbox_engine: sa.Engine, outbox_url: str, bootstrap_servers: str, make_topic
) -> None:
    topic = make_topic("inbox-groups")
    produce(bootstrap_servers, topic, range(50), copies=2)
    for name in (group(), group()):
        inbox = inbox_app.make_inbox([topic], name)
        with running_consumer(inbox, consumer_config(outbox_url, bootstrap_servers)) as runner:
            wait_for(
                lambda runner=runner: runner.metrics.duplicates.labels(topic)._value.get() == 50,
                60,
                "the group's duplicates",
            )
    assert ledger_count(inbox_engine) == 100


def test_a_failing_handler_is_retried_in_order_then_parked_and_retried_by_an_operator(
    inbox_engine: sa.Engine, outbox_url: str, bootstrap_servers: str, make_topic
) -> None:
    topic = make_topic("inbox-fail")
    inbox_app.ATTEMPTS.clear()
    with inbox_engine.begin() as conn:
        # n=3 fails twice (then succeeds); n=7 fails more often than max_attempts allows.
        conn.execute(sa.text("INSERT INTO fail_plan VALUES (3, 2), (7, 100)"))
    extra = {3: {"fail": True}, 7: {"fail": True}}
    produce(bootstrap_servers, topic, range(20), keys=1, extra=extra)
    inbox = inbox_app.make_inbox([topic], group())
    config = consumer_config(outbox_url, bootstrap_servers, max_attempts=3)
    with running_consumer(inbox, config) as runner:
        wait_for(lambda: ledger_count(inbox_engine) == 19, 60, "all but the poison applied")
        assert [row.n for row in ledger(inbox_engine)] == [n for n in range(20) if n != 7]
        [row] = parked_rows(inbox_engine)
        assert (row.reason, row.attempts, row.kafka_offset) == ("handler", 3, 7)
        assert "planned failure of n=7" in row.error
        assert runner.metrics.parked.labels(topic, "handler")._value.get() == 1

        cli = CliRunner()
        listed = cli.invoke(main, ["inbox", "parked", "list", "--database-url", outbox_url])
        assert listed.exit_code == 0, listed.output
        assert "1 parked message(s)" in listed.output and "planned failure" in listed.output
        shown = cli.invoke(
            main, ["inbox", "parked", "show", str(row.id), "--database-url", outbox_url]
        )
        assert '"n":7' in shown.output
        # Fixed: the plan no longer fails; the operator hands it back to the consumer.
        with inbox_engine.begin() as conn:
            conn.execute(sa.text("DELETE FROM fail_plan"))
        retried = cli.invoke(
            main, ["inbox", "parked", "retry", "--all", "--database-url", outbox_url]
        )
        assert "requeued 1 parked message(s)" in retried.output
        wait_for(lambda: ledger_count(inbox_engine) == 20, 30, "the parked message applied")
        assert parked_rows(inbox_engine) == []
    assert inbox_app.ATTEMPTS[3] == 3  # two failures, then success
    assert inbox_app.ATTEMPTS[7] == 4  # three failures (parked), then the operator's retry
    assert_exactly_once(inbox_engine, range(20))


def test_a_batch_handler_gets_the_new_messages_in_order_and_parks_what_fails_alone(
    inbox_engine: sa.Engine, outbox_url: str, bootstrap_servers: str, make_topic
) -> None:
    topic = make_topic("inbox-batch", partitions=3)
    inbox_app.BATCH_SIZES.clear()
    with inbox_engine.begin() as conn:
        # n=4 fails twice (then succeeds); n=58 fails more often than max_attempts allows.
        conn.execute(sa.text("INSERT INTO fail_plan VALUES (4, 2), (58, 100)"))
    numbers = range(300)
    ids = produce(
        bootstrap_servers, topic, numbers, keys=30, extra={4: {"fail": True}, 58: {"fail": True}}
    )
    produce(bootstrap_servers, topic, range(0, 300, 3), keys=30, ids=ids)  # sent twice
    inbox = inbox_app.make_batch_inbox([topic], group())
    config = consumer_config(outbox_url, bootstrap_servers, max_attempts=3)
    with running_consumer(inbox, config) as runner:
        wait_for(lambda: ledger_count(inbox_engine) == 299, 60, "all but the poison applied")
        wait_for(lambda: len(parked_rows(inbox_engine)) == 1, 30, "the poison parked")
        wait_for(lambda: runner.metrics.duplicates.labels(topic)._value.get() == 100, 30, "dups")
        assert runner.metrics.processed.labels(topic)._value.get() == 299
    [row] = parked_rows(inbox_engine)
    assert (row.reason, row.attempts, row.message_id) == ("handler", 3, str(ids[58]))
    assert "planned failure of n=58" in row.error
    assert_exactly_once(inbox_engine, [n for n in numbers if n != 58])
    assert_partition_order(inbox_engine)
    assert max(inbox_app.BATCH_SIZES) > 1  # the rows went in batches
    with inbox_engine.connect() as conn:
        left = dict(conn.execute(sa.text("SELECT n, failures_left FROM fail_plan")).all())
    assert left[4] == 0  # failed twice, on its own, then applied


def test_async_batch_handlers_get_an_async_session(
    inbox_engine: sa.Engine, outbox_url: str, bootstrap_servers: str, make_topic
) -> None:
    topic = make_topic("inbox-async-batch", partitions=2)
    inbox_app.BATCH_SIZES.clear()
    produce(bootstrap_servers, topic, range(200), copies=2)
    inbox = inbox_app.make_async_batch_inbox([topic], group())
    with running_consumer(inbox, consumer_config(outbox_url, bootstrap_servers)) as runner:
        wait_for(lambda: runner.metrics.duplicates.labels(topic)._value.get() == 200, 60, "dups")
    assert_exactly_once(inbox_engine, range(200))
    assert_partition_order(inbox_engine)
    assert max(inbox_app.BATCH_SIZES) > 1


def test_undecodable_and_unidentified_records_are_parked_at_once(
    inbox_engine: sa.Engine, outbox_url: str, bootstrap_servers: str, make_topic
) -> None:
    topic = make_topic("inbox-bad")
    producer = Producer({"bootstrap.servers": bootstrap_servers})
    good = [("outbox-id", str(uuid.uuid4()).encode()), ("content-type", b"application/json")]
    producer.produce(topic, b"{not json", key=b"k", headers=[good[0], good[1]])
    producer.produce(topic, orjson.dumps({"n": 1}), key=b"k")  # no outbox-id header
    producer.produce(
        topic,
        orjson.dumps({"n": 2}),
        key=b"k",
        headers=[("outbox-id", str(uuid.uuid4()).encode()), good[1]],
    )
    producer.flush(30)
    inbox = inbox_app.make_inbox([topic], group())
    with running_consumer(inbox, consumer_config(outbox_url, bootstrap_servers)):
        wait_for(lambda: ledger_count(inbox_engine) == 1, 60, "the good record")
        wait_for(lambda: len(parked_rows(inbox_engine)) == 2, 10, "two parked")
    reasons = [(row.reason, row.kafka_offset, row.attempts) for row in parked_rows(inbox_engine)]
    assert reasons == [("undecodable", 0, 0), ("no-identity", 1, 0)]


def test_records_without_an_id_can_be_identified_by_their_offset(
    inbox_engine: sa.Engine, outbox_url: str, bootstrap_servers: str, make_topic
) -> None:
    topic = make_topic("inbox-offset")
    producer = Producer({"bootstrap.servers": bootstrap_servers})
    for n in range(10):
        producer.produce(
            topic,
            orjson.dumps({"n": n, "amount": n}),
            key=b"k",
            headers=[("content-type", b"application/json")],
        )
    producer.flush(30)
    name = group()
    inbox = inbox_app.make_inbox([topic], name, missing_id=BY_OFFSET)
    with running_consumer(inbox, consumer_config(outbox_url, bootstrap_servers)):
        wait_for(lambda: ledger_count(inbox_engine) == 10, 60, "all applied")
    # The group's committed offsets go: every record is read again, and skipped.
    admin = AdminClient({"bootstrap.servers": bootstrap_servers})
    for future in admin.delete_consumer_groups([name], request_timeout=30).values():
        future.result(30)
    with running_consumer(inbox, consumer_config(outbox_url, bootstrap_servers)) as runner:
        wait_for(lambda: runner.metrics.duplicates.labels(topic)._value.get() == 10, 60, "dups")
    with inbox_engine.connect() as conn:
        ids = set(conn.execute(sa.text("SELECT message_id FROM inbox")).scalars())
    assert ids == {f"{topic}/0/{n}" for n in range(10)}
    assert_exactly_once(inbox_engine, range(10))


def test_async_handlers_get_an_async_session(
    inbox_engine: sa.Engine, outbox_url: str, bootstrap_servers: str, make_topic
) -> None:
    topic = make_topic("inbox-async", partitions=2)
    produce(bootstrap_servers, topic, range(100), copies=2)
    inbox = inbox_app.make_async_inbox([topic], group())
    with running_consumer(inbox, consumer_config(outbox_url, bootstrap_servers)) as runner:
        wait_for(lambda: runner.metrics.duplicates.labels(topic)._value.get() == 100, 60, "dups")
    assert_exactly_once(inbox_engine, range(100))
    assert_partition_order(inbox_engine)


def test_purge_deletes_only_rows_older_than_asked(inbox_engine: sa.Engine, outbox_url: str) -> None:
    with inbox_engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO inbox (consumer_group, message_id, topic, kafka_partition,"
                " kafka_offset, processed_at) SELECT 'g', 'm' || n, 't', 0, n,"
                " now() - make_interval(days => n) + interval '1 hour'"
                " FROM generate_series(0, 29) AS n"
            )
        )
    cli = CliRunner()
    args = ["inbox", "purge", "--older-than", "14d", "--database-url", outbox_url]
    dry = cli.invoke(main, [*args, "--dry-run"])
    assert "would delete 15 inbox row(s)" in dry.output, dry.output
    done = cli.invoke(main, [*args, "--batch-size", "4"])
    assert "deleted 15 inbox row(s)" in done.output, done.output
    with inbox_engine.connect() as conn:
        ages = conn.execute(sa.text("SELECT max(kafka_offset) FROM inbox")).scalar_one()
    assert ages == 14


def test_consume_refuses_bad_targets_and_missing_tables_in_one_line(
    outbox_url: str, bootstrap_servers: str
) -> None:
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        refusals(outbox_url, bootstrap_servers)
    finally:  # `outbox consume` installs its own; give pytest its handlers back
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def refusals(outbox_url: str, bootstrap_servers: str) -> None:
    cli = CliRunner()
    base = ["--database-url", outbox_url, "--bootstrap-servers", bootstrap_servers]
    wrong = cli.invoke(main, ["consume", "tests.inbox_app", *base])
    assert wrong.exit_code == 2 and "is not module:attribute" in wrong.output
    missing = cli.invoke(main, ["consume", "no_such_module_here:inbox", *base])
    assert missing.exit_code == 2 and "cannot import no_such_module_here" in missing.output
    typo = cli.invoke(main, ["consume", "tests.inbox_app:inbx", *base])
    assert typo.exit_code == 2, typo.output
    assert "module tests.inbox_app has no attribute 'inbx'" in typo.output
    managed = cli.invoke(main, ["consume", "tests.inbox_app:inbox", *base, "-X", "group.id=x"])
    assert managed.exit_code == 2 and "consumer group comes from the Inbox" in managed.output
    # The inbox tables were never installed in this database.
    no_tables = cli.invoke(main, ["consume", "tests.inbox_app:inbox", *base])
    assert no_tables.exit_code == 2, no_tables.output
    assert "run `outbox inbox install`" in no_tables.output


#: A sitecustomize that holds the import of HOLD_IMPORT until the file HOLD_RELEASE exists,
#: after creating HOLD_MARK: a start-up caught in the middle of its imports, on demand.
HOLD_AN_IMPORT = """
import os, sys, time

class _Hold:
    def find_spec(self, name, path=None, target=None):
        if name == os.environ["HOLD_IMPORT"]:
            sys.meta_path.remove(self)
            open(os.environ["HOLD_MARK"], "w").close()
            deadline = time.monotonic() + 60
            while not os.path.exists(os.environ["HOLD_RELEASE"]) and time.monotonic() < deadline:
                time.sleep(0.01)
        return None

sys.meta_path.insert(0, _Hold())
"""


def test_consume_stopped_while_it_imports_exits_0_having_done_nothing(
    inbox_engine: sa.Engine, outbox_url: str, bootstrap_servers: str, make_topic, tmp_path: Path
) -> None:
    """SIGTERM lands while `outbox consume` still loads librdkafka: the stop is kept until the
    runner exists, which then stops at once (exit 0) without joining the group."""
    topic = make_topic("inbox-early-stop")
    produce(bootstrap_servers, topic, range(5))
    name = group()
    (tmp_path / "sitecustomize.py").write_text(HOLD_AN_IMPORT)
    mark, release = tmp_path / "holding", tmp_path / "release"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
        "HOLD_IMPORT": "confluent_kafka",
        "HOLD_MARK": str(mark),
        "HOLD_RELEASE": str(release),
        "OUTBOX_DATABASE_URL": outbox_url,
        "OUTBOX_KAFKA_BOOTSTRAP_SERVERS": bootstrap_servers,
        "INBOX_TEST_TOPICS": topic,
        "INBOX_TEST_GROUP": name,
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "outbox.cli", "consume", "tests.inbox_app:inbox"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for(lambda: mark.exists() or process.poll() is not None, 60, "the import held")
        process.send_signal(signal.SIGTERM)
    finally:
        release.touch()
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 0, output.decode(errors="replace")
    assert ledger_count(inbox_engine) == 0
    admin = AdminClient({"bootstrap.servers": bootstrap_servers})
    [listing] = [admin.list_consumer_groups(request_timeout=30).result(30)]
    assert name not in {g.group_id for g in listing.valid}, "it joined the group"


def test_a_write_that_fails_when_a_later_handler_flushes_it_parks_only_its_own_record(
    inbox_engine: sa.Engine, outbox_url: str, bootstrap_servers: str, make_topic
) -> None:
    """On the fast way the handlers' ORM writes wait for one flush at the end of the batch,
    but a later handler's query flushes them first (autoflush): the write of n=0 then fails
    inside n=1's handler. Only n=0 may pay for it; n=1 must be applied, not parked in its
    place (with max_attempts=1, a record blamed once is parked without another try)."""
    from sqlalchemy.orm import DeclarativeBase, Session, mapped_column

    from outbox.inbox import Inbox, InboxMessage

    class Base(DeclarativeBase):
        pass

    class Account(Base):
        __tablename__ = "accounts"
        id = mapped_column(sa.Integer, primary_key=True)

    Base.metadata.create_all(inbox_engine)
    with inbox_engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO accounts VALUES (1)"))
    topic = make_topic("inbox-autoflush")
    produce(bootstrap_servers, topic, range(10), keys=1)
    inbox = Inbox(group=group())

    @inbox.handler(topic)
    def on_order(message: InboxMessage, session: Session) -> None:
        if message.value["n"] == 0:
            session.add(Account(id=1))  # already there: fails when flushed
            return
        session.execute(inbox_app._INSERT, inbox_app.apply(message, session))  # flushes first

    config = consumer_config(outbox_url, bootstrap_servers, max_attempts=1)
    with running_consumer(inbox, config):
        wait_for(
            lambda: ledger_count(inbox_engine) + len(parked_rows(inbox_engine)) == 10,
            60,
            "every record applied or parked",
        )
    assert [row.kafka_offset for row in parked_rows(inbox_engine)] == [0]
    assert_exactly_once(inbox_engine, range(1, 10))


def test_a_record_the_identity_function_fails_on_is_parked_not_fatal(
    inbox_engine: sa.Engine, outbox_url: str, bootstrap_servers: str, make_topic
) -> None:
    """An identity function (``missing_id``) that raises on a record parks that record, as
    one returning None does; it does not end the consumer (which, started again, would end
    on the same record again)."""
    topic = make_topic("inbox-identity-raises")
    producer = Producer({"bootstrap.servers": bootstrap_servers})
    for n in range(5):
        value = {"n": n, "amount": n} if n != 2 else {"amount": 2}  # n=2 lacks its key
        producer.produce(
            topic, orjson.dumps(value), key=b"k", headers=[("content-type", b"application/json")]
        )
    producer.flush(30)

    def by_n(record) -> str:  # type: ignore[no-untyped-def]
        return f"order-{orjson.loads(record.value)['n']}"

    inbox = inbox_app.make_inbox([topic], group(), missing_id=by_n)
    with running_consumer(inbox, consumer_config(outbox_url, bootstrap_servers)) as runner:
        wait_for(lambda: ledger_count(inbox_engine) == 4, 60, "the others applied")
        wait_for(lambda: len(parked_rows(inbox_engine)) == 1, 10, "the record parked")
        assert runner.health.alive
    [row] = parked_rows(inbox_engine)
    assert (row.reason, row.kafka_offset) == ("no-identity", 2)
    assert "KeyError" in row.error


@pytest.mark.parametrize("batch", [False, True], ids=["per-message", "batch-handler"])
def test_a_write_breaking_a_deferred_constraint_parks_its_record_and_no_other(
    batch: bool, inbox_engine: sa.Engine, outbox_url: str, bootstrap_servers: str, make_topic
) -> None:
    """A deferred constraint fails at the commit, where no record is to blame: the batch is
    run again checking the deferred constraints after each record, so that only the record
    whose writes break one is retried and parked, and the consumer goes on (it used to take
    the failed commit for a database outage and retry the whole batch forever). Handlers
    that rely on deferral within their own writes still work."""
    from sqlalchemy.orm import Session

    from outbox.inbox import Inbox, InboxMessage

    with inbox_engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE parents (id int PRIMARY KEY)"))
        conn.execute(
            sa.text(
                "CREATE TABLE children (n int PRIMARY KEY, parent int REFERENCES parents (id) "
                "DEFERRABLE INITIALLY DEFERRED)"
            )
        )
        conn.execute(sa.text("INSERT INTO parents VALUES (1)"))
    topic = make_topic("inbox-deferred")
    produce(bootstrap_servers, topic, range(10), keys=1)
    inbox = Inbox(group=group())
    child = sa.text("INSERT INTO children VALUES (:n, :parent)")

    def write(message: InboxMessage, session: Session) -> None:
        n = message.value["n"]
        if n == 3:
            session.execute(child, {"n": n, "parent": 999})  # no such parent: breaks at commit
        elif n == 5:  # the child first, its parent after: fine once the handler is done
            session.execute(child, {"n": n, "parent": 500})
            session.execute(sa.text("INSERT INTO parents VALUES (500)"))
        else:
            session.execute(child, {"n": n, "parent": 1})
        session.execute(inbox_app._INSERT, inbox_app.apply(message, session))

    if batch:

        @inbox.batch_handler(topic)
        def on_orders(messages: list[InboxMessage], session: Session) -> None:
            for message in messages:
                write(message, session)

    else:
        inbox.handler(topic)(write)

    config = consumer_config(outbox_url, bootstrap_servers, max_attempts=2)
    with running_consumer(inbox, config) as runner:
        wait_for(
            lambda: ledger_count(inbox_engine) + len(parked_rows(inbox_engine)) == 10,
            60,
            "every record applied or parked",
        )
        assert runner.health.database_ok
        [row] = parked_rows(inbox_engine)
        assert (row.kafka_offset, row.attempts) == (3, 2)
        assert "children_parent_fkey" in row.error
        assert_exactly_once(inbox_engine, [n for n in range(10) if n != 3])
        # An operator's retry of it breaks the constraint again: it is parked again, alone,
        # and a message requeued with it is applied (the requeue's commit used to fail for
        # all of them, again and again).
        with inbox_engine.begin() as conn:
            conn.execute(
                sa.text(
                    "INSERT INTO inbox_parked (consumer_group, message_id, topic, kafka_partition, "
                    "kafka_offset, key, value, header_names, header_values, reason, error, "
                    "attempts) SELECT consumer_group, 'another', topic, kafka_partition, "
                    "kafka_offset + 100, key, convert_to('{\"n\": 42, \"amount\": 42}', 'UTF8'), "
                    "header_names, header_values, reason, error, attempts "
                    "FROM inbox_parked"
                )
            )
        retried = CliRunner().invoke(
            main, ["inbox", "parked", "retry", "--all", "--database-url", outbox_url]
        )
        assert "requeued 2 parked message(s)" in retried.output, retried.output
        wait_for(lambda: ledger_count(inbox_engine) == 10, 30, "the other requeued one applied")
        wait_for(
            lambda: (
                [(r.kafka_offset, r.status) for r in parked_rows(inbox_engine)] == [(3, PARKED)]
            ),
            30,
            "the culprit parked again",
        )
        assert runner.health.database_ok
    with inbox_engine.connect() as conn:
        children = conn.execute(sa.text("SELECT n FROM children ORDER BY n")).scalars().all()
    assert children == [n for n in range(10) if n != 3] + [42]
