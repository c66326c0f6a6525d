"""The WAL source's refusal of a server too old for its publication (the integration tests
run PostgreSQL 15, so the refusal's text is checked here)."""

from outbox.wal.checks import version_refusal


def test_postgresql_15_and_later_serve() -> None:
    assert version_refusal(150000, "15.0") is None
    assert version_refusal(170002, "17.2") is None


def test_older_servers_are_refused_in_one_line() -> None:
    assert version_refusal(140011, "14.11") == (
        "PostgreSQL 14.11 is too old for the WAL source: it needs 15 or later "
        "(publications with column lists and row filters)"
    )
