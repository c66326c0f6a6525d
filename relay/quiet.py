"""Which shards a look found empty, and as of which database snapshot.

A relay that keeps up reads its idle shards again and again, and most reads find nothing.
A read costs the database about a millisecond of CPU; asking for the current snapshot
(``pg_current_snapshot()``) costs a small fraction of that. A shard found empty at snapshot
*S* still holds nothing to send while the snapshot is still *S*: any commit of a transaction
that wrote (a writer's, a relay's mark, anyone's) changes the snapshot (its ``xmax`` grows,
or an xid leaves its list of transactions in progress), so an unchanged snapshot means
nothing committed since.
Rows may also become due with time alone (a retry's backoff ends, an immediate sender's lease
runs out), so a look stands for at most :data:`QUIET_FOR` seconds.

The snapshot is taken before the read, so a commit made between the two makes the next
snapshot differ: a look never stands for more than it saw.

The relay's own marks commit too, one per batch. A mark only sets rows sent that a read took,
and a read that takes rows of a shard drops its look, so a snapshot that differs only by
transactions the relay knows are its own marks still stands for the shards found empty.
(A look stands only for a read with the same window, which, at-least-once, changes with the
number of shards owned: a read's size bounds what it can call empty.) Any other commit, a
NOTIFY of a relay going to sleep included, makes the next read a real one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

#: Own marks remembered, and the most transactions a changed snapshot is searched for
#: others (more than that ended: something else is going on, read).
OWN_KEPT = 256
MOST_ENDED = 64

#: Longest a look that found a shard empty stands for it while nothing commits: rows also
#: become due with time alone (the end of a retry's backoff, of an immediate sender's lease).
QUIET_FOR = 0.05


class QuietShards:
    """Shards found empty, each with the snapshot taken before the look, its time and the
    shard's window then."""

    def __init__(self, quiet_for: float = QUIET_FOR) -> None:
        self.quiet_for = quiet_for
        self._looks: dict[int, tuple[str, float, int]] = {}
        self._own: set[int] = set()
        self._own_order: deque[int] = deque()
        #: Snapshots known to differ only by own marks from an earlier one: (earlier, later).
        self._same: tuple[str, str] | None = None

    def own(self, xid: int) -> None:
        """The transaction ``xid`` was one of this relay's marks (called by the threads that
        record them: each step is one operation on a built-in, atomic under the GIL)."""
        self._own.add(xid)
        self._own_order.append(xid)
        if len(self._own_order) > OWN_KEPT:
            self._own.discard(self._own_order.popleft())

    def unchanged(self, shards: Sequence[int], snapshot: str, now: float, window: int) -> bool:
        """Whether every one of ``shards`` was found empty with the same ``window`` less than
        ``quiet_for`` seconds before ``now``, at a snapshot that differs from ``snapshot`` by
        own marks at most: a read of them now would find nothing committed since."""
        for shard in shards:
            look = self._looks.get(shard)
            if look is None or now - look[1] >= self.quiet_for or look[2] != window:
                return False
            if look[0] != snapshot and not self._only_own_ended(look[0], snapshot):
                return False
        return True

    def _only_own_ended(self, before: str, after: str) -> bool:
        if self._same == (before, after):
            return True
        ended = ended_between(before, after)
        if ended is None or not ended <= self._own:
            return False
        self._same = (before, after)
        return True

    def saw(
        self,
        shards: Iterable[int],
        found: Iterable[int],
        snapshot: str,
        now: float,
        whole: bool,
        window: int,
    ) -> None:
        """A read of ``shards`` with a shard ``window``, after ``snapshot`` was taken at
        ``now``, found rows of the shards in ``found``. ``whole``: the read was not cut short
        by its size, so the others had nothing in their windows that could go."""
        found = set(found)
        for shard in shards:
            if whole and shard not in found:
                self._looks[shard] = (snapshot, now, window)
            else:
                self._looks.pop(shard, None)

    def drop(self, shards: Iterable[int]) -> None:
        """``shards`` were read without a snapshot (behind a backlog): their looks are gone."""
        for shard in shards:
            self._looks.pop(shard, None)

    def forget(self) -> None:
        """The session was lost: look again before trusting a look."""
        self._looks.clear()
        self._same = None


def ended_between(before: str, after: str) -> set[int] | None:
    """The transactions that ended between two snapshots (``xmin:xmax:xip,...`` text, the
    later one second); None when more than :data:`MOST_ENDED` may have."""
    _, before_xmax, before_running = parse_snapshot(before)
    _, after_xmax, after_running = parse_snapshot(after)
    if after_xmax - before_xmax > MOST_ENDED:
        return None
    # Below a snapshot's xmax every transaction has ended but those it lists as running.
    ended = {xid for xid in before_running if xid not in after_running}
    ended.update(x for x in range(before_xmax, after_xmax) if x not in after_running)
    return ended


def parse_snapshot(text: str) -> tuple[int, int, set[int]]:
    """``pg_current_snapshot()`` as text: xmin, xmax and the transactions in progress."""
    xmin, xmax, running = text.split(":")
    return int(xmin), int(xmax), {int(xid) for xid in running.split(",") if xid}
