"""Producing records for the inbox tests and running consumers (threads or processes)."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
import uuid
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import orjson
import sqlalchemy as sa
from confluent_kafka import Producer

from outbox.devstack.procs import free_port
from outbox.inbox import ConsumerConfig, Inbox, InboxRunner, install
from tests.inbox_app import LEDGER_DDL
from tests.relay_helpers import STARTED, RelayProcess, running_in_thread, wait_for


def prepare_database(url: str) -> sa.Engine:
    """Inbox tables and the ledger on ``url``; returns an engine on it."""
    install(url)
    engine = sa.create_engine(url, pool_pre_ping=True)
    with engine.begin() as conn:
        conn.exec_driver_sql(LEDGER_DDL)
    return engine


def produce(
    bootstrap: str,
    topic: str,
    numbers: range | list[int],
    *,
    keys: int = 10,
    ids: dict[int, uuid.UUID] | None = None,
    extra: dict[int, dict[str, Any]] | None = None,
    copies: int = 1,
    sleep: float = 0.0,
) -> dict[int, uuid.UUID]:
    """One record per n (``copies`` of each, same outbox-id), key ``key-{n % keys}``, value
    ``{"n": n, "amount": n}``. Returns the ids used."""
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    ids = dict(ids or {})
    for n in numbers:
        message_id = ids.setdefault(n, uuid.uuid4())
        value = {"n": n, "amount": n, **(extra or {}).get(n, {})}
        if sleep:
            value["sleep"] = sleep
        for _ in range(copies):
            producer.produce(
                topic,
                orjson.dumps(value),
                key=f"key-{n % keys}".encode(),
                headers=[
                    ("outbox-id", str(message_id).encode()),
                    ("content-type", b"application/json"),
                ],
            )
        producer.poll(0)
    assert producer.flush(30) == 0
    return ids


def ledger(engine: sa.Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(sa.text("SELECT * FROM ledger ORDER BY id")).all())


def ledger_count(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT count(*) FROM ledger")).scalar_one())


def assert_exactly_once(engine: sa.Engine, numbers: range | list[int]) -> None:
    """Every n applied once: one ledger row each, and the sum of amounts matches."""
    rows = ledger(engine)
    seen: dict[int, int] = {}
    for row in rows:
        seen[row.n] = seen.get(row.n, 0) + 1
    twice = sorted(n for n, count in seen.items() if count > 1)
    missing = sorted(set(numbers) - set(seen))
    assert not twice, f"applied more than once: {twice[:20]} ({len(twice)} in all)"
    assert not missing, f"never applied: {missing[:20]} ({len(missing)} in all)"
    assert sum(row.amount for row in rows) == sum(numbers)


def assert_partition_order(engine: sa.Engine) -> None:
    """Within each partition, records were applied in offset order: the ledger's ids (taken
    as rows are written) increase with the offsets."""
    last: dict[tuple[str, int], Any] = {}
    for row in ledger(engine):
        tp = (row.topic, row.kafka_partition)
        before = last.get(tp)
        assert before is None or row.kafka_offset > before.kafka_offset, (
            f"partition {tp}: offset {row.kafka_offset} (n={row.n}, pid {row.pid}) applied "
            f"after offset {before.kafka_offset} (n={before.n}, pid {before.pid})"
        )
        last[tp] = row


def consumer_config(url: str, bootstrap: str, **overrides: Any) -> ConsumerConfig:
    options: dict[str, Any] = {
        "database_url": url,
        "kafka": {"bootstrap.servers": bootstrap, **overrides.pop("kafka", {})},
        "batch_size": 100,
        "max_wait": 0.05,
        "backoff_base": 0.1,
        "backoff_max": 0.5,
        "requeue_interval": 0.2,
    }
    options.update(overrides)
    return ConsumerConfig(**options)


def running_consumer(inbox: Inbox, config: ConsumerConfig) -> AbstractContextManager[InboxRunner]:
    return running_in_thread(InboxRunner(inbox, config), "consumer")


class ConsumerProcess(RelayProcess):
    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        return str(urllib.request.urlopen(url, timeout=2).read().decode())


def start_consumer_process(
    url: str,
    bootstrap: str,
    topics: list[str],
    group: str,
    *args: str,
    log: Path | None = None,
    target: str = "tests.inbox_app:inbox",
) -> ConsumerProcess:
    """`outbox consume tests.inbox_app:inbox` (or ``target``) in a process of its own, once
    ready."""
    port = free_port()
    env = {
        **os.environ,
        "OUTBOX_DATABASE_URL": url,
        "OUTBOX_KAFKA_BOOTSTRAP_SERVERS": bootstrap,
        "INBOX_TEST_TOPICS": ",".join(topics),
        "INBOX_TEST_GROUP": group,
    }
    output = log.open("ab") if log else subprocess.DEVNULL
    try:
        process = ConsumerProcess(
            [
                sys.executable,
                "-m",
                "outbox.cli",
                "consume",
                target,
                "--metrics-port",
                str(port),
                "--max-wait",
                "0.05",
                "--backoff-base",
                "0.1",
                "--backoff-max",
                "1",
                *args,
            ],
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    finally:
        if log:
            output.close()  # type: ignore[union-attr]
    process.metrics_port = port
    STARTED.append(process)
    process.wait_ready()
    return process


def metric(text: str, name: str) -> float:
    """The sum of every sample of ``name`` in a Prometheus exposition."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


__all__ = ["wait_for"]
