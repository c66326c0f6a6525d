"""``outbox chaos``: the command line of a chaos run."""

from __future__ import annotations

import json
import secrets
import signal
import sys
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType

import click

from outbox.chaos.schedule import PROFILES, plan
from outbox.relay.config import AT_LEAST_ONCE, EXACTLY_ONCE


class _Seed(click.ParamType):  # type: ignore[type-arg]
    """A non-negative integer, or ``random`` (None: drawn when the run starts)."""

    name = "N|random"

    def convert(
        self, value: object, param: click.Parameter | None, ctx: click.Context | None
    ) -> int | None:
        if value is None:
            return None
        if isinstance(value, int) and value >= 0:
            return value
        text = str(value).strip().lower()
        if text == "random":
            return None
        if text.isdigit():
            return int(text)
        self.fail(f"{value!r} is neither a non-negative number nor 'random'", param, ctx)


SEED = _Seed()


@click.command()
@click.option(
    "--mode",
    type=click.Choice([AT_LEAST_ONCE, EXACTLY_ONCE]),
    default=AT_LEAST_ONCE,
    show_default=True,
    help="The relays' delivery mode.",
)
@click.option(
    "--seed",
    type=SEED,
    default="random",
    show_default=True,
    help="Fault schedule seed: a number, or 'random' to draw one (printed first, so that a "
    "failed run can be replayed with --seed N).",
)
@click.option(
    "--profile",
    type=click.Choice(sorted(PROFILES)),
    default="short",
    show_default=True,
    help="short: about 3 minutes in all; long: 20 minutes of faults (with a synchronous "
    "standby and failovers); failover: failovers alone, about 2 minutes.",
)
@click.option(
    "--duration",
    type=click.FloatRange(min=10),
    default=None,
    help="Seconds of writing under faults (default: the profile's). One of each fault kind "
    "runs even when it takes longer.",
)
@click.option(
    "--rate", type=click.FloatRange(min=1), default=None, help="Messages per second, all writers."
)
@click.option(
    "--consumers",
    type=click.IntRange(min=0, max=6),
    default=None,
    help="Inbox consumers of the consuming stage (default: the profile's, 3); 0 leaves the "
    "stage out, and its faults with it.",
)
@click.option(
    "--writer-processes",
    type=click.IntRange(min=0, max=6),
    default=None,
    help="Writers that are processes of their own, killed with -9 by the schedule (default: "
    "the profile's, 2; with immediate send in at-least-once runs); 0 leaves them out.",
)
@click.option(
    "--database-faults/--no-database-faults",
    default=True,
    help="Latency, resets and stalls on the relays' connections to PostgreSQL (default: on).",
)
@click.option(
    "--overlapping-faults/--no-overlapping-faults",
    default=True,
    help="Faults that land while another holds (default: on).",
)
@click.option(
    "--brokers",
    type=click.Choice(["1", "3", "5"]),
    default="1",
    show_default=True,
    help="Kafka nodes. 3 or 5: a KRaft cluster (replication factor = nodes, "
    "min.insync.replicas one less) whose broker restarts stop the node leading most "
    "partitions or coordinating most transactions, and which has two nodes down at once. "
    "(An odd count, so that one node down keeps the controllers' majority.)",
)
@click.option(
    "--replication",
    type=click.Choice(["sync", "async", "none"]),
    default=None,
    help="PostgreSQL's streaming standby, and with it the db_failover fault (the primary "
    "killed with -9, the standby promoted, a new standby built): synchronous or asynchronous "
    "replication, or none. Default: the profile's (long and failover: sync; short: none).",
)
@click.option(
    "--output",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Folder for the fault log, relay logs and reconciliation output "
    "(default: .stack/chaos/<time>-<mode>-<seed>).",
)
@click.option("--keep-data", is_flag=True, help="Keep the servers' data folders and logs.")
@click.option("--plan-only", is_flag=True, help="Print the fault schedule as JSON and exit.")
def chaos(
    mode: str,
    seed: int | None,
    profile: str,
    duration: float | None,
    rate: float | None,
    consumers: int | None,
    writer_processes: int | None,
    database_faults: bool,
    overlapping_faults: bool,
    brokers: str,
    replication: str | None,
    output: Path | None,
    keep_data: bool,
    plan_only: bool,
) -> None:
    """Break things on purpose and prove nothing was lost, invented or reordered.

    Starts a private PostgreSQL + Kafka, runs writers (some transactions rolled back on purpose;
    some writers are processes, killed with -9 mid-transaction and, at-least-once, sending
    immediately), three relays, and consumers applying every message to a second service's
    database through the inbox, and plays a fault schedule drawn from --seed: relay, consumer
    and writer kill -9, relay and consumer SIGTERM, broker stop/start, PostgreSQL restart, and
    latency, dropped and stalled connections to the broker and from the relays to PostgreSQL,
    and two of these at once. Then it drains, runs the
    reconciliation job, reads the topics back and checks that every committed message was
    applied once, in key order. The last line is the result as JSON. Exit 0: every guarantee
    held; 1: a violation; 2: the run could not be carried out.
    """
    if seed is None:
        seed = secrets.randbelow(2**31)
        click.echo(f"seed {seed} drawn at random: replay this run with --seed {seed}", err=True)
    chosen = PROFILES[profile]
    if consumers is not None:
        chosen = replace(chosen, consumers=consumers)
    if writer_processes is not None:
        chosen = replace(chosen, writer_processes=writer_processes)
    chosen = replace(
        chosen,
        database_path_faults=database_faults,
        overlapping_faults=overlapping_faults,
        brokers=int(brokers),
    )
    if replication is not None:
        chosen = replace(chosen, replication=None if replication == "none" else replication)
    if plan_only:
        for fault in plan(seed, chosen, duration):
            click.echo(json.dumps(fault.to_json()))
        return
    from outbox.chaos.run import ChaosRun, ChaosSettings

    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
    if output is None:
        from outbox.devstack.stack import stack_home

        output = stack_home() / "chaos" / f"{stamp}-{mode}-{seed}"
    settings = ChaosSettings(mode, seed, chosen, output, duration, rate, keep_data)
    # SIGTERM unwinds the run like Ctrl-C does, so that its servers and relays are stopped.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        result = ChaosRun(settings, echo=lambda line: click.echo(line)).execute()
    except KeyboardInterrupt:
        click.echo("outbox chaos: interrupted; its servers and relays are stopped", err=True)
        sys.exit(130)
    except Exception as exc:
        from outbox.redaction import mask_secrets

        error = mask_secrets(f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"[:500])
        click.echo(f"outbox chaos: the run could not be carried out: {error}", err=True)
        click.echo(json.dumps({"mode": mode, "seed": seed, "verdict": "ERROR", "error": error}))
        sys.exit(2)
    body = result.to_json()
    _print_report(body)
    click.echo(json.dumps(body))
    sys.exit(0 if body["verdict"] == "PASS" else 1)


def _interrupt(signum: int, _frame: FrameType | None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # let the clean-up finish
    raise KeyboardInterrupt


def _print_report(body: dict[str, object]) -> None:
    lines = [
        f"faults injected    {body['faults_injected']}  {body['faults_by_kind']}",
        f"messages committed {body['messages_committed']}  (rolled back on purpose: "
        f"{body['rolled_back']}; commits cut off: {body['uncertain_commits']}, of which "
        f"committed: {body['uncertain_committed']})",
        f"outbox rows        {body['outbox_rows']}; records read {body['topic_records']}",
        f"reconciliation     {body['reconciliation']}",
        f"missing {body['missing']}, phantom {body['phantom']}, duplicates {body['duplicates']}, "
        f"order violations {body['order_violations']} (not counted: "
        f"{body.get('unordered_overlaps', 0)} of overlapping transactions, which the relay "
        "does not order)",
    ]
    consuming = body.get("consuming")
    if isinstance(consuming, dict):
        lines += [
            f"consumers          {consuming['consumers']}; at the topics' end after "
            f"{consuming['catch_up_s']} s of waiting; SIGTERM exit codes "
            f"{consuming['term_exit_codes']}",
            f"applied            {consuming['applied']} (inbox rows {consuming['inbox_rows']}); "
            f"duplicates skipped by the inbox {consuming['duplicates_skipped']}; "
            f"parked {consuming['parked']}",
            f"applied: missing {consuming['missing']}, twice {consuming['applied_twice']}, "
            f"never committed {consuming['not_committed']}, order violations "
            f"{consuming['order_violations']}",
        ]
    handover = body.get("handover")
    per_shard = body.get("handover_per_shard")
    if isinstance(handover, dict):
        per_shard = per_shard if isinstance(per_shard, dict) else {}
        for kind in sorted({*handover, *per_shard}):
            parts = []
            if kind in handover:
                f = handover[kind]
                parts.append(
                    f"{f['gaps']} gaps, p50 {f['p50_s']} s, longest {f['max_s']} s, "
                    f"never closed {f['never_closed']}"
                )
            if kind in per_shard:
                f = per_shard[kind]
                parts.append(
                    f"each shard: {f['gaps']} times, p50 {f['p50_s']} s, longest {f['max_s']} s, "
                    f"never closed {f['never_closed']}"
                )
            lines.append(f"shards ownerless   after {kind}: " + "; ".join(parts))
    failovers = body.get("failovers")
    found = body.get("failover")
    if isinstance(failovers, list) and isinstance(found, dict):
        lines.append(
            f"failovers          {found['failovers']} ({found['replication']} standby); "
            f"forgotten by the promotions: rows {found['forgotten_rows']} (on a topic: "
            f"{found['forgotten_on_topic']}, the reconciliation's phantoms "
            f"{found['reconciliation_phantoms']}), marks {found['forgotten_sends']} (sent "
            f"again; {found['made_pending_again']} made pending again, excusing "
            f"{found['order_excused']} order violations), applications "
            f"{found['forgotten_applications']}; confirmed commits forgotten "
            f"{found['confirmed_forgotten']}"
        )
        for number, figures in enumerate(failovers, 1):
            lines.append(
                f"failover {number}         promoted after {figures['promoted_s']} s; first "
                f"relay send {figures['relay_first_send_s']} s after the kill; writer threads "
                f"failing {figures['writers_failing']} ({figures['writer_errors']} errors), "
                f"all committing again after {figures['writers_committing_again_s']} s; new "
                f"standby after {figures['standby_rebuilt_s']} s"
            )
    lines += [f"VIOLATION: {v}" for v in body["violations"]]  # type: ignore[attr-defined]
    lines.append(f"verdict            {body['verdict']}")
    for line in lines:
        click.echo(line)
