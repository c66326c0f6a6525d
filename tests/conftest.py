"""Session-wide local stack (real PostgreSQL, Kafka, Spark) and per-test isolation.

The stack is started once per test session in its own run folder and stopped at the end;
under pytest-xdist each worker is a session of its own, with its own stack. Each test gets a
database of its own and topics with unique names. With CI=true a server that cannot start
fails the tests that need it; elsewhere those tests are skipped with the reason.
"""

from __future__ import annotations

import os
import secrets
import uuid
from collections.abc import Callable, Iterator

import psycopg
import pytest
import sqlalchemy as sa

from outbox.chaos.proxy import FaultProxy
from outbox.chaos.stack import route_through_proxy
from outbox.devstack import LocalStack, StackError
from outbox.devstack.kafka import KafkaBroker
from outbox.devstack.postgres import SUPERUSER, PostgresServer
from outbox.devstack.procs import free_port
from outbox.devstack.stack import spark_jars, sweep_stale_runs

IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under xdist (``--dist loadgroup --no-loadscope-reorder``, as `make test` runs it):
    tests that share a costly fixture run on one worker, which sets it up once; tests marked
    ``slow`` are handed out first, then the groups, so that the short tests fill the workers
    beside them at the end instead of leaving one worker alone with a long test."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    for item in items:
        group = shared_fixture_group(item)
        if group and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group))
    items.sort(
        key=lambda item: (
            item.get_closest_marker("slow") is None,
            item.get_closest_marker("xdist_group") is None,
        )
    )


def shared_fixture_group(item: pytest.Item) -> str | None:
    """One in-process Spark session serves every test that uses ``spark``; a module's own
    fixture of a wider scope (a cluster, a built wheel) serves the tests of that module."""
    fixtures = getattr(item, "_fixtureinfo", None)
    if fixtures is None:
        return None
    if "spark" in fixtures.names_closure:
        return "spark"
    module = item.nodeid.split("::")[0]
    for definitions in fixtures.name2fixturedefs.values():
        if definitions[-1].scope != "function" and definitions[-1].baseid == module:
            return module
    return None


def server_unavailable(what: str, error: BaseException) -> None:
    message = f"{what} is unavailable: {error}"
    if IN_CI:
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Stop the stacks of a session killed with -9. Under xdist only the controller sweeps,
    before its workers start: a worker's sweep could take another's stack, half made."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        sweep_stale_runs("pytest-")


@pytest.fixture(scope="session")
def local_stack() -> Iterator[LocalStack]:
    stack = LocalStack.named(f"pytest-{os.getpid()}", durable=False)
    yield stack
    stack.down()


@pytest.fixture(scope="session")
def postgres_server(local_stack: LocalStack) -> Iterator[PostgresServer]:
    try:
        server = local_stack.up_postgres()
    except StackError as exc:
        server_unavailable("PostgreSQL", exc)
        raise
    yield server
    # Every other fixture is gone by now: none may have left a role or a database.
    if server.running():
        left = sorted(roles_and_databases(server) - SERVER_OWN)
        assert not left, f"left behind on the session's PostgreSQL: {', '.join(left)}"


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
    """A database migrated to head once per session; tests clone it. With
    ``OUTBOX_TEST_PARTITIONED=daily`` (or ``hourly``) its table has the partitioned layout, so
    that any test module runs against that layout."""
    from outbox import migrate

    name = "outbox_template"
    postgres_server.drop_database(name)
    partitioned = os.environ.get("OUTBOX_TEST_PARTITIONED") or None
    migrate.upgrade(postgres_server.create_database(name), partitioned=partitioned)
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
def login_role(outbox_url: str, postgres_server: PostgresServer) -> Iterator[Callable[..., str]]:
    """``login_role(*grants, prefix="role")``: a new login role on the test's database with
    only ``grants`` (statements with a ``{role}`` placeholder); returns a URL that connects as
    it. Roles belong to the whole server, not to the database: each is dropped after the test,
    with what it was granted, so none is left on the shared server."""
    created: list[str] = []

    def make(*grants: str, prefix: str = "role") -> str:
        name = f"{prefix}_{uuid.uuid4().hex[:8]}"
        password = secrets.token_urlsafe(12)
        with psycopg.connect(outbox_conninfo(outbox_url), autocommit=True) as conn:
            conn.execute(f"CREATE ROLE {name} LOGIN PASSWORD '{password}'")
            created.append(name)
            for grant in grants:
                conn.execute(grant.format(role=name))
        url = sa.make_url(outbox_url).set(username=name, password=password)
        return url.render_as_string(hide_password=False)

    yield make
    drop_roles(postgres_server, outbox_url, created)


