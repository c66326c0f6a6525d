"""``outbox checkback`` (the check-back runner) and ``outbox prepared ...`` (the operator's
view of prepared messages), registered on the ``outbox`` command line by ``outbox.cli``."""

from __future__ import annotations

import sys
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import click

from outbox.cli import dead_show
from outbox.cli_options import (
    DATABASE_URL,
    SCHEMA,
    TABLE,
    check_database_at_start,
    daemon_options,
    database_engine,
    database_outage_limit_option,
    message_selection,
    modules_from_working_directory,
    on_stop_signals,
    run_db_step,
    table_spec,
)
from outbox.errors import OutboxError
from outbox.redaction import mask_secrets

if TYPE_CHECKING:
    from outbox.prepared.checkers import CheckRegistry


@click.command()
@click.argument("target", metavar="MODULE:REGISTRY")
@DATABASE_URL
@SCHEMA
@TABLE
@click.option(
    "--check-timeout",
    default=10.0,
    show_default=True,
    envvar="OUTBOX_CHECKBACK_TIMEOUT",
    show_envvar=True,
    help="Seconds a checker may take; past it the check counts as a timeout.",
)
@click.option(
    "--concurrency",
    default=4,
    show_default=True,
    envvar="OUTBOX_CHECKBACK_CONCURRENCY",
    show_envvar=True,
    help="Checks run at once, each in a thread of its own.",
)
@click.option(
    "--poll-interval",
    default=1.0,
    show_default=True,
    envvar="OUTBOX_CHECKBACK_POLL_INTERVAL",
    show_envvar=True,
    help="Seconds between looks for due checks when none was due.",
)
@click.option(
    "--check-interval",
    default=60.0,
    show_default=True,
    envvar="OUTBOX_CHECKBACK_CHECK_INTERVAL",
    show_envvar=True,
    help="Seconds to the next check after one without a verdict, doubling each time.",
)
@click.option(
    "--backoff-max",
    default=600.0,
    show_default=True,
    envvar="OUTBOX_CHECKBACK_BACKOFF_MAX",
    show_envvar=True,
    help="The longest wait between two checks of a message.",
)
@click.option(
    "--max-checks",
    default=15,
    show_default=True,
    envvar="OUTBOX_CHECKBACK_MAX_CHECKS",
    show_envvar=True,
    help="Checks without a verdict before a message ends as --on-max-checks says.",
)
@click.option(
    "--on-max-checks",
    type=click.Choice(["dead", "rollback"]),
    default="dead",
    show_default=True,
    envvar="OUTBOX_CHECKBACK_ON_MAX_CHECKS",
    show_envvar=True,
    help="dead: an operator decides (outbox prepared commit/rollback); rollback: the message "
    "is rolled back, unless a check failed (the checker raised or timed out): then dead.",
)
@click.option(
    "--max-hung-checks",
    default=16,
    show_default=True,
    envvar="OUTBOX_CHECKBACK_MAX_HUNG_CHECKS",
    show_envvar=True,
    help="Timed-out checker calls still running before /healthz reports the runner unhealthy.",
)
@database_outage_limit_option("OUTBOX_CHECKBACK")
@daemon_options("OUTBOX_CHECKBACK")
def checkback(
    target: str,
    database_url: str,
    schema: str,
    table: str,
    check_timeout: float,
    concurrency: int,
    poll_interval: float,
    check_interval: float,
    backoff_max: float,
    max_checks: int,
    on_max_checks: str,
    max_hung_checks: int,
    database_outage_limit: float,
    metrics_port: int | None,
    metrics_host: str,
    start_timeout: float,
    log_level: str,
    log_format: str | None,
) -> None:
    """Check prepared messages with MODULE:REGISTRY's checkers until stopped.

    MODULE:REGISTRY names an outbox.prepared.CheckRegistry, e.g. myapp.checks:registry. Run it
    in the service that prepares the messages. SIGTERM finishes the round of checks in hand.
    """
    import logging
    import threading

    from outbox.logs import configure_logging

    configure_logging(log_level, log_format)
    log = logging.getLogger("outbox.checkback")
    stop_early = threading.Event()

    on_stop_signals(stop_early.set, log, "stopping while it starts")

    from outbox.prepared.checkers import load_registry
    from outbox.prepared.config import CheckbackConfig
    from outbox.prepared.runner import CheckbackRunner

    modules_from_working_directory()
    try:
        registry = load_registry(target)
        config = CheckbackConfig(
            database_url=database_url,
            spec=table_spec(schema, table),
            check_timeout=check_timeout,
            concurrency=concurrency,
            poll_interval=poll_interval,
            check_interval=check_interval,
            backoff_max=backoff_max,
            max_checks=max_checks,
            on_max_checks=on_max_checks,
            max_hung_checks=max_hung_checks,
            database_outage_limit=database_outage_limit,
            metrics_port=metrics_port,
            metrics_host=metrics_host,
        )
        runner = CheckbackRunner(registry, config)
        if not check_database_at_start(
            database_url, runner.store.problem, start_timeout, stop_early.wait, log
        ):
            sys.exit(0)  # stopped while it waited for the database
    except (OutboxError, ValueError) as exc:
        raise click.ClickException(mask_secrets(str(exc))) from exc
    on_stop_signals(runner.stop, log, "finishing the round of checks in hand, then stopping")
    if stop_early.is_set():
        runner.stop()
    sys.exit(runner.run())


