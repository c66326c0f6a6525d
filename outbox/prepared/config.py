"""The check-back runner's settings, validated in one place, and its backoff between checks."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from outbox.errors import ConfigError
from outbox.outages import DATABASE_OUTAGE_LIMIT
from outbox.schema import DEAD, ROLLED_BACK, OutboxTableSpec

#: How a message ends when check-back gives up on it (``on_max_checks``): dead for an operator
#: to decide (``outbox prepared commit/rollback``), or rolled back, as RocketMQ does, once
#: the last check blocked the step.
ROLLBACK_AT_MAX, DEAD_AT_MAX = "rollback", "dead"
_END_STATUS = {ROLLBACK_AT_MAX: ROLLED_BACK, DEAD_AT_MAX: DEAD}
#: Upper bounds of the settings in seconds: beyond them a value is a mistake, and overflows
#: the database's interval arithmetic or a thread's wait.
MAX_SHORT_SECONDS = 86400.0
MAX_LONG_SECONDS = 10 * 365 * 86400.0


@dataclass(frozen=True)
class CheckbackConfig:
    """Everything ``outbox checkback`` needs; see ``outbox checkback --help``."""

    database_url: str
    spec: OutboxTableSpec = field(default_factory=OutboxTableSpec)
    #: Seconds a checker may take; past it the check counts as ``timeout``.
    check_timeout: float = 10.0
    #: Checks run at once (each in a thread of its own), and rows claimed per round.
    concurrency: int = 4
    #: Seconds between looks for due checks when the last look found none.
    poll_interval: float = 1.0
    #: Seconds to the check after the first check without a verdict (UNKNOWN, an error, a
    #: timeout), doubling with each further one up to ``backoff_max`` (RocketMQ checks every
    #: 60 s).
    check_interval: float = 60.0
    backoff_max: float = 600.0
    #: Checks without a verdict before the message ends as ``on_max_checks`` says
    #: (RocketMQ's transactionCheckMax, 15).
    max_checks: int = 15
    #: ``dead`` (the default): an operator decides (``outbox prepared commit/rollback``),
    #: alerted by the ``outbox_checkback_expired`` counter. ``rollback``: the last check is
    #: asked to decide (:attr:`~outbox.prepared.CheckMessage.final`) and the message is
    #: rolled back, as RocketMQ does, when it answers ROLLBACK (the checker blocked the
    #: step); anything else to it (UNKNOWN, an error, a timeout) ends the message dead all the
    #: same, since the step may still commit.
    on_max_checks: str = DEAD_AT_MAX
    #: Checker calls past their timeout that may pile up before /healthz reports the runner
    #: unhealthy (a supervisor then restarts it).
    max_hung_checks: int = 16
    #: Seconds the database may stay out of reach before /healthz reports the runner
    #: unhealthy (/readyz does at once).
    database_outage_limit: float = DATABASE_OUTAGE_LIMIT
    #: Seconds between counts of the prepared messages (the ``prepared`` gauges).
    count_interval: float = 10.0
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        for name in ("check_timeout", "poll_interval", "count_interval", "database_outage_limit"):
            if not getattr(self, name) <= MAX_SHORT_SECONDS:
                raise ConfigError(f"{name} must be at most {MAX_SHORT_SECONDS:g} s (a day)")
        for name in ("check_interval", "backoff_max"):
            if not getattr(self, name) <= MAX_LONG_SECONDS:
                raise ConfigError(f"{name} must be at most {MAX_LONG_SECONDS:g} s (ten years)")
        if self.check_timeout <= 0:
            raise ConfigError("the check timeout must be positive")
        if not 1 <= self.concurrency <= 256:
            raise ConfigError("concurrency must be between 1 and 256")
        if self.poll_interval <= 0 or self.count_interval <= 0 or self.database_outage_limit <= 0:
            raise ConfigError(
                "the poll and count intervals and the database outage limit must be positive"
            )
        if self.check_interval <= 0 or self.backoff_max < self.check_interval:
            raise ConfigError("the check interval must be positive and at most the backoff max")
        if self.max_checks < 1:
            raise ConfigError("max checks must be at least 1")
        if self.on_max_checks not in _END_STATUS:
            raise ConfigError(
                f"on_max_checks must be {ROLLBACK_AT_MAX!r} or {DEAD_AT_MAX!r}, "
                f"got {self.on_max_checks!r}"
            )
        if self.max_hung_checks < 1:
            raise ConfigError("max hung checks must be at least 1")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError("metrics port must be between 0 and 65535")

    @property
    def end_status(self) -> str:
        """The status a message ends in after ``max_checks`` checks without a verdict, when
        the last one blocked the step (``rollback``: rolled back) or was not asked to."""
        return _END_STATUS[self.on_max_checks]

    def final_check(self, checks_made: int) -> bool:
        """Whether the next check of a message checked ``checks_made`` times must decide:
        its last one, under ``on_max_checks="rollback"``."""
        return self.on_max_checks == ROLLBACK_AT_MAX and checks_made + 1 >= self.max_checks

    @property
    def lease_seconds(self) -> float:
        """How long a runner holds the rows it checks: a round lasts ``check_timeout`` at
        most, plus the time to record it."""
        return 2 * self.check_timeout + 10

    def delay_after(self, checks: int) -> float:
        """Seconds to the next check after ``checks`` checks without a verdict: the interval
        doubling from ``check_interval`` up to ``backoff_max``, jittered down by up to half so
        that the checks of messages prepared together spread out."""
        ceiling = min(self.backoff_max, self.check_interval * 2 ** max(0, checks - 1))
        return random.uniform(ceiling / 2, ceiling)
