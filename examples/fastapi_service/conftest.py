"""The order service's tests get the outbox's test fixtures: ``outbox_database_url`` (a
throwaway database on the server OUTBOX_TEST_DATABASE_URL names), ``published`` and
``feed_inbox`` (docs/testing.md)."""

pytest_plugins = ["outbox.testing"]
