"""A pytest plugin for Django services' tests, under pytest-django:
``pytest_plugins = ["outbox.django.testing"]`` in a ``conftest.py``.

Its fixture ``published`` is a :class:`~outbox.testing.PublishedMessages` reading through
Django's default connection, watching from the test's start. Under pytest-django's ``db``
(each test in a transaction rolled back afterwards) it sees what the code under test
published in that transaction; under ``transactional_db``, what it committed. A test that
asks for neither gets ``db``. The tables come from the test database's migrations (the
``outbox.django`` app's among them). docs/django.md shows it in use.

PYTEST_DONT_REWRITE: nothing here asserts (see :mod:`outbox.testing`).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from outbox.django import published_messages
from outbox.testing import PublishedMessages


@pytest.fixture
def published(request: pytest.FixtureRequest) -> Iterator[PublishedMessages]:
    """What the test publishes to the outbox of Django's default database, from now on."""
    # Database access first (pytest-django's own fixture decides which kind, from the
    # test's marker and fixtures), whatever order the test names its fixtures in.
    transactional = "transactional_db" in request.fixturenames
    request.getfixturevalue("transactional_db" if transactional else "db")
    watcher = published_messages()
    yield watcher
    watcher.close()
