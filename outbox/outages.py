"""How long a daemon's database has been out of reach, for its ``/healthz``.

``/readyz`` turns 503 the moment the database stops answering: a load balancer should stop
sending work, but a supervisor should not restart anything for a database restart that
takes seconds. Past ``limit`` seconds of outage (a wrong password after a rotation, a
database that was dropped, a connection pool stuck on a dead address) ``/healthz`` turns 503
too, so that a supervisor restarts the daemon and someone looks. The outage counts from the
daemon's start until the database first answers: a daemon that cannot reach its database
at all turns unhealthy after ``limit`` too.
"""

from __future__ import annotations

import time

#: Seconds the database may stay out of reach before ``/healthz`` reports the daemon
#: unhealthy (the consumer's and the check-back runner's default).
DATABASE_OUTAGE_LIMIT = 120.0


class DatabaseOutage:
    """``database_ok`` with the time it turned false: mixed into a :class:`LoopHealth`."""

    database_outage_limit: float = DATABASE_OUTAGE_LIMIT
    _database_down_since: float | None = None
    _database_ok: bool = False

    @property
    def database_ok(self) -> bool:
        return self._database_ok

    @database_ok.setter
    def database_ok(self, value: bool) -> None:
        if value:
            self._database_down_since = None
        elif self._database_ok or self._database_down_since is None:
            self._database_down_since = time.monotonic()
        self._database_ok = value

    def database_outage_problems(self) -> list[str]:
        """``database out of reach for N s`` past the limit, else nothing."""
        since = self._database_down_since
        if self._database_ok or since is None:
            return []
        seconds = time.monotonic() - since
        if seconds < self.database_outage_limit:
            return []
        return [f"database out of reach for {seconds:.0f}s"]
