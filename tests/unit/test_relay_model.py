"""The model-based test of the relay: real relays in a simulated world (tests/relay_sim.py).

Each run draws its world from a seed: one to three relays (started, stopped, crashed, their
database sessions killed, their own path to Kafka cut), at-least-once or exactly-once,
keep-nothing or not, the batch size and the rebalance interval; writers committing one to
four messages at a time (one transaction may stay open across steps), messages scheduled
for later, messages leased to an immediate sender, other transactions holding rows locked
(a cancel in progress among them); brokers that refuse requests larger than a topic takes
and records too large even alone, a topic whose limit they do not say, a progress topic that
refuses large progress records, outages, a partition whose leader stalls. Then the faults
stop and the relays run free until nothing is left to send.

What is checked, as it happens and at the end (``World.check_*``):

- a batch is sent only by the relay whose owner session holds its shards;
- no relay sends a message again after its core was told Kafka has it, unless that relay
  lost something since (its sessions, its process, its producer): at-least-once's only
  duplicates; exactly-once, no message is committed twice;
- each key's messages first reach their partition in their order;
- a message goes dead only for a reason it has (too large even alone, its topic missing,
  undecodable, or its own failures up to the attempt limit), with its attempts counted;
  no message is charged an attempt for an outage;
- a message committed to a sleeping relay goes at once (the commit woke it);
- at the end every committed message is on its topic, and nothing is left pending.

A failing run prints its seed: ``World(seed, exactly_once=..., delete_on_send=...)`` replays
it exactly (the world draws everything from the seed; run with PYTHONHASHSEED=0 as the
suite does); ``world.notes`` tells what happened.

How much: ``OUTBOX_MODEL_RUNS`` runs per mode (default 14) of ``OUTBOX_MODEL_STEPS`` steps
(default 800), over a thousand batches in all. The second half of the file plants bugs in
the relay's own code, one at a time, and shows that the bounded search finds each.
"""

from __future__ import annotations

import inspect
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from outbox.relay import core, promotion
from outbox.relay.commands import Rebalanced, Recording, Woken
from outbox.relay.core import RelayCore
from outbox.relay.policy import ATTEMPTS_EXHAUSTED
from outbox.relay.reach import KafkaReach
from outbox.relay.reading import ReadPlanner
from outbox.relay.sender import AtLeastOnceSender
from outbox.rows import Failure
from tests.relay_sim import World

RUNS = int(os.environ.get("OUTBOX_MODEL_RUNS", "14"))
STEPS = int(os.environ.get("OUTBOX_MODEL_STEPS", "800"))
#: The most runs of the bounded search a planted bug may go unnoticed (each run is seeded:
#: the search finds the same world on every machine; on a quiet one the slowest catch below
#: takes about 30 s).
CATCH_RUNS = 400
MODES = ("at-least-once", "exactly-once")


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    """The relays log every fault the world makes; the test reads the world, not the log."""
    logging.disable(logging.CRITICAL)
    yield
    logging.disable(logging.NOTSET)


def world_of(seed: int, mode: str) -> World:
    """The run of ``seed``: its world after the faulty steps and the free run at the end."""
    world = World(seed, exactly_once=mode == "exactly-once", delete_on_send=seed % 3 == 2)
    world.run(STEPS)
    if not world.violations:
        world.finish()
    return world


def replay(world: World, mode: str) -> str:
    return f"seed {world.seed} ({mode}, delete_on_send={world.table.delete_on_send}): " + "; ".join(
        world.violations[:3]
    )


@pytest.mark.parametrize("mode", MODES)
def test_relays_keep_every_guarantee_in_a_faulty_world(mode: str) -> None:
    batches = 0
    for seed in range(RUNS):
        world = world_of(seed, mode)
        assert not world.violations, replay(world, mode)
        batches += world.batches
    assert batches >= 1000, f"only {batches} batches in {RUNS} runs: the search is too small"


# -- planted bugs ------------------------------------------------------------------------------


def patched(owner: Any, name: str, make: Callable[[Any], Any]) -> Callable[[], Iterator[None]]:
    """A bug: ``owner.name`` replaced by ``make(original)`` for the length of a search."""

    @contextmanager
    def plant() -> Iterator[None]:
        original = inspect.getattr_static(owner, name)  # a staticmethod stays one
        setattr(owner, name, make(getattr(owner, name)))
        try:
            yield
        finally:
            setattr(owner, name, original)

    return plant


def _send_keys_backwards(within: Any) -> Any:
    return lambda rows, room: list(reversed(within(rows, room)))


def _dead_at_once(retry: Any) -> Any:
    return lambda self, row, error: Failure(row.id, ATTEMPTS_EXHAUSTED, error.str(), None)


def _always_answered(_: Any) -> Any:
    return lambda self, sent, now: True


def _skip_suspects(cut: Any) -> Any:
    def cut_past(self: RelayCore, shard: int, rows: list[Any], full: bool) -> Any:
        return [row for row in rows if row.id not in self.suspects], None

    return cut_past


def _keep_lost_shards(rebalanced: Any) -> Any:
    def keeping(self: RelayCore, event: Rebalanced, now: float) -> Any:
        commands = rebalanced(self, event, now)
        self.owned.update(set(event.lost))
        return commands

    return keeping