@click.group()
def prepared() -> None:
    """Inspect prepared messages; commit or roll back those waiting for a verdict."""


def _store(schema: str, table: str) -> Any:
    from outbox.prepared.store import PreparedStore

    return PreparedStore(table_spec(schema, table))


def load_checkers(target: str | None) -> CheckRegistry | None:
    """The CheckRegistry that a ``--checker MODULE:REGISTRY`` option names (a module of the
    working directory too), or None without one; one that does not load fails the command."""
    if target is None:
        return None
    from outbox.prepared.checkers import load_registry

    modules_from_working_directory()
    try:
        return load_registry(target)
    except (OutboxError, ValueError) as exc:
        raise click.ClickException(mask_secrets(str(exc))) from exc


@prepared.command("list")
@DATABASE_URL
@SCHEMA
@TABLE
@click.option("--topic", default=None)
@click.option("--group", default=None, help="Only this check group's messages.")
@click.option("--limit", default=50, show_default=True)
@click.option(
    "--unblocked",
    is_flag=True,
    help="List instead the rolled-back messages whose step nothing blocked before the "
    "rollback, newest first: their step may have happened (commit one with --after-rollback).",
)
def prepared_list(
    database_url: str,
    schema: str,
    table: str,
    topic: str | None,
    group: str | None,
    limit: int,
    unblocked: bool,
) -> None:
    """List messages waiting for a verdict (prepared, or left dead by check-back), oldest
    first; or, with --unblocked, the rolled-back messages whose step may have happened."""

    store = _store(schema, table)

    def run(engine: Any) -> None:
        with engine.connect() as conn:
            if unblocked:
                rows = store.unblocked_rollbacks(conn, topic=topic, check_group=group, limit=limit)
            else:
                rows = store.unresolved(conn, topic=topic, check_group=group, limit=limit)
        now = datetime.now(UTC)
        for row in rows:
            key = row["key"].decode(errors="replace") if row["key"] is not None else "-"
            age = int((now - row["prepared_at"]).total_seconds())
            head = f"{row['id']}  {row['topic']}  key={key}  group={row['check_group']}  "
            checks = (
                f"checks={row['check_count']}  failed={row['check_failures']}  "
                f"last={row['last_check_answer'] or '-'}"
            )
            if unblocked:
                resolved = row["resolved_at"]
                click.echo(
                    f"{head}{row['status']}  by={row['resolved_by']}  "
                    f"at={resolved.isoformat(timespec='seconds') if resolved else '-'}  "
                    f"age={age}s  {checks}"
                )
            else:
                due = row["next_check_at"]
                click.echo(
                    f"{head}{row['status']}  age={age}s  {checks}  "
                    f"next={due.isoformat(timespec='seconds') if due else '-'}"
                )
        if unblocked:
            click.echo(
                f"{len(rows)} rolled-back message(s) whose step was not blocked: if one's step "
                "happened, `outbox prepared commit --after-rollback ID` publishes it"
            )
        else:
            click.echo(f"{len(rows)} message(s) waiting for a verdict")

    with database_engine(database_url) as engine:
        run_db_step(lambda: run(engine))


prepared.add_command(dead_show, "show")


def _chosen(
    message_ids: tuple[Any, ...], topic: str | None, group: str | None, everything: bool
) -> None:
    if not (message_ids or topic or group or everything):
        raise click.UsageError("name message ids, or pass --topic, --group or --all")


