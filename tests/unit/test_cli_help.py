"""`outbox relay --help` names the environment variable of every option the docs mention."""

from __future__ import annotations

import re
from pathlib import Path

import click
from click.testing import CliRunner

from outbox.cli import main

DOCS = Path(__file__).resolve().parents[2] / "docs"

# Every option of `outbox relay` that reads an environment variable.
RELAY_VARIABLES = {
    "OUTBOX_DATABASE_URL",
    "OUTBOX_SCHEMA",
    "OUTBOX_TABLE",
    "OUTBOX_KAFKA_BOOTSTRAP_SERVERS",
    "OUTBOX_RELAY_MODE",
    "OUTBOX_RELAY_BATCH_SIZE",
    "OUTBOX_RELAY_POLL_INTERVAL",
    "OUTBOX_RELAY_MAX_ATTEMPTS",
    "OUTBOX_RELAY_BACKOFF_BASE",
    "OUTBOX_RELAY_BACKOFF_MAX",
    "OUTBOX_RELAY_DELIVERY_TIMEOUT_MS",
    "OUTBOX_RELAY_METRICS_PORT",
    "OUTBOX_RELAY_METRICS_HOST",
    "OUTBOX_RELAY_TRANSACTIONAL_ID_PREFIX",
    "OUTBOX_RELAY_PROGRESS_TOPIC",
    "OUTBOX_RELAY_DELETE_ON_SEND",
    "OUTBOX_RELAY_SHUTDOWN_TIMEOUT",
    "OUTBOX_LOG_LEVEL",
}


def relay_help() -> str:
    result = CliRunner().invoke(main, ["relay", "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    return result.output


def test_relay_help_shows_every_environment_variable() -> None:
    text = relay_help()
    missing = sorted(name for name in RELAY_VARIABLES if f"env var: {name}" not in text)
    assert not missing


def test_relay_help_shows_every_variable_the_relay_docs_name() -> None:
    # OUTBOX_KAFKA_<NAME> passes any client setting through; -X's help explains the pattern.
    documented = set(
        re.findall(r"OUTBOX_(?:RELAY_[A-Z_]+|[A-Z_]+)", (DOCS / "relay.md").read_text())
    )
    relay_options = {
        name
        for name in documented
        if name.startswith("OUTBOX_RELAY_")
        or name in {"OUTBOX_DATABASE_URL", "OUTBOX_SCHEMA", "OUTBOX_TABLE", "OUTBOX_LOG_LEVEL"}
        or name == "OUTBOX_KAFKA_BOOTSTRAP_SERVERS"
    }
    assert relay_options, "docs/relay.md names no relay variables"
    text = relay_help()
    assert not sorted(name for name in relay_options if name not in text)
    assert "OUTBOX_KAFKA_<NAME>" in text


def test_lazy_commands_list_the_help_their_commands_give() -> None:
    # `outbox --help` shows LAZY_COMMANDS' text without importing the commands' modules.
    import importlib

    from outbox.cli import LAZY_COMMANDS

    for name, lazy in LAZY_COMMANDS.items():
        command = getattr(importlib.import_module(lazy.module), lazy.attribute)
        assert command.name == name
        assert command.get_short_help_str(1000) == lazy.short_help, name


def test_the_top_level_help_loads_neither_kafka_nor_spark_nor_prometheus() -> None:
    import subprocess
    import sys

    script = (
        "import sys\n"
        "import outbox\n"
        "from outbox.cli import main\n"
        "try:\n"
        "    main(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = ('confluent_kafka', 'pyspark', 'prometheus_client', 'outbox.relay',"
        " 'outbox.spark_jobs', 'outbox.devstack', 'outbox.chaos')\n"
        "print(sorted(m for m in sys.modules if m.startswith(heavy)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout
    assert "relay" in out and "reconcile" in out  # the help listed them ...
    assert out.strip().splitlines()[-1] == "[]"  # ... and loaded none of them


def every_command() -> list[tuple[str, click.Command]]:
    """Every command of `outbox`, sub-commands of groups included, by its full name."""
    found: list[tuple[str, click.Command]] = []

    def visit(prefix: str, group: click.Group) -> None:
        context = click.Context(group)
        for name in group.list_commands(context):
            command = group.get_command(context, name)
            assert command is not None, name
            full = f"{prefix} {name}".strip()
            if isinstance(command, click.Group):
                visit(full, command)
            else:
                found.append((full, command))

    visit("", main)
    return found


def test_every_environment_variable_an_option_reads_shows_in_help() -> None:
    commands = every_command()
    assert {"relay", "consume", "checkback", "db upgrade"} <= {name for name, _ in commands}
    hidden = []
    for name, command in commands:
        text = CliRunner().invoke(main, [*name.split(), "--help"], terminal_width=200).output
        for param in command.params:
            if not isinstance(param, click.Option) or param.hidden or not param.envvar:
                continue
            variables = [param.envvar] if isinstance(param.envvar, str) else param.envvar
            hidden += [f"{name} {param.opts[0]}: {v}" for v in variables if v not in text]
    assert not hidden


def test_the_daemons_share_their_common_options() -> None:
    commands = dict(every_command())
    for name, prefix in (
        ("relay", "OUTBOX_RELAY"),
        ("consume", "OUTBOX_CONSUME"),
        ("checkback", "OUTBOX_CHECKBACK"),
    ):
        options = {param.name: param for param in commands[name].params}
        for option, variable in (
            ("metrics_port", f"{prefix}_METRICS_PORT"),
            ("metrics_host", f"{prefix}_METRICS_HOST"),
            ("start_timeout", f"{prefix}_START_TIMEOUT"),
            ("log_level", "OUTBOX_LOG_LEVEL"),
            ("log_format", "OUTBOX_LOG_FORMAT"),
        ):
            assert options[option].envvar == variable, (name, option)
