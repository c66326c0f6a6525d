import pytest

from outbox.spark_jobs.jdbc import jdbc_options


def test_sqlalchemy_url_becomes_jdbc_options() -> None:
    options = jdbc_options("postgresql+psycopg://app:p%40ss@db.example:6543/shop")
    assert options == {
        "url": "jdbc:postgresql://db.example:6543/shop",
        "driver": "org.postgresql.Driver",
        "user": "app",
        "password": "p@ss",
    }


def test_defaults_fill_in_host_and_port() -> None:
    assert jdbc_options("postgresql:///shop")["url"] == "jdbc:postgresql://localhost:5432/shop"


def test_other_databases_are_refused() -> None:
    with pytest.raises(ValueError, match="only PostgreSQL"):
        jdbc_options("mysql://u:p@h/db")