@prepared.command(
    "commit",
    help="Commit messages waiting for a verdict: they become pending and are published. "
    "Exits 1 when it committed nothing, or not every id given.",
)
@message_selection("Only this topic's messages.", "Every message waiting for a verdict.")
@click.option("--group", default=None, help="Only this check group's messages.")
@click.option(
    "--after-rollback",
    is_flag=True,
    help="Commit the given messages that check-back or an operator rolled back (not their "
    "producer): the step happened after all. They are published now. One whose idempotency "
    "key a retry took since is refused.",
)
def prepared_commit(
    database_url: str,
    schema: str,
    table: str,
    topic: str | None,
    everything: bool,
    message_ids: tuple[Any, ...],
    group: str | None,
    after_rollback: bool,
) -> None:
    _chosen(message_ids, topic, group, everything)
    if after_rollback and (topic or group or everything or not message_ids):
        raise click.UsageError("--after-rollback takes message ids only")
    from outbox.prepared.api import after_rollback_refusal
    from outbox.prepared.decisions import decide

    store = _store(schema, table)

    def run(engine: Any) -> tuple[int, list[str]]:
        with engine.begin() as conn:
            count = decide(
                conn,
                store,
                commit=True,
                ids=list(message_ids),
                topic=topic,
                check_group=group,
                after_rollback=after_rollback,
            )
        if not after_rollback or count == len(set(message_ids)):
            return count, []
        with engine.connect() as conn:  # why the others were not committed
            rows = store.rolled_back_statuses(conn, list(message_ids))
        refusals = (after_rollback_refusal(i, rows.get(i)) for i in dict.fromkeys(message_ids))
        return count, [str(refusal) for refusal in refusals if refusal is not None]

    with database_engine(database_url) as engine:
        count, reasons = run_db_step(lambda: run(engine))
    click.echo(f"committed {count} prepared message(s)")
    for reason in reasons:
        click.echo(reason, err=True)
    missed = len(set(message_ids)) - count
    if message_ids and missed and not after_rollback:
        click.echo(
            f"{missed} of the ids given were not waiting for a verdict "
            "(see outbox prepared show ID)",
            err=True,
        )
    if count == 0 or (message_ids and missed):
        sys.exit(1)  # a script must see that nothing (or not all it named) was decided


@prepared.command(
    "rollback",
    help="Roll back messages waiting for a verdict: they are never published. Each message's "
    "checker (--checker) is asked first to decide, as check-back's last check is, and only "
    "those it answers ROLLBACK to (it blocked the step) are rolled back; without --checker, "
    "or --step-cannot-happen, it refuses: a step may still commit. Exits 1 when it rolled "
    "back nothing, or not every message chosen.",
)
@message_selection("Only this topic's messages.", "Every message waiting for a verdict.")
@click.option("--group", default=None, help="Only this check group's messages.")
@click.option(
    "--checker",
    "checker_target",
    metavar="MODULE:REGISTRY",
    default=None,
    help="The service's CheckRegistry (as `outbox checkback` takes it): its checkers decide.",
)
@click.option(
    "--check-timeout",
    default=10.0,
    show_default=True,
    help="Seconds each checker may take (with --checker); past it the message is left.",
)
@click.option(
    "--step-cannot-happen",
    is_flag=True,
    help="Roll back without asking: you made sure the steps can no longer happen. "
    "`outbox prepared list --unblocked` lists such rollbacks.",
)
def prepared_rollback(
    database_url: str,
    schema: str,
    table: str,
    topic: str | None,
    everything: bool,
    message_ids: tuple[Any, ...],
    group: str | None,
    checker_target: str | None,
    check_timeout: float,
    step_cannot_happen: bool,
) -> None:
    _chosen(message_ids, topic, group, everything)
    if checker_target and step_cannot_happen:
        raise click.UsageError("pass --checker or --step-cannot-happen, not both")
    from outbox.prepared.decisions import operator_rollback

    store = _store(schema, table)
    registry = load_checkers(checker_target)
    with database_engine(database_url) as engine:
        result = run_db_step(
            lambda: operator_rollback(
                engine,
                store,
                registry,
                ids=list(message_ids),
                topic=topic,
                check_group=group,
                step_cannot_happen=step_cannot_happen,
                check_timeout=check_timeout,
            )
        )
    count = result.rolled_back
    click.echo(f"rolled back {count} prepared message(s)")
    for message_id, why in result.refused.items():
        click.echo(f"{message_id}: not rolled back: {why}", err=True)
    not_waiting = len(set(message_ids) - result.found)
    every_one = count == len(result.found)
    if not_waiting:
        click.echo(
            f"{not_waiting} of the ids given were not waiting for a verdict "
            "(see outbox prepared show ID)",
            err=True,
        )
    if count == 0 or not_waiting or not every_one:
        sys.exit(1)  # a script must see that nothing (or not all it chose) was rolled back
