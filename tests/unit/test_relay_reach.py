"""What a relay concludes about its reach to Kafka from what it saw (no I/O)."""

from __future__ import annotations

from outbox.relay.reach import EVIDENCE_SECONDS, STEP_ASIDE_AFTER, KafkaReach


def test_a_relay_without_shards_whose_take_over_failed_does_not_serve_on_probes() -> None:
    """Its old failure ends at a probe (it is not stalled for good), but it tells the others
    it serves only after an ack: else a relay whose take-overs fail too would step aside
    for it."""
    reach = KafkaReach()
    reach.probed(True, 0.0, idle=True)
    assert reach.serving(0.0, None, owns_shards=False)
    reach.failed(1.0, probe_clears=False)
    late = 1.0 + STEP_ASIDE_AFTER
    reach.probed(True, late, idle=True)
    assert reach.stalled_since(None) is None
    assert not reach.should_step_aside(late, None)
    assert not reach.serving(late, None, owns_shards=False)
    reach.reached(late + 1.0)
    assert reach.serving(late + 1.0, None, owns_shards=False)


def test_a_relay_with_shards_serves_on_probes_once_its_failed_take_over_is_old() -> None:
    """It sends the shards it owns: its share would wait if nobody stepped aside for it."""
    reach = KafkaReach()
    reach.reached(0.0)
    reach.failed(1.0, probe_clears=False)
    assert not reach.serving(1.0 + EVIDENCE_SECONDS, None, owns_shards=True)
    late = 1.0 + STEP_ASIDE_AFTER
    reach.probed(True, late, idle=True)
    assert reach.serving(late, None, owns_shards=True)


def test_a_relay_whose_batch_failed_serves_again_after_a_probe() -> None:
    reach = KafkaReach()
    reach.failed(0.0, probe_clears=True)
    assert not reach.serving(EVIDENCE_SECONDS, None, owns_shards=True)
    reach.probed(True, EVIDENCE_SECONDS, idle=True)
    assert reach.serving(EVIDENCE_SECONDS, None, owns_shards=True)


def test_a_take_over_that_worked_ends_the_pause_of_a_relay_back_early() -> None:
    """Back before its pause ended (nobody served), its take-over fenced: a reconnect later
    must not keep it out for the rest of the pause while another relay serves again."""
    reach = KafkaReach()
    pause = reach.stepped_aside(0.0)
    assert not reach.may_rejoin(1.0, other_members=1, others_serving=1)
    reach.reached(2.0)  # it came back early and took its share over
    assert reach.may_rejoin(3.0, other_members=1, others_serving=1)
    assert pause > 3.0


def test_the_batches_of_one_failure_double_the_pause_once() -> None:
    """Every shard's batch of an outage ends within a few milliseconds: the pause after them
    is the first one, not one doubled per shard (which made the relay wait the longest pause
    after Kafka's return)."""
    reach = KafkaReach()
    for shard in range(16):
        reach.failed(100.0 + shard * 0.005, probe_clears=True)
    assert reach.paused_until == 100.0 + 0.5
    reach.failed(100.6, probe_clears=True)  # the next try failed too: now it doubles
    assert reach.paused_until == 100.6 + 1.0
    assert not reach.may_send(101.5) and reach.may_send(101.6)
