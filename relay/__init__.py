"""The relay daemon: publishes pending outbox rows to Kafka and marks them sent."""
