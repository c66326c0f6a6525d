"""Running relays in tests: in a thread (to inspect them) or as `outbox relay` processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol, TypeVar

import sqlalchemy as sa

from outbox import ID_HEADER, Message, Outbox
from outbox.devstack.procs import free_port
from outbox.records import OutboxRecord
from outbox.relay.commands import Batch
from outbox.relay.config import RelayConfig
from outbox.relay.daemon import Relay
from outbox.relay.policy import RetryPolicy
from outbox.relay.sender import Sender
from outbox.rows import PendingRow
from outbox.sending import BatchResult


def send_and_wait(sender: Sender, records: Sequence[OutboxRecord]) -> BatchResult:
    """Send ``records`` on ``sender`` (a batch per shard, as the relay does exactly-once) and
    serve it until each batch ended: one merged result."""
    by_shard: dict[int, list[OutboxRecord]] = {}
    for record in records:
        by_shard.setdefault(record.shard, []).append(record)
    batches = []
    for number, (shard, part) in enumerate(sorted(by_shard.items()), start=1):
        rows = [PendingRow(r.id, shard, 0, datetime.now(UTC), r) for r in part]
        batches.append(Batch(number, rows, frozenset({shard}), time.monotonic()))
    for batch in batches:
        sender.start(batch)
    merged = BatchResult()
    left = len(batches)
    while left:
        for _, result in sender.serve(1.0):
            left -= 1
            merged.acks.extend(result.acks)
            merged.errors.update(result.errors)
            merged.not_attempted.extend(result.not_attempted)
            merged.lost_shards.extend(result.lost_shards)
    return merged


def relay_config(database_url: str, bootstrap: str, **overrides: Any) -> RelayConfig:
    options: dict[str, Any] = {
        "database_url": database_url,
        "kafka": {"bootstrap.servers": bootstrap, **overrides.pop("kafka", {})},
        "batch_size": 200,
        "poll_interval": 0.2,
        "rebalance_interval": 0.2,
        "delivery_timeout_ms": 10_000,
        "retry": RetryPolicy(max_attempts=5, base_seconds=0.2, cap_seconds=1.0),
    }
    options.update(overrides)
    return RelayConfig(**options)


R = TypeVar("R", bound="Runs")


class Runs(Protocol):
    def run(self) -> int: ...

    def stop(self) -> None: ...


@contextmanager
def running_in_thread(loop: R, name: str) -> Iterator[R]:
    """``loop.run()`` in a thread for the length of the block; stopped and joined after."""
    thread = threading.Thread(target=loop.run, name=f"test-{name}", daemon=True)
    thread.start()
    try:
        yield loop
    finally:
        loop.stop()
        thread.join(60)
        assert not thread.is_alive(), f"{name} did not stop"


def running_relay(config: RelayConfig) -> AbstractContextManager[Relay]:
    return running_in_thread(Relay(config), "relay")


class RelayProcess(subprocess.Popen[bytes]):
    metrics_port: int

    def ready(self) -> bool:
        try:
            url = f"http://127.0.0.1:{self.metrics_port}/readyz"
            return urllib.request.urlopen(url, timeout=1).status == 200
        except OSError:
            return False

    def wait_ready(self, timeout: float = 60) -> None:
        wait_for(self.ready, timeout, "the relay to be ready")


#: Every relay process a test started; the conftest kills what a failed test left running.
STARTED: list[RelayProcess] = []


def kill_leftovers() -> None:
    while STARTED:
        process = STARTED.pop()
        if process.poll() is None:
            process.kill()
            process.wait(10)


def start_relay_process(
    database_url: str, bootstrap: str, *args: str, log: Path | None = None, ready: bool = True
) -> RelayProcess:
    """`outbox relay` in a process of its own; waits for /readyz unless ``ready=False``."""
    port = free_port()
    env = {
        **os.environ,
        "OUTBOX_DATABASE_URL": database_url,
        "OUTBOX_KAFKA_BOOTSTRAP_SERVERS": bootstrap,
    }
    output = log.open("ab") if log else subprocess.DEVNULL
    try:
        process = RelayProcess(
            [
                sys.executable,
                "-m",
                "outbox.cli",
                "relay",
                "--metrics-port",
                str(port),
                "--poll-interval",
                "0.2",
                "--batch-size",
                "200",
                "--delivery-timeout-ms",
                "10000",
                *args,
            ],
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    finally:
        if log:
            output.close()  # type: ignore[union-attr]  # the child has its own descriptor
    process.metrics_port = port
    STARTED.append(process)
    if ready:
        process.wait_ready()
    return process


def stop_process(process: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> int:
    if process.poll() is None:
        process.send_signal(sig)
    return process.wait(60)


def publish_orders(
    engine: sa.Engine, topic: str, count: int, keys: int = 10, start: int = 0
) -> list[uuid.UUID]:
    """``count`` messages, round-robin over ``keys`` keys, ``n`` = a running number."""
    ob = Outbox(engine)
    ids: list[uuid.UUID] = []
    for first in range(start, start + count, 100):
        with ob.transaction() as tx:
            results = tx.publish_many(
                [
                    Message(topic, {"n": n}, key=f"key-{n % keys}")
                    for n in range(first, min(first + 100, start + count))
                ]
            )
        ids.extend(r.message_id for r in results)
    return ids


def statuses(engine: sa.Engine) -> dict[str, int]:
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT status, count(*) FROM outbox GROUP BY status"))
        return {row[0]: row[1] for row in rows}


def wait_for(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def message_id(record: Any) -> uuid.UUID:
    return uuid.UUID(dict(record.headers())[ID_HEADER].decode())


@contextmanager
def looping(relay: Relay) -> Iterator[Relay]:
    """``relay.run()`` on a thread of its own; stopped, and its thread joined, at the end."""
    thread = threading.Thread(target=relay.run, daemon=True)
    thread.start()
    try:
        yield relay
    finally:
        relay.stop()
        thread.join(60)
        assert not thread.is_alive()


def owns_all_and_sleeps(relay: Relay) -> bool:
    """The relay owns every shard and sleeps: a commit or a timer must wake it."""
    from outbox.schema import SHARD_COUNT

    return len(relay.owned_shards) == SHARD_COUNT and relay.asleep


def owns_every_shard(relay: Relay) -> bool:
    """The relay (alone) owns every shard and has taken each over."""
    from outbox.schema import SHARD_COUNT

    return len(relay.owned_shards) == SHARD_COUNT and not relay.core.taking_over