def outbox_conninfo(url: str) -> str:
    """A SQLAlchemy URL as psycopg's connection string."""
    return sa.make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def drop_roles(server: PostgresServer, url: str, names: list[str]) -> None:
    """Drop ``names`` and what they were granted on ``url``'s database (still there)."""
    if not names:
        return
    with psycopg.connect(outbox_conninfo(url), autocommit=True) as conn:
        for name in names:
            conn.execute(f"DROP OWNED BY {name}")
    with psycopg.connect(server.conninfo(), autocommit=True) as conn:
        for name in names:
            # A relay the test started may still hold a session as the role.
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (name,)
            )
            conn.execute(f"DROP ROLE {name}")


@pytest.fixture
def bootstrap_servers(kafka_broker: KafkaBroker) -> str:
    return kafka_broker.bootstrap_servers


@pytest.fixture
def make_topic(bootstrap_servers: str) -> Iterator[Callable[..., str]]:
    """Create topics with unique names for one test (``make(prefix, partitions, config)``,
    ``config`` the topic's settings); they are deleted afterwards."""
    from confluent_kafka.admin import AdminClient

    from outbox.devstack.topics import create_topics

    admin = AdminClient({"bootstrap.servers": bootstrap_servers})
    created: list[str] = []

    def make(prefix: str = "t", partitions: int = 1, config: dict[str, str] | None = None) -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:10]}"
        create_topics(bootstrap_servers, [name], partitions, config)
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


def roles_and_databases(server: PostgresServer) -> set[str]:
    """What a test could leave on the server: its roles and databases, by name."""
    with psycopg.connect(server.conninfo(), autocommit=True) as conn:
        rows = conn.execute(
            "SELECT 'role ' || rolname FROM pg_roles WHERE rolname !~ '^pg_'"
            " UNION ALL SELECT 'database ' || datname FROM pg_database"
        ).fetchall()
    return {row[0] for row in rows}


#: What the session's PostgreSQL holds before any test and keeps until the end.
SERVER_OWN = {
    f"role {SUPERUSER}",
    *(f"database {name}" for name in ("postgres", "template0", "template1", "outbox_template")),
}


@pytest.fixture(autouse=True)
def _no_role_left_behind(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that uses the session's PostgreSQL leaves no role on it: roles belong to the
    server, not to the test's database, and later tests would inherit them. (Databases are
    looked at when the session ends: a session fixture may keep one for later tests.)

    Fixtures of a wider scope are set up before the first look, so a role one of them keeps
    for the module's tests is not counted as left behind by the first test.
    """
    if "postgres_server" not in request.fixturenames:
        yield
        return
    for name, definitions in request.node._fixtureinfo.name2fixturedefs.items():  # type: ignore[attr-defined]
        if definitions[-1].scope != "function":
            request.getfixturevalue(name)
    server: PostgresServer = request.getfixturevalue("postgres_server")
    before = roles_and_databases(server)
    yield
    if not server.running():
        return  # stopped by the test on purpose; nothing to look at
    left = sorted(r for r in roles_and_databases(server) - before if r.startswith("role "))
    assert not left, f"left behind on the session's PostgreSQL: {', '.join(left)}"


@pytest.fixture(autouse=True)
def _no_relay_left_behind() -> Iterator[None]:
    """A test that fails half-way must not leave relay processes running."""
    yield
    from tests.relay_helpers import kill_leftovers

    kill_leftovers()
