"""The inbox tests' consuming service with dead letters on: what it parks also goes to
``<topic>.dlq`` through the outbox table of its own database. ``outbox consume
tests.inbox_dead_letter_app:inbox`` reads INBOX_TEST_TOPICS / INBOX_TEST_GROUP."""

from __future__ import annotations

import os

from outbox import Outbox
from outbox.inbox import DeadLetters
from tests.inbox_app import make_inbox

inbox = make_inbox(
    [t for t in os.environ.get("INBOX_TEST_TOPICS", "unset").split(",") if t],
    os.environ.get("INBOX_TEST_GROUP", "inbox-tests"),
    dead_letters=DeadLetters(Outbox()),
)
