"""The relays under test: ``outbox relay`` processes, started, killed and restarted by index."""

from __future__ import annotations

from pathlib import Path

from outbox.chaos.fleet import ProcessFleet
from outbox.relay.config import EXACTLY_ONCE

# Short timings, so that faults turn into retries (not only into waits) and the run drains
# quickly; every other setting is the relay's default.
RELAY_ARGS = (
    "--poll-interval",
    "0.2",
    "--batch-size",
    "200",
    "--delivery-timeout-ms",
    "15000",
    "--backoff-max",
    "5",
)


def transactional_prefix(run_id: str) -> str:
    """The relays' ``--transactional-id-prefix`` in exactly-once runs (``<it>-<shard>``)."""
    return f"chaos-{run_id}"


class RelayFleet(ProcessFleet):
    """``count`` relays; each writes its output to ``<logs>/relay-<i>.log``."""

    def __init__(
        self,
        count: int,
        database_url: str,
        bootstrap: str,
        mode: str,
        logs: Path,
        run_id: str,
    ) -> None:
        args = ["relay", *RELAY_ARGS, "--mode", mode]
        if mode == EXACTLY_ONCE:
            args += [
                "--transactional-id-prefix",
                transactional_prefix(run_id),
                "--progress-topic",
                f"chaos-progress-{run_id}",
            ]
        super().__init__("relay", count, args, database_url, bootstrap, logs)
