"""Which of a key's messages the order promise covers: the transactions that took turns.

The relay promises a key's messages in ``seq`` order among the messages it can see
(docs/relay.md, "What in order means"). A message becomes visible when the transaction that
made it pending commits: the writer's, or for a scheduled message the relay's promotion when
it fell due (for a prepared one, its commit). Two such transactions that overlapped are not
ordered: the one that took the lower ``seq`` may commit after the other's message was sent,
as with two writers of one key that do not take turns. So of two messages a, b with
``seq(a) < seq(b)``, a must come first only if a was visible when b's transaction wrote b
(or both come from one transaction).

To tell, the run keeps for each such transaction its id and its snapshot while it wrote: the
business table's row for a writer's (:data:`outbox.chaos.writers.CREATE_BUSINESS_TABLE`), and
a row written by a trigger for each message made pending with a new seq
(:data:`RECORD_MADE_PENDING`). A snapshot says which transactions had committed.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Where the run records each message made pending with a new ``seq`` after it was written
#: (a scheduled one falling due, a prepared one committed): by a trigger, in the transaction
#: that did it, with that transaction's id and snapshot. The function runs as its owner: the
#: relays' role needs no grant on the table.
MADE_PENDING_TABLE = "chaos_made_pending"
RECORD_MADE_PENDING = (
    f"""
    CREATE TABLE IF NOT EXISTS {MADE_PENDING_TABLE} (
        id uuid NOT NULL,
        seq bigint NOT NULL,
        xact xid8 NOT NULL DEFAULT pg_current_xact_id(),
        seen pg_snapshot NOT NULL DEFAULT pg_current_snapshot())
    """,
    f"""
    CREATE OR REPLACE FUNCTION {MADE_PENDING_TABLE}_record() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog AS $record$
    BEGIN
        INSERT INTO public.{MADE_PENDING_TABLE} (id, seq) VALUES (NEW.id, NEW.seq);
        RETURN NULL;
    END
    $record$
    """,
    f"DROP TRIGGER IF EXISTS {MADE_PENDING_TABLE} ON outbox",
    f"""
    CREATE TRIGGER {MADE_PENDING_TABLE} AFTER UPDATE OF status ON outbox FOR EACH ROW
    WHEN (NEW.status = 'pending' AND OLD.status <> 'pending' AND NEW.seq <> OLD.seq)
    EXECUTE FUNCTION {MADE_PENDING_TABLE}_record()
    """,
)


@dataclass(frozen=True)
class Snapshot:
    """A PostgreSQL snapshot (``pg_snapshot``): every transaction below ``xmin`` had ended,
    none from ``xmax`` on had, and of those between, the ones in ``running`` had not."""

    xmin: int
    xmax: int
    running: frozenset[int]

    @classmethod
    def parse(cls, text: str) -> Snapshot:
        """From its text form, ``xmin:xmax:xip,xip,...``."""
        xmin, xmax, running = text.split(":")
        return cls(int(xmin), int(xmax), frozenset(int(x) for x in running.split(",") if x))

    def ended(self, xact: int) -> bool:
        """Whether transaction ``xact`` had ended (for a row that exists: committed)."""
        return xact < self.xmin or (xact < self.xmax and xact not in self.running)


@dataclass(frozen=True)
class MadeBy:
    """The transaction that made a message pending (its id) and its snapshot while it did."""

    xact: int
    seen: Snapshot

    @classmethod
    def parse(cls, xact: str | None, seen: str | None) -> MadeBy | None:
        if xact is None or seen is None:
            return None
        return cls(int(xact), Snapshot.parse(seen))


def must_precede(first: MadeBy | None, then: MadeBy | None) -> bool:
    """Whether a message made pending by ``first``, with a lower ``seq``, must reach its
    topic before one made pending by ``then``: one transaction made both, or ``first`` had
    committed when ``then`` wrote. Unknown transactions are taken as ordered."""
    if first is None or then is None or first.xact == then.xact:
        return True
    return then.seen.ended(first.xact)
