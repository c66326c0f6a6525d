"""One shard's trouble must not hold the others: a take-over that does not end (a slow or
failing-over transaction coordinator), and health once a shard is wedged. Against the stub
sender (deterministic: it decides when a take-over or a batch ends), on a real PostgreSQL."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

import pytest
import sqlalchemy as sa

from outbox.relay.commands import Batch
from outbox.relay.config import RelayConfig
from outbox.relay.daemon import Relay
from outbox.schema import SHARD_COUNT
from outbox.sending import Ack
from tests.relay_helpers import looping, statuses, wait_for
from tests.stub_sender import StubSender, by_key_in_seq_order, publish, stub_config, stub_relay

pytestmark = pytest.mark.integration


def eos_config(outbox_url: str, **overrides: Any) -> RelayConfig:
    return stub_config(outbox_url, mode="exactly-once", **overrides)


def owns_all(relay: Relay) -> bool:
    return len(relay.owned_shards) == SHARD_COUNT


class HangingTakeOvers:
    """The first take-over ends at once; later ones wait until ``release`` is set, as
    ``init_transactions`` does on a transaction coordinator that does not answer."""

    def __init__(self, stub: StubSender) -> None:
        self.stub = stub
        self.hanging = threading.Event()
        self.release = threading.Event()
        stub.answer_take_over = self.take_over

    def take_over(self, shards: Sequence[int]) -> dict[int, list[Ack]]:
        if len(self.stub.take_overs) > 1:
            self.hanging.set()
            self.release.wait(60)
        return {}


def healthz(relay: Relay) -> tuple[int, str]:
    """(status, body) of the relay's /healthz (``metrics_port=0``)."""
    wait_for(lambda: relay.metrics_server_port is not None, 10, "the metrics port")
    url = f"http://127.0.0.1:{relay.metrics_server_port}/healthz"
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def stub_shard(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT shard FROM outbox")).scalar_one())


def pending_by_shard(engine: sa.Engine) -> dict[int, int]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT shard, count(*) FROM outbox WHERE status = 'pending' GROUP BY shard")
        )
        return {int(shard): int(count) for shard, count in rows}


