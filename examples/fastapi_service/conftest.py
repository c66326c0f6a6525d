"""The order service's tests get the outbox's test fixtures: ``outbox_database_url``,
``published`` and ``feed_inbox`` (docs/testing.md). Two fixtures of the service's own: its
database made by its own Alembic history (the service's tables and the outbox's), which
overrides the plugin's ``outbox_database_url``; and the fulfilment service's database, a
second one, with the inbox's tables."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.config import Config

from examples.fastapi_service import fulfilment
from outbox.testing import test_server_url, throwaway_database

pytest_plugins = ["outbox.testing"]

ALEMBIC_INI = Path(__file__).with_name("alembic.ini")


@pytest.fixture
def outbox_database_url(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The service's database as its migrations make it: `alembic upgrade heads`."""
    with throwaway_database(test_server_url(), outbox=False) as url:
        monkeypatch.setenv("OUTBOX_DATABASE_URL", url)  # what migrations/env.py reads
        command.upgrade(Config(str(ALEMBIC_INI)), "heads")
        yield url


@pytest.fixture
def fulfilment_database_url() -> Iterator[str]:
    """The consuming service's own database: its tables and the inbox's."""
    with throwaway_database(test_server_url(), outbox=False, inbox=True) as url:
        engine = sa.create_engine(url)
        fulfilment.Base.metadata.create_all(engine)  # its migrations, in a real service
        engine.dispose()
        yield url
