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
