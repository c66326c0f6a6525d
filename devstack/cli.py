"""``outbox dev``: the local stack's command line (prepare, up, down, status)."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable
from typing import TypeVar

import click

T = TypeVar("T")


@click.group()
def dev() -> None:
    """The local stack: PostgreSQL + Apache Kafka (KRaft) + Spark jars on 127.0.0.1."""


@dev.command()
def prepare() -> None:
    """Install PostgreSQL and Chromium if missing, resolve the Kafka and Spark jars
    (idempotent)."""
    from outbox.devstack import prepare as prepare_stack

    _run_stack_step(prepare_stack)
    click.echo("local stack prepared")


@dev.command()
@click.option("--name", default="dev", show_default=True, help="Stack instance name.")
@click.option(
    "--brokers",
    type=click.IntRange(1, 5),
    default=None,
    help="Kafka nodes (broker + controller each). 3 gives a production-shaped cluster: "
    "replication factor 3, min.insync.replicas 2. Default: what the stack already runs, "
    "else 1.",
)
@click.option(
    "--standby",
    type=click.Choice(["sync", "async"]),
    default=None,
    help="A streaming standby of PostgreSQL beside the primary (pg_basebackup), with "
    "synchronous or asynchronous replication; OUTBOX_DATABASE_URL then lists both servers "
    "and follows the primary through `outbox dev promote`. Default: what the stack already "
    "runs, else none.",
)
def up(name: str, brokers: int | None, standby: str | None) -> None:
    """Start the stack (or keep it running) and print its connection settings, ready for
    ``eval "$(outbox dev up)"``."""
    from outbox.devstack import LocalStack

    info = _run_stack_step(lambda: LocalStack.named(name, brokers=brokers, standby=standby).up())
    for key, value in info.as_env().items():
        click.echo(f"{key}={shlex.quote(value)}")


@dev.command()
@click.option("--name", default="dev", show_default=True, help="Stack instance name.")
def promote(name: str) -> None:
    """Fail over: kill -9 the primary PostgreSQL and promote the standby.

    OUTBOX_DATABASE_URL stays as it was (it lists both servers); run `outbox dev up` to
    build a new standby from the new primary, on the old primary's port."""
    from outbox.devstack import LocalStack

    stack = LocalStack.named(name)
    server = _run_stack_step(stack.promote)
    click.echo(
        f"promoted the standby on port {server.port}; no standby now (the old primary was "
        f"killed): `outbox dev up --name {name}` builds a new one"
    )


@dev.command()
@click.option("--name", default="dev", show_default=True, help="Stack instance name.")
def down(name: str) -> None:
    """Stop the stack's servers and remove their data."""
    from outbox.devstack import LocalStack

    _run_stack_step(lambda: LocalStack.named(name).down())
    click.echo(f"stack '{name}' stopped")


@dev.command()
@click.option("--name", default="dev", show_default=True, help="Stack instance name.")
def status(name: str) -> None:
    """Say which of the stack's servers are running; exit 1 unless all are."""
    from outbox.devstack import LocalStack

    states = LocalStack.named(name).status()
    for server, running in states.items():
        click.echo(f"{server}: {'running' if running else 'stopped'}")
    sys.exit(0 if all(states.values()) else 1)


def _run_stack_step(step: Callable[[], T]) -> T:
    """Run a stack operation, turning its failure into one clear error line."""
    from outbox.devstack import StackError

    try:
        return step()
    except StackError as exc:
        raise click.ClickException(str(exc)) from exc
