"""Whether this relay reaches Kafka, judged from what it saw (decides, does no I/O).

*Evidence* that the relay reaches Kafka is an acknowledged message, a take-over that fenced
a shard's last owner, or (while nothing of it waits for Kafka) a broker answering a probe.

- **An outage is Kafka's, not the messages'.** A batch that fails retriably charges its
  messages an attempt only while Kafka goes on taking this relay's later batches: one sent
  after it was acknowledged, the last ack at most :data:`LIVE_ACK_SECONDS` ago (a partition
  that stalls lets the later batches through; an outage does not, and a path cut just after
  an ack leaves that ack seconds old when the batches before it time out), and never for a
  batch sent while the relay was failing (into an outage: after it, a producer still
  reconnecting fails its batch while others' are taken). Else they stay
  pending, and the relay sends nothing for a pause (0.5 s doubling to
  :data:`EVIDENCE_SECONDS`, once a try: the batches that fail during a pause are of the
  failure that began it) before it tries again. So no message nears ``dead`` from an
  outage alone, and once Kafka is back what was pending goes within that pause.
- **Stalled.** Since the relay has had work that Kafka does not answer (a batch in flight
  with nothing acknowledged since it began, an outage pause, a failed take-over), it is
  *stalled*. A relay stalled for :data:`EVIDENCE_SECONDS` does not serve (it lets the other
  relays know through its serving lock), nor one that owns no shard and whose take-over
  failed since its last ack, whatever its probes say (a broker answering says nothing of the
  coordinator); stalled for :data:`STEP_ASIDE_AFTER` it steps aside
  if another relay serves, in either mode: its own path to Kafka may be what is broken.
- **Stepping aside** lasts :data:`STEP_ASIDE_SECONDS`, doubled at
  each step aside in a row (up to :data:`LONGEST_STEP_ASIDE`); the relay comes back sooner
  when no other member is left, or none has served for :data:`EVIDENCE_SECONDS`.
- A relay joins the members, or takes free shards, only with fresh evidence (at most
  :data:`EVIDENCE_SECONDS` old): one that cannot publish takes nothing from relays that can.
  An idle relay probes when its evidence is older than that.
"""

from __future__ import annotations

#: Evidence this old is fresh: the relay may join and take shards without a probe, and it
#: serves. Older, an idle relay probes; a relay stalled this long stops serving.
EVIDENCE_SECONDS = 5.0
#: A relay stalled this long steps aside if another relay serves: long enough that a batch
#: Kafka is slow to take (a leader moving, a broker restarting) does not move its shards.
STEP_ASIDE_AFTER = 10.0
#: An ack this recent shows Kafka still takes this relay's batches (see the module).
LIVE_ACK_SECONDS = 1.0
#: Out of the members the first time: as long as it was stalled before stepping aside.
STEP_ASIDE_SECONDS = STEP_ASIDE_AFTER
#: The longest step aside (four doublings of the first): each return costs the healthy relays
#: a hand-over, and a relay whose own path stays broken comes back only this often.
LONGEST_STEP_ASIDE = 160.0
#: The first pause after a failure: sending after a batch failed with no evidence (an
#: outage), connecting after the database was lost, recording rows another transaction
#: holds locked. Pauses double up to :data:`EVIDENCE_SECONDS`: what is pending goes at most
#: that long after Kafka (or the database) returns.
FIRST_PAUSE = 0.5