def _free_held_shards(recorded: Any) -> Any:
    def freeing(
        self: RelayCore, recording: Recording, held: frozenset[uuid.UUID], now: float
    ) -> Any:
        commands = recorded(self, recording, held, now)
        for shard, number in list(self.busy.items()):
            if number == recording.number:
                del self.busy[shard]  # held rows' shards go on: their rows are read again
        return commands

    return freeing


def _never_halve(_: Any) -> Any:
    return lambda self, batch: None


def _promote_past_locked(_: Any) -> Any:
    return lambda due, free: [row for row in due if row.id in free]


def _drop_wakeups(_: Any) -> Any:
    return lambda self: None


def _stay_in_flight(stepped_aside: Any) -> Any:
    def stepping(self: RelayCore, released: Any, now: float) -> Any:
        if released is None:
            return []
        in_flight, busy = dict(self.in_flight), dict(self.busy)
        stepped_aside(self, released, now)
        self.in_flight.update(in_flight)  # what it sent goes on, and is recorded
        self.busy.update(busy)
        return []

    return stepping


def _forget_recovered(taken_over: Any) -> Any:
    def forgetting(self: RelayCore, event: Any, now: float) -> Any:
        event = type(event)(event.shards, {}, event.error)
        return taken_over(self, event, now)

    return forgetting


def _read_while_taking_over(next_read: Any) -> Any:
    def reading(self: RelayCore, now: float) -> Any:
        taking, self.taking_over = self.taking_over, set()
        try:
            return next_read(self, now)
        finally:
            self.taking_over = taking

    return reading


def _release_busy(rebalance: Any) -> Any:
    def releasing(self: RelayCore, now: float, waiting: Any) -> Any:
        command = rebalance(self, now, waiting)
        return type(command)(tuple(sorted(self.owned)), command.may_gain, command.join)

    return releasing


def _no_gapless(_: Any) -> Any:
    return staticmethod(lambda: {})


def _ignore_woken(handle: Any) -> Any:
    def handling(self: RelayCore, event: Any, now: float) -> Any:
        return [] if isinstance(event, Woken) else handle(self, event, now)

    return handling


#: Each bug, how it is planted, and the modes it can show in.
BUGS: dict[str, tuple[Callable[[], Any], tuple[str, ...]]] = {
    "a batch's keys sent backwards": (patched(core, "within_bytes", _send_keys_backwards), MODES),
    "a retriable failure made dead at once": (patched(RelayCore, "_retry", _dead_at_once), MODES),
    "an outage charged to the messages": (
        patched(KafkaReach, "answered_since", _always_answered),
        MODES,
    ),
    "a key's later messages sent past its suspect": (
        patched(RelayCore, "_cut", _skip_suspects),
        MODES,
    ),
    "shards let go but still read": (patched(RelayCore, "_rebalanced", _keep_lost_shards), MODES),
    "the shards of rows held by a row lock freed (defect 1 back)": (
        patched(RelayCore, "_recorded", _free_held_shards),
        MODES,
    ),
    "a refused request's records all made dead (defect 2 back)": (
        patched(core, "REFUSED_WITH_OTHERS", lambda _: frozenset()),
        MODES,
    ),
    "a transaction refused whole sent whole again (defect 3 back)": (
        patched(RelayCore, "_halve", _never_halve),
        ("exactly-once",),
    ),
    "a key's scheduled messages promoted past a locked one (defect 4 back)": (
        patched(promotion, "promotable", _promote_past_locked),
        MODES,
    ),
    "a writer's wake-up dropped": (patched(ReadPlanner, "woken", _drop_wakeups), MODES),
    "a wake-up ignored by the core": (patched(RelayCore, "handle", _ignore_woken), MODES),
    "batches kept in flight after stepping aside": (
        patched(RelayCore, "_stepped_aside", _stay_in_flight),
        MODES,
    ),
    "a take-over that marks nothing its last owner committed": (
        patched(RelayCore, "_taken_over", _forget_recovered),
        ("exactly-once",),
    ),
    "a shard read while it is taken over": (
        patched(RelayCore, "next_read", _read_while_taking_over),
        ("exactly-once",),
    ),
    "a busy shard let go": (patched(RelayCore, "_rebalance", _release_busy), MODES),
    "the main producer without the gap-less guarantee": (
        patched(AtLeastOnceSender, "_main_settings", _no_gapless),
        ("at-least-once",),
    ),
}


def search(modes: tuple[str, ...], most: int) -> tuple[World | None, int, float]:
    """Runs of the bounded search, the modes in turn, until one finds a violation or
    ``most`` runs were made: the failing world, the runs made, and how long it took."""
    began = time.monotonic()
    runs = 0
    for seed in range(most):
        for mode in modes:
            world = world_of(seed, mode)
            runs += 1
            if world.violations:
                return world, runs, time.monotonic() - began
            if runs >= most:
                return None, runs, time.monotonic() - began
    return None, runs, time.monotonic() - began


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_the_bounded_search_finds_a_planted_bug(bug: str) -> None:
    plant, modes = BUGS[bug]
    with plant():
        world, runs, took = search(modes, CATCH_RUNS)
    assert world is not None, f"{bug}: not found in {runs} runs ({took:.0f}s)"
    print(f"\n{bug}: found in run {runs} after {took:.1f}s: {world.violations[0]}")
