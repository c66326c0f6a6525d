"""PySpark jobs that audit the outbox against what landed in Kafka."""
