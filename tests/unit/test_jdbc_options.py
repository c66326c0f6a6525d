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


@pytest.mark.parametrize(
    "url",
    [
        "postgresql+psycopg://app:pw@/shop?host=10.0.0.1:5432&host=10.0.0.2:5433"
        "&target_session_attrs=read-write",
        "postgresql://app:pw@/shop?host=10.0.0.1,10.0.0.2&port=5432,5433"
        "&target_session_attrs=read-write",
    ],
)
def test_a_url_listing_two_servers_lists_both_and_asks_for_the_primary(url: str) -> None:
    assert jdbc_options(url) == {
        "url": "jdbc:postgresql://10.0.0.1:5432,10.0.0.2:5433/shop?targetServerType=primary",
        "driver": "org.postgresql.Driver",
        "user": "app",
        "password": "pw",
    }


def test_one_port_serves_every_listed_host_and_a_missing_port_is_5432() -> None:
    assert jdbc_options("postgresql:///shop?host=a,b&port=6000")["url"] == (
        "jdbc:postgresql://a:6000,b:6000/shop"
    )
    assert jdbc_options("postgresql:///shop?host=a&host=b:6001")["url"] == (
        "jdbc:postgresql://a:5432,b:6001/shop"
    )


def test_host_and_port_lists_of_different_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="2 hosts but 3 ports"):
        jdbc_options("postgresql:///shop?host=a,b&port=1,2,3")
    with pytest.raises(ValueError, match="no JDBC equivalent"):
        jdbc_options("postgresql:///shop?host=a&target_session_attrs=nonsense")
