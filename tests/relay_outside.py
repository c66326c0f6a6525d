"""Watching a relay from outside, as a user would: ``run()`` on a thread whose outcome is kept
(what it returned or raised), its /metrics and /healthz, the outbox table read with SQL, and
topics with settings of their own. Nothing here reaches into the relay's internals."""

from __future__ import annotations

import re
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import sqlalchemy as sa
from prometheus_client.parser import text_string_to_metric_families

from outbox.relay.config import RelayConfig
from outbox.relay.daemon import Relay
from outbox.schema import shard_of


class WatchedRelay:
    """A :class:`Relay` whose ``run()`` runs on a thread of its own; what it returned, or the
    exception it raised, is kept for the test to look at."""

    def __init__(self, config: RelayConfig, name: str = "relay") -> None:
        self.relay = Relay(config)
        self.returned: int | None = None
        self.raised: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"test-{name}", daemon=True)

    def _run(self) -> None:
        try:
            self.returned = self.relay.run()
        except BaseException as error:  # kept: the test says what ended the loop
            self.raised = error

    @property
    def running(self) -> bool:
        return self.thread.is_alive()

    def ended_because(self) -> str:
        """Why ``run()`` is over (for assertion messages)."""
        if self.raised is not None:
            return f"run() raised {self.raised!r}"
        return f"run() returned {self.returned}"

    def assert_running(self) -> None:
        assert self.running, f"the relay's loop ended: {self.ended_because()}"

    def stop(self, timeout: float = 60) -> float:
        """Ask the relay to stop; the seconds until ``run()`` was over (``timeout`` if never)."""
        began = time.monotonic()
        self.relay.stop()
        self.thread.join(timeout)
        return time.monotonic() - began

    # -- the metrics and health endpoints (with RelayConfig(metrics_port=0)) ------------------

    @property
    def port(self) -> int:
        wait_until(lambda: self.relay.metrics_server_port is not None, 30, "the metrics port")
        port = self.relay.metrics_server_port
        assert port is not None
        return port

    def get(self, path: str, timeout: float = 5) -> tuple[int, str]:
        """(status, body) of one of the relay's endpoints."""
        url = f"http://127.0.0.1:{self.port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()

    def metric(self, name: str, **labels: str) -> float:
        """The sum of ``name``'s samples (with these labels) on /metrics; 0 when absent."""
        _, text = self.get("/metrics")
        total = 0.0
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(
                    sample.labels.get(k) == v for k, v in labels.items()
                ):
                    total += sample.value
        return total

    def owned_shards(self) -> int:
        return int(self.metric("outbox_relay_owned_shards"))


@contextmanager
def watched(config: RelayConfig, name: str = "relay") -> Iterator[WatchedRelay]:
    """A :class:`WatchedRelay` running for the length of the block, stopped after."""
    relay = WatchedRelay(config, name)
    relay.thread.start()
    try:
        yield relay
    finally:
        relay.stop()
        assert not relay.running, f"{name} did not stop within 60 s of stop()"


def wait_until(check: Callable[[], Any], timeout: float, what: str) -> float:
    """Wait for ``check()`` to be true; the seconds it took. ``check`` may raise to fail at
    once (a relay whose loop ended, say)."""
    began = time.monotonic()
    while True:
        if check():
            return time.monotonic() - began
        if time.monotonic() - began > timeout:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.1)


def statuses_of(engine: sa.Engine, ids: list[uuid.UUID]) -> dict[uuid.UUID, str]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT id, status FROM outbox WHERE id = ANY(:ids)"), {"ids": ids}
        )
        return {row_id: status for row_id, status in rows}


def all_sent(engine: sa.Engine, ids: list[uuid.UUID]) -> bool:
    return set(statuses_of(engine, ids).values()) == {"sent"} and bool(ids)


def keys_in_shards(count: int, prefix: str = "key") -> list[str]:
    """``count`` keys, each in a shard of its own (at most 16)."""
    keys: list[str] = []
    shards: set[int] = set()
    n = 0
    while len(keys) < count:
        key = f"{prefix}-{n}"
        shard = shard_of(key.encode(), uuid.UUID(int=0))
        if shard not in shards:
            shards.add(shard)
            keys.append(key)
        n += 1
    return keys


@contextmanager
def holding(outbox_url: str, statement: str, *params: Any) -> Iterator[Callable[[], None]]:
    """``statement`` run in a transaction left open (its row locks held) until the block ends
    or the yielded ``release()`` is called, which rolls it back."""
    url = sa.make_url(outbox_url)
    conn = psycopg.connect(
        host=url.host, port=url.port, user=url.username, password=url.password, dbname=url.database
    )
    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            conn.rollback()

    try:
        conn.execute(statement, params)
        yield release
    finally:
        release()
        conn.close()


def mode_options(mode: str, name: str) -> dict[str, Any]:
    """RelayConfig options for ``mode``; exactly-once with transactional ids and a progress
    topic of the test's own (``name``), so that no other test's relay fences it."""
    if mode != "exactly-once":
        return {"mode": mode}
    prefix = f"{name}-{uuid.uuid4().hex[:8]}"
    return {"mode": mode, "transactional_id_prefix": prefix, "progress_topic": f"{prefix}-progress"}


def rows_by_status(engine: sa.Engine) -> dict[str, set[uuid.UUID]]:
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT id, status FROM outbox"))
        found: dict[str, set[uuid.UUID]] = {}
        for row_id, status in rows:
            found.setdefault(status, set()).add(row_id)
        return found


def keys_out_of_order(
    engine: sa.Engine, records: list[Any], ids_on_topic: list[uuid.UUID]
) -> dict[bytes, tuple[list[uuid.UUID], list[uuid.UUID]]]:
    """The keys whose messages reached the topic (first copies, in partition order) other than
    in their commit order (seq) among the rows sent: key -> (on the topic, expected)."""
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT id, key FROM outbox WHERE status = 'sent' ORDER BY seq")
        )
        expected: dict[bytes, list[uuid.UUID]] = {}
        for row_id, key in rows:
            expected.setdefault(bytes(key), []).append(row_id)
    seen: set[uuid.UUID] = set()
    found: dict[bytes, list[uuid.UUID]] = {}
    ordered = sorted(
        zip(records, ids_on_topic, strict=True), key=lambda r: (r[0].partition(), r[0].offset())
    )
    for record, message_id in ordered:
        if message_id not in seen:
            seen.add(message_id)
            found.setdefault(record.key(), []).append(message_id)
    return {
        key: (found.get(key, []), ids) for key, ids in expected.items() if found.get(key, []) != ids
    }


#: Counters on /metrics that count failures, whatever their exact name: the retried and dead
#: messages, and any counter of failed, erroring or aborted work.
FAILURE_COUNTER = re.compile(r"retried|dead|fail|error|abort")


def failures_counted(relay: WatchedRelay) -> dict[str, float]:
    """The failure counters on the relay's /metrics that are above 0 (name -> total)."""
    _, text = relay.get("/metrics")
    counted: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.type != "counter" or not FAILURE_COUNTER.search(family.name):
            continue
        total = sum(s.value for s in family.samples if s.name.endswith("_total"))
        if total > 0:
            counted[family.name] = total
    return counted
