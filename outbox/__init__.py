"""Transactional outbox for Python services on PostgreSQL and Kafka."""

__version__ = "0.1.0"