class KafkaReach:
    """What one relay knows of its reach to Kafka, on the core's clock."""

    def __init__(self) -> None:
        self.last_ack = float("-inf")
        #: When the newest batch Kafka acknowledged (some of) was sent: a batch that fails
        #: while a later one got through failed for its own reasons.
        self.newest_acked = float("-inf")
        self.last_probe = float("-inf")
        #: The last failed take-over: until an ack comes after it, probes do not make this
        #: relay serve unless it owns shards (a broker answering says nothing of its
        #: coordinator).
        self.take_over_failed = float("-inf")
        self.probing = False
        #: Since when a failure with no evidence (an outage, a failed take-over) holds.
        self.failing_since: float | None = None
        #: The last failure that ended: batches sent within it were sent into an outage.
        self._last_failure = (float("inf"), float("-inf"))
        self._probe_clears = True
        self._pause = 0.0
        self.paused_until = float("-inf")
        self.step_asides = 0
        self.rejoin_at = 0.0
        self._nobody_serving_since: float | None = None

    # -- what the relay saw ----------------------------------------------------------------

    def reached(self, now: float, sent: float | None = None) -> None:
        """Kafka took something of this relay (an ack of a batch ``sent`` then, a take-over
        that fenced)."""
        self.last_ack = now
        if sent is not None:
            self.newest_acked = max(self.newest_acked, sent)
        self._failure_ended(now)
        self._pause = 0.0
        self.paused_until = float("-inf")
        self.step_asides = 0
        self.rejoin_at = min(self.rejoin_at, now)  # evidence ends a pause: back early, it stays

    def probed(self, reached: bool, now: float, idle: bool) -> None:
        """A probe's answer; a broker answering an ``idle`` relay (nothing in flight, no
        pause) ends a failure that a probe may end (a batch's, not a take-over's)."""
        self.probing = False
        if reached:
            self.last_probe = now
            # A failed take-over is ended by a probe only once it is as old as a step aside's
            # wait: a relay whose take-overs keep failing steps aside meanwhile.
            old = self.failing_since is not None and now - self.failing_since >= STEP_ASIDE_AFTER
            if idle and (self._probe_clears or old):
                self._failure_ended(now)

    def failed(self, now: float, probe_clears: bool) -> None:
        """A batch or a take-over failed with no evidence since it began: pause sending.
        A failed take-over is ended only by evidence (``probe_clears`` False): a relay
        whose take-overs keep failing steps aside, however well its probes go."""
        if not probe_clears:
            self.take_over_failed = now
        if self.failing_since is None:
            self.failing_since = now
            self._probe_clears = probe_clears
        self._probe_clears = self._probe_clears and probe_clears
        if now < self.paused_until:
            return  # another batch of the same failure (every shard's ends at once)
        self._pause = min(EVIDENCE_SECONDS, max(FIRST_PAUSE, 2 * self._pause))
        self.paused_until = now + self._pause

    def stepped_aside(self, now: float) -> float:
        """The relay left the members: returns how long it stays out."""
        pause = min(LONGEST_STEP_ASIDE, STEP_ASIDE_SECONDS * 2.0**self.step_asides)
        self.step_asides += 1
        self.rejoin_at = now + pause
        self._nobody_serving_since = None
        self._failure_ended(now)
        return pause

    def _failure_ended(self, now: float) -> None:
        if self.failing_since is not None:
            self._last_failure = (self.failing_since, now)
        self.failing_since = None

    # -- what it decides -------------------------------------------------------------------

    def answered_since(self, sent: float, now: float) -> bool:
        """Whether Kafka took a batch sent after ``sent`` and still takes them (a failure of
        that one is its own)."""
        began, ended = self._last_failure
        if began <= sent <= ended or (
            self.failing_since is not None and sent >= self.failing_since
        ):
            return False  # sent into an outage
        return self.newest_acked > sent and now - self.last_ack <= LIVE_ACK_SECONDS

    def may_send(self, now: float) -> bool:
        return now >= self.paused_until

    def fresh(self, now: float, waiting_since: float | None) -> bool:
        """Fresh evidence: an ack lately, or a probe lately while nothing waited for Kafka."""
        probe = self.last_probe if waiting_since is None else float("-inf")
        return now - max(self.last_ack, probe) <= EVIDENCE_SECONDS

    def stalled_since(self, waiting_since: float | None) -> float | None:
        """Since when work of this relay has gone unanswered: ``waiting_since`` (its oldest
        batch in flight) unless an ack came since, or a failure with no evidence."""
        unanswered = None
        if waiting_since is not None and waiting_since > self.last_ack:
            unanswered = waiting_since
        started = [t for t in (unanswered, self.failing_since) if t is not None]
        return min(started, default=None)

    def serving(self, now: float, waiting_since: float | None, owns_shards: bool) -> bool:
        """Whether this relay tells the others that it reaches Kafka."""
        stalled = self.stalled_since(waiting_since)
        if stalled is not None and now - stalled >= EVIDENCE_SECONDS:
            return False
        probes_count = owns_shards or self.take_over_failed <= self.last_ack
        probe = self.last_probe if probes_count else float("-inf")
        return now - max(self.last_ack, probe) <= 2 * EVIDENCE_SECONDS

    def should_step_aside(self, now: float, waiting_since: float | None) -> bool:
        stalled = self.stalled_since(waiting_since)
        return stalled is not None and now - stalled >= STEP_ASIDE_AFTER

    def should_probe(self, now: float, waiting_since: float | None) -> bool:
        return not self.probing and not self.fresh(now, waiting_since) and waiting_since is None

    def may_rejoin(self, now: float, other_members: int, others_serving: int) -> bool:
        """A relay that stepped aside comes back when its pause ends, or sooner when its
        share has nobody to send it: no member left, or none serving for a while."""
        if now >= self.rejoin_at or other_members == 0:
            return True
        if others_serving > 0:
            self._nobody_serving_since = None
            return False
        if self._nobody_serving_since is None:
            self._nobody_serving_since = now
        return now - self._nobody_serving_since >= EVIDENCE_SECONDS
