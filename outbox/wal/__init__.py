"""The WAL source: reading the outbox from PostgreSQL's logical decoding."""
