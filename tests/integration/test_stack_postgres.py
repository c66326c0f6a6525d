"""The local PostgreSQL is real: a round trip through SQLAlchemy 2 and psycopg 3."""

import pytest
import sqlalchemy as sa

pytestmark = pytest.mark.integration


def test_round_trip_through_sqlalchemy_and_psycopg(database_url: str) -> None:
    engine = sa.create_engine(database_url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE items (id serial PRIMARY KEY, body jsonb NOT NULL)"))
            conn.execute(
                sa.text("INSERT INTO items (body) VALUES (CAST(:body AS jsonb))"),
                [{"body": '{"n": 1}'}, {"body": '{"n": 2}'}],
            )
        with engine.connect() as conn:
            rows = conn.execute(sa.text("SELECT body->>'n' FROM items ORDER BY id")).scalars().all()
            version = conn.execute(sa.text("SHOW server_version_num")).scalar_one()
            listen = conn.execute(sa.text("SHOW listen_addresses")).scalar_one()
        assert rows == ["1", "2"]
        assert engine.dialect.driver == "psycopg"
        assert int(version) >= 130000
        assert listen == "127.0.0.1"
    finally:
        engine.dispose()


def test_rolled_back_transaction_leaves_nothing(database_url: str) -> None:
    engine = sa.create_engine(database_url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE items (id int PRIMARY KEY)"))
        with pytest.raises(RuntimeError), engine.begin() as conn:
            conn.execute(sa.text("INSERT INTO items VALUES (1)"))
            raise RuntimeError("business failure")
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM items")).scalar_one() == 0
    finally:
        engine.dispose()


def test_each_test_gets_its_own_database(database_url: str, postgres_server) -> None:  # type: ignore[no-untyped-def]
    engine = sa.create_engine(database_url)
    try:
        with engine.connect() as conn:
            name = conn.execute(sa.text("SELECT current_database()")).scalar_one()
        assert name.startswith("test_")
        assert database_url.endswith("/" + name)
    finally:
        engine.dispose()


def test_wal_is_decoded_and_a_database_with_slots_in_use_still_drops(  # type: ignore[no-untyped-def]
    postgres_server,
) -> None:
    import uuid

    import psycopg

    from outbox.wal.stream import ReplicationStream

    name = f"slots_{uuid.uuid4().hex[:8]}"
    postgres_server.create_database(name)
    with psycopg.connect(postgres_server.conninfo(name), autocommit=True) as conn:
        assert conn.execute("SHOW wal_level").fetchone() == ("logical",)
        conn.execute("CREATE PUBLICATION nothing")
        for slot in ("idle_slot", "busy_slot"):
            conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
    stream = ReplicationStream(postgres_server.conninfo(name))
    try:
        stream.start("busy_slot", 0, {"proto_version": "1", "publication_names": "nothing"})
        postgres_server.drop_database(name)  # PostgreSQL alone refuses: slots belong to it
    finally:
        stream.close()
    with psycopg.connect(postgres_server.conninfo(), autocommit=True) as conn:
        left = conn.execute(
            "SELECT slot_name FROM pg_replication_slots WHERE database = %s", (name,)
        )
        assert left.fetchall() == []
        assert (
            conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is None
        )
