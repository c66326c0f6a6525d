"""Session-wide local stack (real PostgreSQL, Kafka, Spark) and per-test isolation.

The stack is started once per test session in its own run folder and stopped at the end.
Each test gets a database of its own and topics with unique names. With CI=true a server that
cannot start fails the tests that need it; elsewhere those tests are skipped with the reason.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator

import pytest
import sqlalchemy as sa

from outbox.chaos.proxy import FaultProxy
from outbox.chaos.stack import route_through_proxy
from outbox.devstack import LocalStack, StackError
from outbox.devstack.kafka import KafkaBroker
from outbox.devstack.postgres import PostgresServer
from outbox.devstack.procs import free_port
from outbox.devstack.stack import spark_jars, sweep_stale_runs

IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def server_unavailable(what: str, error: BaseException) -> None:
    message = f"{what} is unavailable: {error}"
    if IN_CI:
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="session")
def local_stack() -> Iterator[LocalStack]:
    sweep_stale_runs("pytest-")
    stack = LocalStack.named(f"pytest-{os.getpid()}", durable=False)
    yield stack
    stack.down()


@pytest.fixture(scope="session")
def postgres_server(local_stack: LocalStack) -> PostgresServer:
    try:
        return local_stack.up_postgres()
    except StackError as exc:
        server_unavailable("PostgreSQL", exc)
        raise


@pytest.fixture(scope="session")
def _kafka_proxy() -> Iterator[FaultProxy]:
    proxy = FaultProxy(free_port(), free_port())
    proxy.start()
    yield proxy
    proxy.close()


@pytest.fixture(scope="session")
def kafka_broker(local_stack: LocalStack, _kafka_proxy: FaultProxy) -> KafkaBroker:
    """The session's broker; a second listener is reached only through a fault proxy (see
    ``faulty_kafka``)."""
    try:
        if not local_stack.kafka.running():
            route_through_proxy(local_stack.kafka, _kafka_proxy)
        return local_stack.up_kafka()
    except StackError as exc:
        server_unavailable("Kafka", exc)
        raise


@pytest.fixture
def faulty_kafka(kafka_broker: KafkaBroker, _kafka_proxy: FaultProxy) -> Iterator[FaultProxy]:
    """The fault proxy in front of the broker's second listener, healthy again after the test.

    Clients bootstrapped at ``f"127.0.0.1:{faulty_kafka.listen_port}"`` reach the broker (and
    every partition leader) only through it, so ``stall()``, ``drop()`` and latency hit all
    their traffic.
    """
    _kafka_proxy.heal()
    _kafka_proxy.set_latency(0)
    yield _kafka_proxy
    _kafka_proxy.heal()
    _kafka_proxy.set_latency(0)


@pytest.fixture
def database_url(postgres_server: PostgresServer) -> Iterator[str]:
    """A fresh, empty database for one test (SQLAlchemy URL, psycopg 3 driver)."""
    name = f"test_{uuid.uuid4().hex[:12]}"
    url = postgres_server.create_database(name)
    yield url
    postgres_server.drop_database(name)


@pytest.fixture(scope="session")
def outbox_template(postgres_server: PostgresServer) -> str:
    """A database migrated to head once per session; tests clone it."""
    from outbox import migrate

    name = "outbox_template"
    postgres_server.drop_database(name)
    migrate.upgrade(postgres_server.create_database(name))
    return name


@pytest.fixture
def outbox_url(postgres_server: PostgresServer, outbox_template: str) -> Iterator[str]:
    """A fresh database with the outbox table (public.outbox) for one test."""
    name = f"test_{uuid.uuid4().hex[:12]}"
    url = postgres_server.create_database(name, template=outbox_template)
    yield url
    postgres_server.drop_database(name)


@pytest.fixture
def engine(outbox_url: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(outbox_url)
    yield engine
    engine.dispose()


@pytest.fixture
def bootstrap_servers(kafka_broker: KafkaBroker) -> str:
    return kafka_broker.bootstrap_servers


@pytest.fixture
def make_topic(bootstrap_servers: str) -> Iterator[Callable[..., str]]:
    """Create topics with unique names for one test; they are deleted afterwards."""
    from confluent_kafka.admin import AdminClient

    from outbox.devstack.topics import create_topics

    admin = AdminClient({"bootstrap.servers": bootstrap_servers})
    created: list[str] = []

    def make(prefix: str = "t", partitions: int = 1) -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:10]}"
        create_topics(bootstrap_servers, [name], partitions)
        created.append(name)
        return name

    yield make
    if created:
        for future in admin.delete_topics(created, operation_timeout=30).values():
            future.result(timeout=30)


@pytest.fixture(scope="session")
def spark():  # type: ignore[no-untyped-def]
    try:
        from outbox.spark_jobs.session import build_session

        jars = [str(jar) for jar in spark_jars()]
        session = build_session("outbox-tests", master="local[2]", jars=jars, shuffle_partitions=2)
    except Exception as exc:  # a missing JVM or pyspark surfaces as many types
        server_unavailable("Spark", exc)
        raise
    session.sparkContext.setLogLevel("WARN")
    yield session
    session.stop()


@pytest.fixture(autouse=True)
def _no_relay_left_behind() -> Iterator[None]:
    """A test that fails half-way must not leave relay processes running."""
    yield
    from tests.relay_helpers import kill_leftovers

    kill_leftovers()