def gain_back_half(relay: Relay, outbox_url: str) -> None:
    """A second relay takes half the shards, then stops: ``relay`` gains them back."""
    with looping(stub_relay(eos_config(outbox_url), StubSender())):
        wait_for(lambda: len(relay.owned_shards) == SHARD_COUNT // 2, 20, "half the shards")


def test_a_take_over_that_does_not_end_holds_only_its_own_shards(
    engine: sa.Engine, outbox_url: str
) -> None:
    """Taken over inside the loop, one hanging take-over held every shard's messages for as
    long as it hung (a minute per shard with init_transactions(60)). In the background, the
    shards already owned go on; the gained ones are read only once it ended (no send before
    the progress is recovered), and the relay's health says which is wedged."""
    stub = StubSender()
    hanging = HangingTakeOvers(stub)
    relay = stub_relay(eos_config(outbox_url, wedge_timeout=3.0), stub)
    try:
        with looping(relay):
            wait_for(lambda: owns_all(relay), 20, "every shard")
            gain_back_half(relay, outbox_url)
            kept = set(relay.owned_shards)
            wait_for(hanging.hanging.is_set, 20, "the take-over to hang")
            kept -= set(stub.take_overs[-1])
            publish(engine, 400, keys=100)  # every shard gets some
            began = time.monotonic()
            wait_for(lambda: not kept & set(pending_by_shard(engine)), 10, "the kept shards sent")
            kept_sent_in = time.monotonic() - began
            gained = set(range(SHARD_COUNT)) - kept
            assert set(pending_by_shard(engine)) == gained  # untouched until taken over
            assert relay.health.alive  # the loop turns, the shards it can serve go on
            wait_for(lambda: not relay.health.alive, 10, "wedged")
            assert "wedged" in relay.health.not_alive_because()
            hanging.release.set()
            wait_for(lambda: statuses(engine) == {"sent": 400}, 20, "all sent")
            assert relay.health.alive
    finally:
        hanging.release.set()
    assert len(stub.acked) == 400 and by_key_in_seq_order(stub.acked)
    print(f"shards already owned sent within {kept_sent_in:.2f}s beside a hanging take-over")


def test_a_batch_that_never_ends_makes_the_relay_not_alive(
    engine: sa.Engine, outbox_url: str
) -> None:
    """One shard's batch never ends while the others' go: the loop turns and the other
    batches progress, so neither "stalled" nor "stuck" saw it (a chaos run met a relay
    answering ok for 286 s while its shard waited). Exactly-once: a batch per shard."""
    stub = StubSender()
    hang = threading.Event()
    hang.set()

    def holds(batch: Batch) -> bool:
        return hang.is_set() and 0 in batch.shards

    stub.holds = holds
    relay = stub_relay(eos_config(outbox_url), stub)
    with looping(relay):
        try:
            wait_for(lambda: owns_all(relay), 20, "every shard")
            relay.health.stale_after = 2.0  # the delivery timeout and more for real
            publish(engine, 400, keys=100)
            wait_for(lambda: set(pending_by_shard(engine)) == {0}, 10, "all but shard 0 sent")
            deadline = time.monotonic() + 10
            while relay.health.alive and time.monotonic() < deadline:
                publish(engine, 20, keys=20)  # the other shards keep progressing
                time.sleep(0.2)
            assert not relay.health.alive
            assert "wedged" in relay.health.not_alive_because()
        finally:
            hang.clear()  # (the shutdown waits for it)
    assert by_key_in_seq_order(stub.acked)


def test_a_mark_waiting_for_an_operators_row_lock_makes_the_relay_not_alive(
    engine: sa.Engine, outbox_url: str
) -> None:
    """An operator's open transaction holds a row lock the relay's mark needs: the mark
    cannot record that row (and tries again), its shard waits, while the loop turns. The
    relay's /healthz answers 503 "wedged" after the wedge timeout, so that a supervisor
    restarts it, and once the lock goes the mark ends and it answers 200 again."""
    [row_id] = publish(engine, 1, keys=1)
    stub = StubSender()
    relay = stub_relay(stub_config(outbox_url, wedge_timeout=2.0, metrics_port=0), stub)
    with engine.connect() as operator:
        operator.execute(sa.text("SELECT id FROM outbox WHERE id = :id FOR UPDATE"), {"id": row_id})
        with looping(relay):
            wait_for(lambda: [r.id for r in stub.acked] == [row_id], 20, "the ack")
            wait_for(lambda: healthz(relay)[0] == 503, 15, "/healthz 503")
            assert "wedged" in healthz(relay)[1]
            assert statuses(engine) == {"pending": 1}
            operator.rollback()
            wait_for(lambda: statuses(engine) == {"sent": 1}, 10, "the mark")
            wait_for(lambda: healthz(relay)[0] == 200, 10, "/healthz 200")


def test_a_mark_waiting_for_a_row_lock_is_wedged_after_the_wedge_timeout(
    engine: sa.Engine, outbox_url: str
) -> None:
    """A mark has a bound of its own (``--wedge-timeout``), far below the liveness bound of a
    batch on its way to Kafka (the delivery timeout and more: six minutes by default), so a
    mark blocked on an operator's row lock turns /healthz bad within the stated bound."""
    [row_id] = publish(engine, 1, keys=1)
    stub = StubSender()
    relay = stub_relay(stub_config(outbox_url, wedge_timeout=1.0), stub)
    assert relay.health.stale_after >= 300  # the default delivery timeout's bound, untouched
    with engine.connect() as operator:
        operator.execute(sa.text("SELECT id FROM outbox WHERE id = :id FOR UPDATE"), {"id": row_id})
        with looping(relay):
            wait_for(lambda: [r.id for r in stub.acked] == [row_id], 20, "the ack")
            acked = time.monotonic()
            wait_for(lambda: not relay.health.alive, 30, "wedged")
            took = time.monotonic() - acked
            assert relay.health.not_alive_because() == (
                "wedged: a mark or take-over of its shards has not ended for 1s"
            )
            assert took < 30  # the wedge timeout's 1 s and the loop's turns, not 300 s and more
            assert statuses(engine) == {"pending": 1}
            operator.rollback()
            wait_for(lambda: statuses(engine) == {"sent": 1}, 10, "the mark")
            wait_for(lambda: relay.health.alive, 10, "alive again")
    print(f"/healthz wedged {took:.2f}s after the ack (wedge timeout 1 s)")


def test_a_take_over_that_does_not_end_is_wedged_after_the_wedge_timeout(
    outbox_url: str,
) -> None:
    stub = StubSender()
    hanging = HangingTakeOvers(stub)
    relay = stub_relay(eos_config(outbox_url, wedge_timeout=1.0), stub)
    assert relay.health.stale_after >= 300
    try:
        with looping(relay):
            wait_for(lambda: owns_all(relay), 20, "every shard")
            gain_back_half(relay, outbox_url)
            wait_for(hanging.hanging.is_set, 20, "the take-over to hang")
            hung = time.monotonic()
            wait_for(lambda: not relay.health.alive, 30, "wedged")
            assert time.monotonic() - hung < 30  # not the liveness bound's 300 s and more
            assert relay.health.not_alive_because() == (
                "wedged: a mark or take-over of its shards has not ended for 1s"
            )
            hanging.release.set()
            wait_for(lambda: relay.health.alive, 10, "alive again")
    finally:
        hanging.release.set()


def test_a_failure_mark_waiting_for_a_row_lock_is_wedged_after_the_wedge_timeout(
    engine: sa.Engine, outbox_url: str
) -> None:
    """A failed row is recorded like an acknowledged one, waiting for no row lock: blocked,
    its shard waits and the mark is tried again; the mark's own bound says so, within it."""
    [row_id] = publish(engine, 1, keys=1)
    stub = StubSender()
    stub.decide = lambda record: "dead"
    relay = stub_relay(stub_config(outbox_url, wedge_timeout=1.0), stub)
    with engine.connect() as operator:
        operator.execute(sa.text("SELECT id FROM outbox WHERE id = :id FOR UPDATE"), {"id": row_id})
        with looping(relay):
            wait_for(lambda: ("end", frozenset({stub_shard(engine)})) in stub.log, 20, "its end")
            ended = time.monotonic()
            wait_for(lambda: not relay.health.alive, 30, "wedged")
            assert time.monotonic() - ended < 30  # not the liveness bound's 300 s and more
            assert relay.health.not_alive_because() == (
                "wedged: a mark or take-over of its shards has not ended for 1s"
            )
            assert statuses(engine) == {"pending": 1}
            operator.rollback()
            wait_for(lambda: statuses(engine) == {"dead": 1}, 10, "the failure recorded")
            wait_for(lambda: relay.health.alive, 10, "alive again")
